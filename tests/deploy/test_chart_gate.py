"""The chart's models on other engines (models[].engine, gate.enabled): vLLM or SGLang on loopback
in the pod, batchpilot-gate beside it on the runtime ports.

A gated model is tunable live only when what the chart renders agrees in four places: every
request reaches the engine through the gate (the engine listens on loopback, the Service and the
profile name the gate's ports), the gate's ceiling is the engine's own cap and the profile's cap
bound, the gate starts with the profile's window and lanes, and the engine outlives the gate's
drain. Values the gate cannot serve are refused at render time, naming the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from batchpilot_operator.api.profile import parse_manifest
from batchpilot_runtime.gate import cli as gate_cli
from batchpilot_runtime.gate.cli import GateConfig

from .tools import CHART, REPO, find, helm_template, labels_match, one

DOCS = REPO / "docs"

GATED = CHART / "ci" / "gate-values.yaml"


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return helm_template(GATED)


def _pod(docs: list[dict[str, Any]], model: str) -> dict[str, Any]:
    pod: dict[str, Any] = one(docs, "Deployment", f"bp-batchpilot-{model}")["spec"]["template"]
    return pod


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["spec"]["containers"]}


def _flags(args: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in args)


def _gate_config(container: dict[str, Any]) -> GateConfig:
    return gate_cli.config_from_args(gate_cli.build_parser().parse_args(container["args"]))


@pytest.mark.parametrize(("model", "cap_flag"), [("llama", "max-num-seqs"), ("qwen", "max-running-requests")])
def test_the_gate_fronts_the_engine_within_its_cap(docs: list[dict[str, Any]], model: str, cap_flag: str) -> None:
    containers = _containers(_pod(docs, model))
    assert sorted(containers) == ["engine", "gate"]
    engine = _flags(containers["engine"]["args"])
    config = _gate_config(containers["gate"])
    assert containers["gate"]["command"] == ["batchpilot-gate"]
    # The engine listens on loopback only, where the gate sends every request.
    assert engine["host"] == "127.0.0.1"
    assert config.upstream == f"http://127.0.0.1:{engine['port']}"
    assert not containers["engine"].get("ports")
    # One cap: the engine's own is the gate's ceiling, and the profile's bound never passes it
    # (it is the bound when the values give none; qwen's gives 96 under 128).
    profile = parse_manifest(one(docs, "BatchProfile", f"bp-batchpilot-{model}"))[2]
    assert int(engine[cap_flag]) == config.limits.max_hard_cap >= profile.tuning.bounds.hard_cap.max
    if model == "llama":
        assert profile.tuning.bounds.hard_cap.max == config.limits.max_hard_cap
    # The engine answers to the name the gate's metrics and the profile carry.
    assert engine["served-model-name"] == config.model_name == profile.model
    window = profile.window
    assert (config.window.target_batch_size, config.window.hard_cap, config.window.max_wait_ms) == (
        window.target_batch_size,
        window.hard_cap,
        window.max_wait_ms,
    )
    assert config.window.tail_mark_ratio == window.tail_mark_ratio
    assert [lane.name for lane in config.lanes] == [lane.name for lane in profile.lanes]
    assert config.limits.max_queue == 512


def test_the_user_args_follow_the_charts_and_sglang_gets_its_launcher(docs: list[dict[str, Any]]) -> None:
    llama = _containers(_pod(docs, "llama"))["engine"]
    assert llama["image"] == "vllm/vllm-openai:v0.11.0" and "command" not in llama  # the image's entrypoint
    assert llama["args"][-3:] == ["--model=/models/llama", "--max-num-batched-tokens=2048", "--max-model-len=8192"]
    assert _gate_config(_containers(_pod(docs, "llama"))["gate"]).max_model_len == 8192
    qwen = _containers(_pod(docs, "qwen"))["engine"]
    assert qwen["command"] == ["python3", "-m", "sglang.launch_server"]
    assert _flags(qwen["args"])["port"] == "30000"
    assert {e["name"] for e in qwen["env"]} >= {"HOME", "HF_HOME", "HF_TOKEN"}


def test_the_service_the_scrape_and_the_profile_reach_the_gate(docs: list[dict[str, Any]]) -> None:
    for model in ("llama", "qwen"):
        pod = _pod(docs, model)
        gate = _containers(pod)["gate"]
        config = _gate_config(gate)
        ports = {p["name"]: p["containerPort"] for p in gate["ports"]}
        assert (ports["http"], ports["admin"]) == (config.port, config.admin_port)
        profile = one(docs, "BatchProfile", f"bp-batchpilot-{model}")["spec"]
        # The gate speaks batchpilot's admin API and metrics: the profile's engine stays batchpilot.
        assert profile.get("engine", "batchpilot") == "batchpilot"
        assert profile["runtime"] == {"servePort": ports["http"], "adminPort": ports["admin"]}
        assert labels_match(profile["selector"]["matchLabels"], pod["metadata"]["labels"])
        service = one(docs, "Service", f"bp-batchpilot-{model}")
        assert labels_match(service["spec"]["selector"], pod["metadata"]["labels"])
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])
        # Ready when the engine is (the gate's /readyz asks its /health).
        assert gate["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_the_engine_outlives_the_gates_drain(docs: list[dict[str, Any]]) -> None:
    for model in ("llama", "qwen"):
        pod = _pod(docs, model)
        containers = _containers(pod)
        drain = _gate_config(containers["gate"]).drain_timeout_s
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        assert containers["engine"]["lifecycle"]["preStop"] == {"sleep": {"seconds": int(drain)}}
        assert drain < grace


def test_the_engine_gets_the_gpus_the_checkpoint_and_writable_caches(docs: list[dict[str, Any]]) -> None:
    pod = _pod(docs, "llama")
    engine, gate = _containers(pod)["engine"], _containers(pod)["gate"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(gate["resources"])
    # The gate runs on the CPU build of the runtime image.
    assert gate["image"] == "ghcr.io/batchpilot/batchpilot-runtime:0.1.0"
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert mounts["checkpoint"] == {
        "name": "checkpoint",
        "mountPath": "/models/llama",
        "readOnly": True,
        "subPath": "llama-3.1-8b-instruct",
    }
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert {"cache", "tmp"} <= set(mounts) and engine["securityContext"]["readOnlyRootFilesystem"] is True
    qwen_volumes = {v["name"]: v for v in _pod(docs, "qwen")["spec"]["volumes"]}
    assert qwen_volumes["cache"]["emptyDir"]["sizeLimit"] == "40Gi"
    assert "admin-token" not in {m["name"] for m in engine["volumeMounts"]}  # the token is the gate's alone


def test_a_bound_given_below_the_engines_cap_is_kept(docs: list[dict[str, Any]]) -> None:
    bounds = one(docs, "BatchProfile", "bp-batchpilot-qwen")["spec"]["tuning"]["bounds"]
    assert bounds["hardCap"] == {"min": 16, "max": 96}
    assert _gate_config(_containers(_pod(docs, "qwen"))["gate"]).limits.max_hard_cap == 128


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["gate.enabled=false"], r"models\[0\].engine: .*set gate.enabled=true"),
        (["models[1].preset=tiny"], r"models\[1\]: preset .* loads its own"),
        (["models[0].profile.window.maxPrefillTokens=1024"], r"maxPrefillTokens: batchpilot-gate cannot bound"),
        (["models[0].profile.slo.interTokenP99Ms=80"], r"interTokenP99Ms: the objective moves the per-step"),
        (["models[1].profile.tuning.bounds.hardCap.max=256"], r"hardCap.max 256 exceeds models\[1\].engine.max"),
        (["models[0].engine.maxRunning=16"], r"window.hardCap 32 exceeds models\[0\].engine.maxRunning 16"),
        (["models[0].engine.args={--port=9000}"], r"models\[0\].engine.args: --port is the chart's"),
        (["models[1].engine.args={--max-running-requests=8}"], r"--max-running-requests is the chart's"),
        (["models[0].engine.kind=tgi"], r"kind"),
        (["models[0].engine.maxRunning=null"], r"maxRunning"),
    ],
)
def test_values_a_gate_cannot_serve_are_refused(sets: list[str], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        helm_template(GATED, sets=sets)


def test_an_engine_of_another_kind_gets_only_its_own_args() -> None:
    docs = helm_template(
        GATED,
        sets=[
            "models[1].engine.kind=other",
            "models[1].engine.image=ghcr.io/huggingface/text-generation-inference:3.3.4",
            "models[1].engine.args={--hostname=127.0.0.1,--port=30000,--max-concurrent-requests=128}",
        ],
    )
    containers = _containers(_pod(docs, "qwen"))
    assert containers["engine"]["args"] == ["--hostname=127.0.0.1", "--port=30000", "--max-concurrent-requests=128"]
    assert "command" not in containers["engine"]
    assert _gate_config(containers["gate"]).upstream == "http://127.0.0.1:30000"


def test_models_without_an_engine_keep_the_runtime(docs: list[dict[str, Any]]) -> None:
    mixed = helm_template(GATED, sets=["models[2].name=tiny", "models[2].preset=tiny"])
    containers = _containers(_pod(mixed, "tiny"))
    assert list(containers) == ["runtime"] and containers["runtime"]["args"][0] == "serve"
    assert len(find(mixed, "BatchProfile")) == 3


def test_the_values_docs_gate_md_shows_render_a_gated_model(tmp_path: Path) -> None:
    page = (DOCS / "gate.md").read_text()
    section = page.split("## From the Helm chart", 1)[1]
    snippet = re.findall(r"^```yaml\n(.*?)^```", section, re.MULTILINE | re.DOTALL)[0]
    values = tmp_path / "values.yaml"
    values.write_text(snippet)
    docs = helm_template(values)
    containers = _containers(_pod(docs, "llama"))
    assert sorted(containers) == ["engine", "gate"]
    assert _gate_config(containers["gate"]).limits.max_hard_cap == 64
    assert "--max-num-seqs=64" in containers["engine"]["args"]


def test_a_hung_engine_is_restarted_after_its_load(docs: list[dict[str, Any]]) -> None:
    """The engine's liveness runs in its container (it listens on loopback, where the kubelet's
    httpGet does not reach) and asks the /health the gate's readiness asks; a startup probe gives
    the model its load time first."""
    for model, port in (("llama", 8000), ("qwen", 30000)):
        engine = _containers(_pod(docs, model))["engine"]
        command = engine["livenessProbe"]["exec"]["command"]
        assert command[:2] == ["python3", "-c"] and f"'http://127.0.0.1:{port}/health'" in command[2]
        assert engine["startupProbe"]["exec"] == engine["livenessProbe"]["exec"]
        assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] == 1800
        assert "readinessProbe" not in engine
    custom = helm_template(
        GATED,
        sets=[
            "models[0].engine.livenessProbe.httpGet.path=/health",
            "models[0].engine.livenessProbe.httpGet.port=9000",
            "models[0].engine.livenessProbe.periodSeconds=30",
            "models[0].engine.startupSeconds=600",
            "models[1].engine.livenessProbe=false",
        ],
    )
    llama = _containers(_pod(custom, "llama"))["engine"]
    assert llama["livenessProbe"] == {"httpGet": {"path": "/health", "port": 9000}, "periodSeconds": 30}
    assert llama["startupProbe"] == {
        "httpGet": {"path": "/health", "port": 9000},
        "periodSeconds": 10,
        "failureThreshold": 60,
    }
    qwen = _containers(_pod(custom, "qwen"))["engine"]
    assert "livenessProbe" not in qwen and "startupProbe" not in qwen


def test_an_engine_of_another_kind_gets_no_probe_unless_given() -> None:
    docs = helm_template(GATED, sets=["models[1].engine.kind=other", "models[1].engine.args={--port=30000}"])
    assert "livenessProbe" not in _containers(_pod(docs, "qwen"))["engine"]
    with pytest.raises(AssertionError, match="livenessProbe"):
        helm_template(GATED, sets=["models[1].engine.livenessProbe=true"])


def _llamacpp_values(tmp_path: Path, args: list[str]) -> Path:
    """gate-values.yaml with its second model on llama-server (values in a file: --set would make numbers)."""
    import yaml

    values = yaml.safe_load(GATED.read_text())
    values["models"][1]["engine"] = {
        "kind": "llamacpp", "image": "ghcr.io/ggml-org/llama.cpp:server", "maxRunning": 16, "port": 8000, "args": args,
    }  # fmt: skip
    values["models"][1]["profile"]["tuning"]["bounds"]["hardCap"] = {"min": 4, "max": 16}
    values["models"][1]["profile"]["window"] = {"targetBatchSize": 4, "hardCap": 8, "maxWaitMs": 0}
    path = tmp_path / "llamacpp-values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_llama_server_runs_behind_the_gate_with_its_flags_as_separate_args(tmp_path: Path) -> None:
    """llama-server (models[].engine.kind llamacpp, an image the user names) listens on loopback, answers to the
    model's name, has the gate's ceiling as its slots and serves its llamacpp:* metrics; its parser takes no
    --flag=N (common/arg.cpp), so each value is the next arg."""
    docs = helm_template(GATED, _llamacpp_values(tmp_path, ["-m", "/models/qwen/model.gguf", "-c", "32768"]))
    containers = _containers(_pod(docs, "qwen"))
    assert containers["engine"]["image"] == "ghcr.io/ggml-org/llama.cpp:server"
    assert containers["engine"]["args"] == [
        "--host", "127.0.0.1", "--port", "8000", "--alias", "qwen", "--parallel", "16", "--metrics",
        "-m", "/models/qwen/model.gguf", "-c", "32768",
    ]  # fmt: skip
    assert "command" not in containers["engine"]
    config = _gate_config(containers["gate"])
    assert config.upstream == "http://127.0.0.1:8000"
    assert config.limits.max_hard_cap == 16
    # llama-server's own series reach Prometheus through the gate's scrape, labelled with the model, and
    # its profile reads them as llama-server's.
    assert config.engine_metrics_path == "/metrics"
    (profile,) = [d for d in docs if d["kind"] == "BatchProfile" and d["spec"]["model"] == "qwen"]
    assert profile["spec"]["engine"] == "llamacpp"


@pytest.mark.parametrize("flag", ["--parallel", "-np", "--alias", "--port"])
def test_a_llamacpp_flag_the_chart_sets_is_refused_in_the_users_args(tmp_path: Path, flag: str) -> None:
    with pytest.raises(AssertionError, match=f"{flag} is the chart's for a llamacpp engine"):
        helm_template(GATED, _llamacpp_values(tmp_path, [flag, "4"]))
