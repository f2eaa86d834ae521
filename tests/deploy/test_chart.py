"""The Helm chart: lint, render with default values and with every option on, and validate what it renders.

Known kinds validate against the Kubernetes schemas of a current release (kubernetes-validate,
strict: unknown fields are errors); BatchProfiles validate against the generated CRD the way the
API server would (defaults, schema, CEL) and through the operator's own models; the kinds of other
projects' CRDs (Prometheus Operator, kopf) get structural checks of what the chart relies on.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from batchpilot_operator.api.crd import custom_resource_definition
from batchpilot_operator.api.profile import SLO, parse_manifest, parse_spec
from batchpilot_operator.cli import main as operator_cli
from batchpilot_runtime.cli import main as runtime_cli
from batchpilot_runtime.contract.window import WindowFields
from batchpilot_runtime.gate import cli as gate_cli
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
    pod_specs,
    run,
)

ALL_ON = CHART / "ci" / "all-on-values.yaml"
NAMESPACED = CHART / "ci" / "namespaced-values.yaml"
GATED = CHART / "ci" / "gate-values.yaml"
CASES = {"defaults": (), "all-on": (ALL_ON,), "namespaced": (NAMESPACED,), "gated": (GATED,)}
FOREIGN_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ClusterKopfPeering", "KopfPeering"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {case: helm_template(*files) for case, files in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_helm_lint_passes_strict(case: str) -> None:
    args: list[str | Path] = [helm_path(), "lint", "--strict", CHART]
    for values in CASES[case]:
        args += ["--values", values]
    run(args)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rendered_object_validates(rendered: dict[str, list[dict[str, Any]]], case: str) -> None:
    crd = custom_resource_definition()
    checked = 0
    for doc in rendered[case]:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "BatchProfile":
            _, errors = validate_object(crd, doc)
            assert errors == [], f"{where}: {errors}"
            parse_manifest(doc)
        elif doc["kind"] in FOREIGN_KINDS:
            assert doc["apiVersion"].split("/")[0] in ("monitoring.coreos.com", "kopf.dev"), where
            assert doc["metadata"]["name"], where
        else:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                raise AssertionError(f"{case}: {where}: {error.message} at {list(error.path)}") from None
        checked += 1
    assert checked == len(rendered[case]) > 0


def test_default_render_has_the_operator_and_nothing_optional(rendered: dict[str, list[dict[str, Any]]]) -> None:
    kinds = sorted({d["kind"] for d in rendered["defaults"]})
    assert kinds == sorted(
        {
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "Service",
            "Secret",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "Pod",
        }
    )
    assert find(rendered["defaults"], "CustomResourceDefinition", "batchprofiles.batchpilot.dev")


def test_chart_crd_is_the_generated_one() -> None:
    committed = yaml.safe_load((CHART / "crds" / "batchpilot.dev_batchprofiles.yaml").read_text())
    assert committed == custom_resource_definition(), "run `make crds`"


@pytest.mark.parametrize("case", list(CASES))
def test_pods_are_hardened(rendered: dict[str, list[dict[str, Any]]], case: str) -> None:
    specs = list(pod_specs(rendered[case]))
    assert specs
    for where, spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert container["resources"]["requests"] and container["resources"]["limits"]["memory"], where
            port_names = {p["name"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                # An httpGet probe names a declared port; an exec probe (a gated engine's) needs none.
                if probe in container and "exec" not in container[probe]:
                    assert container[probe]["httpGet"]["port"] in port_names, f"{where} {probe}"


def _operator(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment", "bp-batchpilot-operator")


def _args(deployment: dict[str, Any]) -> list[str]:
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


@pytest.mark.parametrize("case", list(CASES))
def test_probes_use_kopf_liveness_endpoint(rendered: dict[str, list[dict[str, Any]]], case: str) -> None:
    container = _operator(rendered[case])["spec"]["template"]["spec"]["containers"][0]
    liveness = [a for a in container["args"] if a.startswith("--liveness=")]
    assert len(liveness) == 1
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["health"]
    assert liveness[0] == f"--liveness=http://0.0.0.0:{port}/healthz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


@pytest.mark.parametrize("case", list(CASES))
def test_never_two_active_operators(rendered: dict[str, list[dict[str, Any]]], case: str) -> None:
    deployment = _operator(rendered[case])
    strategy = deployment["spec"]["strategy"]
    args = _args(deployment)
    peering = [a for a in args if a.startswith("--peering")]
    if deployment["spec"]["replicas"] > 1 or strategy["type"] == "RollingUpdate":
        # Overlap is only tolerable when kopf peering keeps one replica active.
        assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        assert peering[0] == "--peering=required" and peering[1].startswith("--peering-name=")
    else:
        assert strategy == {"type": "Recreate"}
        assert peering == ["--peering=off"]


@pytest.mark.parametrize("case", list(CASES))
def test_commands_parse_with_the_real_command_lines(rendered: dict[str, list[dict[str, Any]]], case: str) -> None:
    """The operator's, the runtimes' and the gates' arguments are accepted by their own parsers
    (an engine's are its own: tests/deploy/test_chart_gate.py)."""
    for deployment in find(rendered[case], "Deployment"):
        containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
        if "gate" in containers:
            config = gate_cli.config_from_args(gate_cli.build_parser().parse_args(containers["gate"]["args"]))
            assert config.admin_token_file is not None and config.host == "0.0.0.0"
            continue
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        if args[0] == "run":
            parsed = parse_operator_container(deployment["spec"]["template"]["spec"]["containers"][0])
            assert parsed.admin_token_file is not None and parsed.prometheus_url
        else:
            assert args[0] == "serve"
            parsed = runtime_cli.build_parser().parse_args(args)
            assert parsed.admin_token_file is not None and parsed.host == "0.0.0.0"


def test_more_replicas_without_peering_is_refused() -> None:
    with pytest.raises(AssertionError, match=r"needs operator.peering.enabled=true"):
        helm_template(sets=["operator.replicas=2"])


def test_peering_objects_exist_for_each_mode(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cluster = rendered["all-on"]
    assert one(cluster, "ClusterKopfPeering", "batchpilot-ha")["metadata"]["annotations"]["helm.sh/hook"]
    assert "--peering-name=batchpilot-ha" in _args(_operator(cluster))
    assert find(cluster, "CustomResourceDefinition", "clusterkopfpeerings.kopf.dev")
    namespaced = find(rendered["namespaced"], "KopfPeering", "batchpilot")
    assert sorted(p["metadata"]["namespace"] for p in namespaced) == ["team-a", "team-b"]
    assert "--namespace=team-a" in _args(_operator(rendered["namespaced"]))
    assert "--all-namespaces" not in _args(_operator(rendered["namespaced"]))


def test_admin_token_secret_is_generated_once_and_kept(rendered: dict[str, list[dict[str, Any]]]) -> None:
    secret = one(rendered["defaults"], "Secret", "bp-batchpilot-admin-token")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(secret["data"]["token"]) >= 64
    # An upgrade must reuse the token in the cluster (lookup) instead of drawing a new one.
    template = (CHART / "templates" / "admin-token-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template
    # Both the operator and every runtime mount the same Secret.
    mounted = {
        where: [v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v]
        for where, spec in pod_specs(rendered["all-on"])
        if not where.startswith("Pod/")
    }
    assert mounted and all(names == ["bp-batchpilot-admin-token"] for names in mounted.values()), mounted
    namespaced = rendered["namespaced"]
    assert not find(namespaced, "Secret")
    assert "--admin-token-file=/var/run/batchpilot/admin-token/bearer" in _args(_operator(namespaced))


def test_models_get_deployment_service_and_profile(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["all-on"]
    chat = one(docs, "Deployment", "bp-batchpilot-chat")
    container = chat["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].endswith("-cuda")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert "--checkpoint=/models/chat" in container["args"]
    assert "--model-name=llama-chat-8b" in container["args"]
    assert chat["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    summarize = one(docs, "Deployment", "bp-batchpilot-summarize")
    cpu_container = summarize["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(cpu_container["resources"])
    assert not cpu_container["image"].endswith("-cuda")
    assert "--preset=small" in cpu_container["args"] and "--batching=static" in cpu_container["args"]

    for deployment, model_name in ((chat, "llama-chat-8b"), (summarize, "summarize")):
        name = deployment["metadata"]["name"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        service = one(docs, "Service", name)
        assert labels_match(service["spec"]["selector"], pod_labels)
        profile = one(docs, "BatchProfile", name)
        assert profile["spec"]["model"] == model_name
        assert labels_match(profile["spec"]["selector"]["matchLabels"], pod_labels)
        # The profile's window is the one the runtime starts with.
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        window = profile["spec"]["window"]
        assert f"--target-batch-size={window['targetBatchSize']}" in args
        assert f"--hard-cap={window['hardCap']}" in args
        assert f"--max-wait-ms={window['maxWaitMs']}" in args
        ports = {
            p["name"]: p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
        }
        assert profile["spec"]["runtime"] == {"adminPort": ports["admin"], "servePort": ports["http"]}
    assert one(docs, "BatchProfile", "bp-batchpilot-chat")["spec"]["lanes"][0]["name"] == "critical"
    # The runtime starts with the profile's lanes too.
    assert "--lane=critical:target=4,cap=8,wait=5,tail=2,reserved=4" in container["args"]
    assert "--kv-cache-tokens=262144" in container["args"]
    assert not [a for a in cpu_container["args"] if a.startswith("--kv-cache-tokens")]


def test_runtimes_get_the_engine_stall_timeout(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The runtime default, or the model's own (a CPU model with long whole-prompt prefills)."""
    docs = rendered["all-on"]
    for name, flag in (("chat", "--engine-stall-timeout-s=120"), ("summarize", "--engine-stall-timeout-s=300")):
        args = one(docs, "Deployment", f"bp-batchpilot-{name}")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert flag in args, args
        assert runtime_cli.build_parser().parse_args(args).engine_stall_timeout_s == float(flag.split("=")[1])
    with pytest.raises(AssertionError, match="engineStallTimeoutSeconds"):
        helm_template(ALL_ON, sets=["models[0].engineStallTimeoutSeconds=0"])


def test_a_profile_the_crd_refuses_is_caught() -> None:
    docs = helm_template(ALL_ON, sets=["models[0].profile.window.targetBatchSize=40"])  # above hardCap 32
    _, errors = validate_object(custom_resource_definition(), one(docs, "BatchProfile", "bp-batchpilot-chat"))
    assert any("targetBatchSize must be less than or equal to hardCap" in e for e in errors), errors


@pytest.mark.parametrize("case", ["defaults", "all-on"])
def test_network_policy_admits_only_the_operator_to_admin_ports(
    rendered: dict[str, list[dict[str, Any]]], case: str
) -> None:
    """On by default: the admin port only from the operator's pods (of the release namespace: a podSelector
    without a namespaceSelector), the serving port from servingFrom, or from everyone when that is empty."""
    docs = rendered[case]
    operator_labels = _operator(docs)["spec"]["template"]["metadata"]["labels"]
    policy = one(docs, "NetworkPolicy", "bp-batchpilot-runtime")
    assert policy["metadata"]["namespace"] == "batchpilot-system" and policy["spec"]["policyTypes"] == ["Ingress"]
    runtimes = [d for d in find(docs, "Deployment") if d["metadata"]["name"] != "bp-batchpilot-operator"]
    assert runtimes or case == "defaults"
    for runtime in runtimes:
        assert labels_match(
            policy["spec"]["podSelector"]["matchLabels"], runtime["spec"]["template"]["metadata"]["labels"]
        )
    admin_rules = [r for r in policy["spec"]["ingress"] if {"port": "admin", "protocol": "TCP"} in r["ports"]]
    assert len(admin_rules) == 1 and admin_rules[0]["ports"] == [{"port": "admin", "protocol": "TCP"}]
    (peer,) = admin_rules[0]["from"]
    assert set(peer) == {"podSelector"} and labels_match(peer["podSelector"]["matchLabels"], operator_labels)
    (serving,) = [r for r in policy["spec"]["ingress"] if r is not admin_rules[0]]
    assert serving["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert ("from" in serving) == (case == "all-on")  # defaults: the serving port stays open to every client
    operator_policy = one(docs, "NetworkPolicy", "bp-batchpilot-operator")
    assert [p["port"] for r in operator_policy["spec"]["ingress"] for p in r["ports"]] == ["metrics", "health"]
    assert not find(helm_template(sets=["networkPolicy.enabled=false"], include_crds=False), "NetworkPolicy")


def test_the_admin_token_goes_only_to_the_release_namespace_and_the_named_ones(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for case, docs in rendered.items():
        operator = _operator(docs)
        args = _args(operator)
        assert [a for a in args if a.startswith("--admin-token-namespace")] == [
            "--admin-token-namespace=$(POD_NAMESPACE)"
        ]
        # The kubelet expands $(POD_NAMESPACE) from the container's env: the pod's own namespace.
        env = {e["name"]: e for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}, case
    extra = helm_template(sets=["adminToken.extraNamespaces={team-a,team-b}"], include_crds=False)
    args = _args(_operator(extra))
    assert operator_cli.build_parser().parse_args(args).admin_token_namespace == [
        "$(POD_NAMESPACE)",
        "team-a",
        "team-b",
    ]
    with pytest.raises(AssertionError, match="extraNamespaces"):
        helm_template(sets=["adminToken.extraNamespaces={Not_A_Namespace}"], include_crds=False)


def test_pdb_and_services_select_their_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for case, docs in rendered.items():
        labels = _operator(docs)["spec"]["template"]["metadata"]["labels"]
        pdb = one(docs, "PodDisruptionBudget")
        assert labels_match(pdb["spec"]["selector"]["matchLabels"], labels), case
        assert pdb["spec"]["maxUnavailable"] == 1, case
        assert labels_match(one(docs, "Service", "bp-batchpilot-operator")["spec"]["selector"], labels), case


def test_prometheus_operator_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["all-on"]
    service = one(docs, "Service", "bp-batchpilot-operator")
    monitor = one(docs, "ServiceMonitor")
    assert labels_match(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["honorLabels"] is True
    pod_monitor = one(docs, "PodMonitor")
    for runtime in find(docs, "Deployment"):
        pod = runtime["spec"]["template"]
        selected = labels_match(pod_monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
        assert selected == (runtime["metadata"]["name"] != "bp-batchpilot-operator")
        if selected:
            assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] in {
                p["name"] for p in pod["spec"]["containers"][0]["ports"]
            }
            assert "prometheus.io/scrape" not in pod["metadata"].get("annotations", {})
    rule = one(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((DEPLOY / "prometheus" / "batchpilot.rules.yaml").read_text())
    dashboard = one(docs, "ConfigMap", "bp-batchpilot-dashboard")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["batchpilot-dashboard.json"]) == json.loads(
        (DEPLOY / "grafana" / "batchpilot-dashboard.json").read_text()
    )


def test_scrape_annotations_when_no_prometheus_operator(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["namespaced"]
    for deployment in find(docs, "Deployment"):
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        port = annotations["prometheus.io/port"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(port) in {p["containerPort"] for p in container["ports"]}


def test_chart_copies_of_rules_and_dashboard_match_deploy() -> None:
    assert (CHART / "files" / "batchpilot.rules.yaml").read_text() == (
        DEPLOY / "prometheus" / "batchpilot.rules.yaml"
    ).read_text()
    assert (CHART / "files" / "batchpilot-dashboard.json").read_text() == (
        DEPLOY / "grafana" / "batchpilot-dashboard.json"
    ).read_text()


def test_helm_test_hook_checks_operator_and_runtimes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["all-on"]
    pod = one(docs, "Pod", "bp-batchpilot-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    urls = pod["spec"]["containers"][0]["args"][1:]
    services = {s["metadata"]["name"]: s for s in find(docs, "Service")}
    assert len(urls) == 1 + len(find(docs, "BatchProfile"))
    for url in urls:
        host_port, path = url.removeprefix("http://").split("/", 1)
        host, port = host_port.split(":")
        assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
        assert path in ("healthz", "readyz")
    assert not find(rendered["namespaced"], "Pod")


def test_values_schema_refuses_bad_values() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    for extra in (ALL_ON, NAMESPACED):
        jsonschema.validate(_merged(values, yaml.safe_load(extra.read_text())), schema)
    bad = copy.deepcopy(values)
    bad["models"] = [{"name": "Not_A_DNS_Label"}]
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        jsonschema.validate(bad, schema)
    bad = copy.deepcopy(values)
    bad["operator"]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        jsonschema.validate(bad, schema)
    # Helm applies the same schema.
    with pytest.raises(AssertionError, match="models"):
        helm_template(sets=["models[0].name=Chat"])


def test_values_schema_knows_every_window_and_slo_field_of_the_resource(tmp_path: Path) -> None:
    # The chart's schema lists these fields by hand (additionalProperties: false): one missing
    # would refuse a valid profile at `helm install`.
    schema = json.loads((CHART / "values.schema.json").read_text())
    for profile in (
        schema["properties"]["profileDefaults"],
        schema["properties"]["models"]["items"]["properties"]["profile"],
    ):
        for name, model in (("window", WindowFields), ("slo", SLO)):
            assert set(profile["properties"][name]["properties"]) == {
                field.alias or key for key, field in model.model_fields.items()
            }, name
    # A model may state an inter-token target alone once the defaults' first-token one is dropped.
    values = tmp_path / "gaps-only.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "profileDefaults": {"slo": {"p99Ms": None}},
                "models": [
                    {
                        "name": "chat",
                        "preset": "tiny",
                        "profile": {
                            "window": {"targetBatchSize": 1, "hardCap": 64, "maxWaitMs": 0, "maxPrefillTokens": 1024},
                            "slo": {"interTokenP99Ms": 60},
                        },
                    }
                ],
            }
        )
    )
    (profile_doc,) = find(helm_template(values), "BatchProfile")
    spec = parse_spec(profile_doc["spec"])
    assert (spec.slo.p99_ms, spec.slo.inter_token_p99_ms, spec.window.max_prefill_tokens) == (None, 60, 1024)


def _merged(base: Any, override: Any) -> Any:
    """Helm's merge of a values file over the defaults: maps merge, everything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{key: _merged(base.get(key), value) for key, value in override.items()}}
    return override


def test_notes_tell_what_to_do_next() -> None:
    # --dry-run=client renders NOTES.txt without a cluster.
    result = run([helm_path(), "install", "bp", CHART, "--dry-run=client", "--namespace", "ml", "--values", ALL_ON])
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "kubectl -n ml get batchprofiles" in notes
    assert "helm test bp -n ml" in notes
    assert "svc/bp-batchpilot-chat" in notes
