"""The README's cluster quickstart: the chart with one model under ``models:`` is wired to retune it.

A first retune needs four things to agree in what the chart renders: the BatchProfile selects the
runtime's pods (and nothing else), the ports the profile names are the ones the runtime listens on
(and the ones the Service, the PodMonitor and the NetworkPolicy name), the admin token the pods
mount is a Secret of their own namespace that the operator sends to that namespace, and every
object is one the API server accepts. Each check runs on the quickstart's values and on the chart's
every-option-on values (two models, GPUs, lanes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from batchpilot_operator.api.crd import custom_resource_definition
from batchpilot_operator.api.profile import parse_manifest
from batchpilot_operator.cli import main as operator_cli
from batchpilot_runtime.cli import main as runtime_cli
from tests.support.crd_validation import validate_object

from .tools import (
    CHART,
    DEPLOY,
    KUBERNETES_VERSION,
    find,
    helm_path,
    helm_template,
    labels_match,
    one,
    parse_operator_container,
    run,
)

QUICKSTART = DEPLOY / "helm" / "quickstart-values.yaml"
CASES = {"quickstart": QUICKSTART, "all-on": CHART / "ci" / "all-on-values.yaml"}
NAMESPACE = "batchpilot-system"


@pytest.fixture(scope="module", params=list(CASES))
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    values: Path = CASES[request.param]
    return helm_template(values, namespace=NAMESPACE)


def _runtimes(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in find(docs, "Deployment") if _container(d)["args"][0] == "serve"]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} in {args}"
    return values[0]


def test_the_quickstart_runs_one_model_on_the_images_built_here() -> None:
    docs = helm_template(QUICKSTART, namespace=NAMESPACE)
    (runtime,) = _runtimes(docs)
    assert len(find(docs, "BatchProfile")) == 1
    assert _container(runtime)["image"] == "batchpilot-runtime:dev"
    operator = one(docs, "Deployment", "bp-batchpilot-operator")
    assert _container(operator)["image"] == "batchpilot-operator:dev"
    # CPU, random weights: nothing to download, no GPU to find.
    assert "--preset=tiny" in _container(runtime)["args"]
    assert "nvidia.com/gpu" not in str(_container(runtime)["resources"])


def test_every_profile_selects_exactly_its_runtime_pods(docs: list[dict[str, Any]]) -> None:
    profiles = find(docs, "BatchProfile")
    runtimes = _runtimes(docs)
    assert profiles and len(profiles) == len(runtimes)
    for profile in profiles:
        selector = profile["spec"]["selector"]
        assert set(selector) == {"matchLabels"}, "matchExpressions would need their own check"
        selected = [
            d
            for d in find(docs, "Deployment")
            if d["metadata"]["namespace"] == profile["metadata"]["namespace"]
            and labels_match(selector["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
        ]
        assert [d["metadata"]["name"] for d in selected] == [profile["metadata"]["name"]]
        (runtime,) = selected
        # The operator finds the pods' series by the model label the runtime exports.
        assert _flag(_container(runtime)["args"], "--model-name") == profile["spec"]["model"]
        # The Deployment's own selector keeps its pods distinct from every other runtime's.
        own = runtime["spec"]["selector"]["matchLabels"]
        others = [r for r in runtimes if r is not runtime]
        assert not any(labels_match(own, r["spec"]["template"]["metadata"]["labels"]) for r in others)


def test_ports_agree_between_profile_runtime_service_and_monitors(docs: list[dict[str, Any]]) -> None:
    monitors = find(docs, "PodMonitor")
    policy = one(docs, "NetworkPolicy", "bp-batchpilot-runtime")
    for profile in find(docs, "BatchProfile"):
        runtime = one(docs, "Deployment", profile["metadata"]["name"])
        container = _container(runtime)
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        parsed = runtime_cli.build_parser().parse_args(container["args"])
        ports = profile["spec"]["runtime"]
        assert ports["servePort"] == named["http"] == parsed.port
        assert ports["adminPort"] == named["admin"] == parsed.admin_port
        service = one(docs, "Service", profile["metadata"]["name"])
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(ports["servePort"], "http")]
        for monitor in monitors:
            if labels_match(
                monitor["spec"]["selector"]["matchLabels"], runtime["spec"]["template"]["metadata"]["labels"]
            ):
                assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["http"]
        admin_rules = [r for r in policy["spec"]["ingress"] if {"port": "admin", "protocol": "TCP"} in r["ports"]]
        assert len(admin_rules) == 1 and "admin" in named


def test_the_admin_token_is_a_secret_of_the_pods_namespace_that_the_operator_sends_there(
    docs: list[dict[str, Any]],
) -> None:
    operator = one(docs, "Deployment", "bp-batchpilot-operator")
    operator_args = operator_cli.build_parser().parse_args(_container(operator)["args"])
    # $(POD_NAMESPACE) is the operator's own namespace (the kubelet expands it from the downward API).
    token_namespaces = {
        operator["metadata"]["namespace"] if n == "$(POD_NAMESPACE)" else n for n in operator_args.admin_token_namespace
    }
    operator_token = _token_source(operator, str(operator_args.admin_token_file))
    for runtime in _runtimes(docs):
        namespace = runtime["metadata"]["namespace"]
        secret_name, key = _token_source(runtime, _flag(_container(runtime)["args"], "--admin-token-file"))
        # A pod can mount only a Secret of its own namespace: the chart must render it there.
        secret = one(docs, "Secret", secret_name)
        assert secret["metadata"]["namespace"] == namespace
        assert key in secret["data"]
        assert (secret_name, key) == operator_token, "the runtime and the operator read different tokens"
        assert namespace in token_namespaces, f"the operator does not send its token to {namespace}"
        # The profile names no Secret of its own: the operator's token is the one these pods accept.
        assert "adminTokenSecret" not in one(docs, "BatchProfile", runtime["metadata"]["name"])["spec"]["runtime"]


def _token_source(deployment: dict[str, Any], token_file: str) -> tuple[str, str]:
    """(Secret name, key) behind a token file path, from the pod's mounts and volumes."""
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in _container(deployment)["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if token_file.startswith(prefix):
            secret = volumes[mount["name"]]["secret"]
            items = {i["path"]: i["key"] for i in secret.get("items", [])}
            relative = token_file.removeprefix(prefix)
            return secret["secretName"], items.get(relative, relative)
    raise AssertionError(f"{deployment['metadata']['name']}: nothing mounted at {token_file}")


def test_every_rendered_object_validates_against_the_kubernetes_schemas(docs: list[dict[str, Any]]) -> None:
    crd = custom_resource_definition()
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "BatchProfile":
            _, errors = validate_object(crd, doc)
            assert errors == [], f"{where}: {errors}"
            parse_manifest(doc)
        elif doc["apiVersion"].startswith(("monitoring.coreos.com/", "kopf.dev/")):
            continue  # other projects' CRDs: tests/deploy/test_monitoring.py checks the monitors
        else:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                raise AssertionError(f"{where}: {error.message} at {list(error.path)}") from None


def test_kube_prometheus_stack_selects_the_quickstart_monitors() -> None:
    docs = helm_template(QUICKSTART, namespace=NAMESPACE)
    for kind in ("PodMonitor", "ServiceMonitor"):
        assert one(docs, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
    # The operator reads the Prometheus that kube-prometheus-stack runs in `monitoring`.
    operator = one(docs, "Deployment", "bp-batchpilot-operator")
    assert (
        parse_operator_container(_container(operator)).prometheus_url
        == "http://prometheus-operated.monitoring.svc:9090"
    )


def test_the_readme_quickstart_names_what_the_chart_renders() -> None:
    """The README sends traffic to a Service and describes a profile by name: the release it installs
    (`batchpilot`) must render exactly those names, in the namespace the README uses."""
    readme = (DEPLOY.parent / "README.md").read_text()
    assert f"-f {QUICKSTART.relative_to(DEPLOY.parent)}" in readme
    docs = helm_template(QUICKSTART, namespace=NAMESPACE, release="batchpilot")
    (profile,) = find(docs, "BatchProfile")
    service = one(docs, "Service", profile["metadata"]["name"])
    port = service["spec"]["ports"][0]["port"]
    assert f"--endpoint http://{service['metadata']['name']}:{port}" in readme
    assert f"kubectl -n {NAMESPACE} describe bp {profile['metadata']['name']}" in readme
    assert f"helm install batchpilot charts/batchpilot -n {NAMESPACE}" in readme


def test_notes_say_where_the_token_can_be_mounted() -> None:
    # --dry-run=client renders NOTES.txt without a cluster.
    args = [helm_path(), "install", "bp", CHART, "--dry-run=client", "--namespace", "ml"]
    notes = run([*args, "--set", "adminToken.extraNamespaces={team-a}"]).stdout.split("NOTES:", 1)[1]
    assert "Pods in ml read the admin token" in notes
    assert "only to\n   ml and team-a" in notes and "spec.runtime.adminTokenSecret" in notes
    unlabelled = run([*args, "--set", "monitoring.podMonitor.enabled=true"]).stdout.split("NOTES:", 1)[1]
    assert "release: <its release name>" in unlabelled
    labelled = run([*args, "--values", QUICKSTART]).stdout.split("NOTES:", 1)[1]
    assert "release: <its release name>" not in labelled
