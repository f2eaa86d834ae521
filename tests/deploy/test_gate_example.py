"""deploy/gate/vllm-behind-gate.yaml: vLLM with batchpilot-gate as its sidecar, wired so that every
request goes through the gate, the gate's cap cannot pass vLLM's own, and the profile finds the gate."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from batchpilot_operator.api.crd import custom_resource_definition
from batchpilot_operator.api.profile import parse_manifest
from batchpilot_runtime.gate import cli as gate_cli
from tests.support.crd_validation import validate_object

from .tools import DEPLOY, KUBERNETES_VERSION, labels_match, load_documents, one

MANIFEST = DEPLOY / "gate" / "vllm-behind-gate.yaml"


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return load_documents(MANIFEST.read_text())


def _containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def _vllm_flags(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


def test_every_object_validates(docs: list[dict[str, Any]]) -> None:
    assert sorted(d["kind"] for d in docs) == ["BatchProfile", "Deployment", "Service"]
    for doc in docs:
        if doc["kind"] == "BatchProfile":
            _, errors = validate_object(custom_resource_definition(), doc)
            assert errors == []
            parse_manifest(doc)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_gate_fronts_vllm_within_its_cap(docs: list[dict[str, Any]]) -> None:
    containers = _containers(docs)
    vllm = _vllm_flags(containers["vllm"])
    gate = containers["gate"]
    assert gate["command"] == ["batchpilot-gate"]
    config = gate_cli.config_from_args(gate_cli.build_parser().parse_args(gate["args"]))
    # vLLM listens on loopback only, where the gate sends every request.
    assert vllm["host"] == "127.0.0.1"
    assert config.upstream == f"http://127.0.0.1:{vllm['port']}"
    # The gate's ceiling is vLLM's own cap: no window the gate takes can ask vLLM for more.
    assert config.limits.max_hard_cap == int(vllm["max-num-seqs"])
    profile = parse_manifest(one(docs, "BatchProfile"))[2]
    assert profile.tuning.bounds.hard_cap.max == config.limits.max_hard_cap
    # The gate cannot change a per-step prompt budget: the profile neither sets nor tunes one.
    assert profile.window.max_prefill_tokens is None and profile.slo.inter_token_p99_ms is None
    assert (config.window.target_batch_size, config.window.hard_cap, config.window.max_wait_ms) == (
        profile.window.target_batch_size,
        profile.window.hard_cap,
        profile.window.max_wait_ms,
    )


def test_the_profile_and_the_service_find_the_gate(docs: list[dict[str, Any]]) -> None:
    gate = _containers(docs)["gate"]
    config = gate_cli.config_from_args(gate_cli.build_parser().parse_args(gate["args"]))
    ports = {p["name"]: p["containerPort"] for p in gate["ports"]}
    profile = one(docs, "BatchProfile")["spec"]
    pod = one(docs, "Deployment")["spec"]["template"]
    assert labels_match(profile["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert profile.get("engine", "batchpilot") == "batchpilot"  # the gate speaks batchpilot's admin API and metrics
    assert profile["model"] == config.model_name
    assert profile["runtime"]["servePort"] == ports["http"] == config.port
    assert profile["runtime"]["adminPort"] == ports["admin"] == config.admin_port
    service = one(docs, "Service")
    assert labels_match(service["spec"]["selector"], pod["metadata"]["labels"])
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    secret = profile["runtime"]["adminTokenSecret"]
    (mount,) = [m for m in gate["volumeMounts"] if m["name"] == "admin-token"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "admin-token"]
    assert str(config.admin_token_file) == f"{mount['mountPath']}/{secret['key']}"
    assert volume["secret"]["secretName"] == secret["name"]
