"""Loading BatchProfiles from files (validate, local mode), local mode's --runtime, kubeconfig, status patches."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest

from batchpilot_operator.api.manifests import load_profiles
from batchpilot_operator.control.status import (
    FALSE,
    TRUE,
    ConditionFact,
    StatusFacts,
    apply_merge_patch,
    build_status,
    merge_patch,
)
from batchpilot_operator.frontends.local import parse_runtime
from batchpilot_operator.io.kube import load_kube_config

GOOD = """apiVersion: batchpilot.dev/v1alpha1
kind: BatchProfile
metadata: {name: chat, namespace: ml}
spec:
  model: chat
  selector: {matchLabels: {app: chat}}
  window: {targetBatchSize: 16, hardCap: 32, maxWaitMs: 20}
  slo: {p99Ms: 800}
"""


def test_load_profiles_keeps_valid_and_invalid_apart_and_skips_other_kinds(tmp_path: Path) -> None:
    bad = GOOD.replace("name: chat,", "name: bad,").replace("targetBatchSize: 16", "targetBatchSize: 64")
    (tmp_path / "a.yaml").write_text(GOOD + "---\n" + bad + "---\nkind: Kustomization\n---\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "list.yml").write_text(
        "kind: List\nitems:\n- " + GOOD.replace("name: chat", "name: listed").replace("\n", "\n  ")
    )
    (tmp_path / "notes.txt").write_text("not yaml: [")
    loaded = load_profiles(tmp_path)
    assert [(p.namespace, p.name, p.error is None) for p in loaded] == [
        ("ml", "chat", True),
        ("ml", "bad", False),
        ("ml", "listed", True),
    ]
    assert loaded[1].error is not None and "spec.window" in loaded[1].error and loaded[1].spec is None
    assert loaded[0].spec is not None and loaded[0].spec.window.hard_cap == 32


def test_load_profiles_reports_broken_yaml_and_missing_paths(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("kind: BatchProfile\nspec: [unclosed\n")
    (loaded,) = load_profiles(tmp_path / "broken.yaml")
    assert loaded.error is not None and loaded.error.startswith("invalid YAML")
    with pytest.raises(FileNotFoundError):
        load_profiles(tmp_path / "absent")


def test_wrong_api_version_is_named(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(GOOD.replace("v1alpha1", "v9"))
    (loaded,) = load_profiles(tmp_path / "p.yaml")
    assert loaded.error is not None and "apiVersion/kind" in loaded.error


def test_metadata_that_is_not_a_mapping_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(GOOD.replace("metadata: {name: chat, namespace: ml}", "metadata: [chat, ml]"))
    (loaded,) = load_profiles(tmp_path / "p.yaml")
    assert (loaded.namespace, loaded.name, loaded.spec) == ("default", None, None)
    assert loaded.problems == ("metadata: must be a mapping, got a list",)


def test_an_invalid_name_is_not_repeated_as_the_profiles_name(tmp_path: Path) -> None:
    # The problem shows it, cut short; a megabyte name must not be printed again on every line.
    (tmp_path / "p.yaml").write_text(GOOD.replace("name: chat,", f"name: {'a' * 1_000_000},"))
    (loaded,) = load_profiles(tmp_path / "p.yaml")
    assert (loaded.namespace, loaded.name) == ("ml", None)
    assert loaded.problems == (
        f'metadata.name: Invalid value: "{"a" * 64}..." (1000000 characters): must be no more than 253 characters',
    )


def test_a_file_the_reader_refuses_is_one_problem_of_that_file(tmp_path: Path) -> None:
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 500 + "]" * 500 + "\n")
    (tmp_path / "good.yaml").write_text(GOOD)
    refused, good = load_profiles(tmp_path)
    assert (refused.source, refused.name, refused.spec) == (str(tmp_path / "deep.yaml"), None, None)
    assert refused.problems == (refused.error,)
    assert refused.error is not None and refused.error.startswith("refused: nested deeper than 100 levels")
    assert (good.key, good.error) == ("ml/chat", None)


def test_parse_runtime_flag(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    runtime = parse_runtime(f"model=chat,url=http://a:8000/,admin=http://a:8001,token-file={token}", 3)
    assert (runtime.model, runtime.url, runtime.admin, runtime.token, runtime.name) == (
        "chat", "http://a:8000", "http://a:8001", "s3cret", "chat-3")  # fmt: skip
    for text, problem in (
        ("model=chat,url=http://a", "admin= is required"),
        ("model=chat,url=a:1,admin=http://b", "url= must be an http(s) URL"),
        ("model=chat,url=http://a,admin=http://b,colour=red", "unknown key 'colour'"),
        ("model=chat,url=http://a,admin=http://b,token-file=/nonexistent", "token-file /nonexistent does not exist"),
        ("chat", "expected KEY=VALUE"),
    ):
        with pytest.raises(ValueError, match=re.escape(problem)):
            parse_runtime(text)


def test_kubeconfig_token_and_ca_data(tmp_path: Path) -> None:
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n").decode()
    path = tmp_path / "config"
    path.write_text(
        "apiVersion: v1\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: 'https://k:6443/', certificate-authority-data: {ca}}}}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u, namespace: ml}}]\n"
        "users: [{name: u, user: {token: abc}}]\n"
    )
    config = load_kube_config(path)
    assert (config.server, config.authorization(), config.namespace) == ("https://k:6443", ("Bearer", "abc"), "ml")
    ca_path = config.configuration.ssl_ca_cert
    assert ca_path is not None and "BEGIN CERTIFICATE" in Path(ca_path).read_text()
    with pytest.raises(ValueError, match="context 'other' not found"):
        load_kube_config(path, "other")


def test_merge_patch_round_trips_and_is_empty_when_unchanged() -> None:
    old = {"a": 1, "b": {"c": 2, "d": 3}, "e": [1, 2]}
    new = {"a": 1, "b": {"c": 5}, "e": [1], "f": "x"}
    patch = merge_patch(old, new)
    assert patch == {"b": {"c": 5, "d": None}, "e": [1], "f": "x"}
    assert apply_merge_patch(old, patch) == new
    assert merge_patch(new, new) == {}


def test_condition_transition_time_kept_while_status_unchanged() -> None:
    facts = StatusFacts(generation=3, ready=ConditionFact(TRUE, "Ready", "ok"))
    first = build_status(facts, None, "2026-01-01T00:00:00Z")
    same = build_status(StatusFacts(generation=3, ready=ConditionFact(TRUE, "Ready", "still")), first, "later")
    flipped = build_status(StatusFacts(generation=4, ready=ConditionFact(FALSE, "NoReadyPods")), same, "now")

    def ready(status: dict[str, object]) -> dict[str, object]:
        return next(c for c in status["conditions"] if c["type"] == "Ready")  # type: ignore[attr-defined,index]

    assert ready(same)["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert ready(flipped)["lastTransitionTime"] == "now" and ready(flipped)["observedGeneration"] == 4
    assert {c["type"] for c in first["conditions"]} == {"Ready", "Synced", "MetricsAvailable", "SLOMet"}
