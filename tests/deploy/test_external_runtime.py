"""Runtimes outside the chart: deploy/external-runtime/chat.yaml is wired like the chart's own, and
kube-prometheus-stack scrapes them through the chart's switch or deploy/prometheus/runtimes-podmonitor.yaml.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from batchpilot_operator.api.crd import custom_resource_definition
from batchpilot_operator.api.profile import parse_manifest
from batchpilot_runtime.cli import main as runtime_cli
from tests.support.crd_validation import validate_object

from .test_quickstart import QUICKSTART, _token_source
from .tools import DEPLOY, KUBERNETES_VERSION, find, helm_template, kustomize, labels_match, load_documents, one

MANIFEST = DEPLOY / "external-runtime" / "chat.yaml"
STANDALONE_MONITOR = DEPLOY / "prometheus" / "runtimes-podmonitor.yaml"
KPS = "monitoring.podMonitor.labels.release=kube-prometheus-stack"
SWITCH = ["monitoring.podMonitor.enabled=true", "monitoring.podMonitor.externalRuntimes.enabled=true", KPS]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return load_documents(MANIFEST.read_text())


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    template: dict[str, Any] = one(docs, "Deployment")["spec"]["template"]
    return template


def test_every_object_validates(docs: list[dict[str, Any]]) -> None:
    assert sorted(d["kind"] for d in docs) == ["BatchProfile", "Deployment", "NetworkPolicy", "Service"]
    for doc in docs:
        assert doc["metadata"]["namespace"] == "team-a"
        if doc["kind"] == "BatchProfile":
            _, errors = validate_object(custom_resource_definition(), doc)
            assert errors == []
            parse_manifest(doc)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_profile_selects_the_pods_and_names_their_ports_and_model(docs: list[dict[str, Any]]) -> None:
    profile = one(docs, "BatchProfile")
    pod = _pod(docs)
    assert labels_match(profile["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    container = pod["spec"]["containers"][0]
    args = runtime_cli.build_parser().parse_args(container["args"])
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    runtime = profile["spec"]["runtime"]
    assert runtime["servePort"] == named["http"] == args.port
    assert runtime["adminPort"] == named["admin"] == args.admin_port
    assert profile["spec"]["model"] == args.model_name
    window = profile["spec"]["window"]
    assert (args.target_batch_size, args.hard_cap, args.max_wait_ms) == (
        window["targetBatchSize"],
        window["hardCap"],
        window["maxWaitMs"],
    )
    service = one(docs, "Service")
    assert labels_match(service["spec"]["selector"], pod["metadata"]["labels"])
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_the_pods_mount_the_secret_the_profile_names(docs: list[dict[str, Any]]) -> None:
    # The operator's own token goes only to its own namespace: team-a's pods need a Secret of team-a.
    secret = one(docs, "BatchProfile")["spec"]["runtime"]["adminTokenSecret"]
    deployment = one(docs, "Deployment")
    args = runtime_cli.build_parser().parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert _token_source(deployment, str(args.admin_token_file)) == (secret["name"], secret["key"])


@pytest.mark.parametrize("install", ["chart", "kustomize"])
def test_only_the_operator_reaches_the_admin_port(docs: list[dict[str, Any]], install: str) -> None:
    if install == "chart":
        operator_docs = helm_template(release="batchpilot", include_crds=False)
    else:
        operator_docs = kustomize(DEPLOY / "overlays" / "production")
    operator = one(operator_docs, "Deployment")
    assert operator["metadata"]["namespace"] == "batchpilot-system"
    operator_labels = operator["spec"]["template"]["metadata"]["labels"]
    policy = one(docs, "NetworkPolicy")
    assert labels_match(policy["spec"]["podSelector"]["matchLabels"], _pod(docs)["metadata"]["labels"])
    (admin,) = [r for r in policy["spec"]["ingress"] if {"port": "admin", "protocol": "TCP"} in r["ports"]]
    (peer,) = admin["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "batchpilot-system"}
    assert labels_match(peer["podSelector"]["matchLabels"], operator_labels)


def _selects(monitor: dict[str, Any], namespace: str, pod: dict[str, Any]) -> bool:
    names = monitor["spec"]["namespaceSelector"]
    in_namespace = names.get("any") is True or namespace in names.get("matchNames", [])
    return in_namespace and labels_match(monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])


def test_the_charts_switch_scrapes_runtimes_outside_it_and_its_own_once(docs: list[dict[str, Any]]) -> None:
    rendered = helm_template(QUICKSTART, sets=SWITCH, include_crds=False)
    monitors = find(rendered, "PodMonitor")
    assert len(monitors) == 2
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["http"]
    external = one(rendered, "PodMonitor", "bp-batchpilot-external-runtimes")
    assert _selects(external, "team-a", _pod(docs))
    assert "http" in {p["name"] for p in _pod(docs)["spec"]["containers"][0]["ports"]}
    # Each of the chart's runtime pods is scraped by exactly one monitor.
    for runtime in find(rendered, "Deployment"):
        if runtime["spec"]["template"]["spec"]["containers"][0]["args"][0] == "serve":
            pod = runtime["spec"]["template"]
            assert sum(_selects(m, runtime["metadata"]["namespace"], pod) for m in monitors) == 1
    # Named namespaces instead of all of them.
    named = helm_template(
        QUICKSTART, sets=[*SWITCH, "monitoring.podMonitor.externalRuntimes.namespaces={team-a,team-b}"]
    )
    assert one(named, "PodMonitor", "bp-batchpilot-external-runtimes")["spec"]["namespaceSelector"] == {
        "matchNames": ["team-a", "team-b"]
    }


def test_the_switch_needs_the_pod_monitor() -> None:
    with pytest.raises(AssertionError, match=r"externalRuntimes\.enabled needs monitoring\.podMonitor\.enabled"):
        helm_template(sets=["monitoring.podMonitor.externalRuntimes.enabled=true"])


def test_the_standalone_pod_monitor_is_the_charts_for_a_kustomize_install(docs: list[dict[str, Any]]) -> None:
    (standalone,) = load_documents(STANDALONE_MONITOR.read_text())
    assert standalone["metadata"]["labels"] == {"release": "kube-prometheus-stack"}
    assert _selects(standalone, "team-a", _pod(docs))
    chart = one(
        helm_template(QUICKSTART, sets=SWITCH, include_crds=False), "PodMonitor", "bp-batchpilot-external-runtimes"
    )
    assert standalone["spec"] == chart["spec"]
    assert yaml.safe_load(STANDALONE_MONITOR.read_text())["apiVersion"] == "monitoring.coreos.com/v1"
