"""The kustomize base and overlays, the Argo CD Application and the Flux HelmRelease.

Overlays build with `kubectl kustomize` and validate like the chart; the base stays in step with
the chart's default rendering; the GitOps objects point at paths that exist and at values the
chart accepts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from batchpilot_operator.api.crd import render_crd

from .tools import (
    CHART,
    DEPLOY,
    KUBERNETES_VERSION,
    REPO,
    find,
    helm_template,
    kubectl_path,
    kustomize,
    load_documents,
    one,
    parse_operator_container,
    run,
)

OVERLAYS = ("dev", "production")


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict[str, Any]]]:
    return {overlay: kustomize(DEPLOY / "overlays" / overlay) for overlay in OVERLAYS}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_and_validates(built: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = built[overlay]
    namespace = f"batchpilot-{'dev' if overlay == 'dev' else 'system'}"
    one(docs, "Namespace", namespace)
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "ClusterKopfPeering":
            # Cluster-scoped: kustomize must not have given it a namespace.
            assert doc["apiVersion"] == "kopf.dev/v1" and "namespace" not in doc["metadata"], where
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise AssertionError(f"{overlay}: {where}: {error.message} at {list(error.path)}") from None
        if doc["kind"] in ("Deployment", "Service", "ServiceAccount", "PodDisruptionBudget", "Secret", "NetworkPolicy"):
            assert doc["metadata"]["namespace"] == namespace, where


def test_base_crd_is_the_generated_one() -> None:
    # Refresh with: batchpilot-operator crd -o deploy/base/crds/batchpilot.dev_batchprofiles.yaml
    assert (DEPLOY / "base" / "crds" / "batchpilot.dev_batchprofiles.yaml").read_text() == render_crd()


def _operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(d for d in find(docs, "Deployment") if d["metadata"]["name"].endswith("-operator"))
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_base_operator_matches_the_chart_defaults(built: dict[str, list[dict[str, Any]]]) -> None:
    chart = _operator_container(helm_template(include_crds=False))
    base = _operator_container(kustomize(DEPLOY / "base"))
    for key in (
        "args",
        "env",
        "ports",
        "startupProbe",
        "livenessProbe",
        "readinessProbe",
        "resources",
        "securityContext",
        "volumeMounts",
    ):
        assert base[key] == chart[key], key
    chart_pod = one(helm_template(include_crds=False), "Deployment", "bp-batchpilot-operator")["spec"]
    base_pod = one(kustomize(DEPLOY / "base"), "Deployment", "batchpilot-operator")["spec"]
    assert base_pod["strategy"] == chart_pod["strategy"] == {"type": "Recreate"}
    assert base_pod["template"]["spec"]["securityContext"] == chart_pod["template"]["spec"]["securityContext"]


def test_production_runs_two_peered_operators_without_overlap(built: dict[str, list[dict[str, Any]]]) -> None:
    docs = built["production"]
    deployment = one(docs, "Deployment", "batchpilot-operator")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    args = _operator_container(docs)["args"]
    assert "--peering=required" in args and "--peering-name=batchpilot" in args and "--peering=off" not in args
    one(docs, "ClusterKopfPeering", "batchpilot")
    one(docs, "CustomResourceDefinition", "clusterkopfpeerings.kopf.dev")
    # The Secret comes from the cluster's secret manager, not from the repository.
    assert not find(docs, "Secret")


def test_production_fails_to_build_if_the_base_arguments_move(tmp_path: Path) -> None:
    """The production overlay replaces kopf's peering flag by its index among the arguments; if the
    base's arguments move, its test op fails the build instead of replacing another flag."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    deployment = copy / "base" / "deployment.yaml"
    text = deployment.read_text()
    assert "            - --all-namespaces\n            - --peering=off\n" in text
    deployment.write_text(
        text.replace(
            "- --all-namespaces\n            - --peering=off", "- --peering=off\n            - --all-namespaces"
        )
    )
    result = run([kubectl_path(), "kustomize", copy / "overlays" / "production"], check=False)
    assert result.returncode != 0 and "test" in result.stderr.lower(), result.stderr


def test_dev_overlay_brings_its_own_token(built: dict[str, list[dict[str, Any]]]) -> None:
    docs = built["dev"]
    secret = one(docs, "Secret", "batchpilot-admin-token")
    volumes = one(docs, "Deployment", "batchpilot-operator")["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "admin-token",
        "secret": {"secretName": secret["metadata"]["name"], "defaultMode": 0o440},
    } in volumes
    assert parse_operator_container(_operator_container(docs)).verbose is True  # BATCHPILOT_VERBOSE


def test_argocd_applications_point_at_existing_sources() -> None:
    apps = load_documents((DEPLOY / "argocd" / "batchpilot.yaml").read_text())
    assert apps
    for app in apps:
        assert (app["apiVersion"], app["kind"]) == ("argoproj.io/v1alpha1", "Application")
        spec = app["spec"]
        assert spec["destination"]["server"] == "https://kubernetes.default.svc"
        assert spec["project"] and spec["source"]["repoURL"].endswith(".git") and spec["source"]["targetRevision"]
        source = REPO / spec["source"]["path"]
        assert source.is_dir(), spec["source"]["path"]
        assert spec["syncPolicy"]["automated"] == {"prune": True, "selfHeal": True}
    operator_app = next(a for a in apps if a["metadata"]["name"] == "batchpilot")
    path = REPO / operator_app["spec"]["source"]["path"]
    assert (path / "kustomization.yaml").is_file()
    assert operator_app["spec"]["destination"]["namespace"] == "batchpilot-system"
    kustomize(path)


def test_flux_helmrelease_installs_the_chart_with_valid_values(tmp_path: Path) -> None:
    docs = load_documents((DEPLOY / "flux" / "batchpilot.yaml").read_text())
    source = one(docs, "GitRepository", "batchpilot")
    assert source["apiVersion"] == "source.toolkit.fluxcd.io/v1"
    release = one(docs, "HelmRelease", "batchpilot")
    assert release["apiVersion"] == "helm.toolkit.fluxcd.io/v2"
    chart = release["spec"]["chart"]["spec"]
    assert chart["sourceRef"] == {"kind": "GitRepository", "name": "batchpilot", "namespace": "flux-system"}
    assert (REPO / chart["chart"]).resolve() == CHART
    values = release["spec"]["values"]
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(_merge(defaults, values), schema)
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    rendered = helm_template(values_file, namespace=release["spec"]["targetNamespace"])
    one(rendered, "PrometheusRule")
    assert one(rendered, "Deployment", "bp-batchpilot-operator")["spec"]["replicas"] == 2


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in override.items()}}
    return override


def test_gitops_examples_track_the_release_tag_not_a_branch() -> None:
    """A synced install follows what its revision points at: a branch would upgrade it on every merge."""
    chart = yaml.safe_load((REPO / "charts" / "batchpilot" / "Chart.yaml").read_text())
    tag = f"v{chart['appVersion']}"
    apps = load_documents((DEPLOY / "argocd" / "batchpilot.yaml").read_text())
    assert [app["spec"]["source"]["targetRevision"] for app in apps] == [tag] * len(apps)
    flux = one(load_documents((DEPLOY / "flux" / "batchpilot.yaml").read_text()), "GitRepository", "batchpilot")
    assert flux["spec"]["ref"] == {"tag": tag}
    base = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    assert {image["newTag"] for image in base["images"]} == {chart["appVersion"]}


def test_overlays_set_the_prometheus_url_by_name_not_by_argument_position(
    built: dict[str, list[dict[str, Any]]],
) -> None:
    """The dev overlay's patch names BATCHPILOT_PROMETHEUS_URL (strategic merge by env name): the base
    may add or reorder arguments without the patch replacing the wrong one."""
    base = parse_operator_container(_operator_container(kustomize(DEPLOY / "base")))
    assert base.prometheus_url == "http://prometheus-operated.monitoring.svc:9090"
    dev = _operator_container(built["dev"])
    parsed = parse_operator_container(dev)
    assert parsed.prometheus_url == "http://prometheus-server.monitoring.svc:80" and parsed.verbose is True
    assert not [a for a in dev["args"] if a.startswith("--prometheus-url")]
    assert [e["name"] for e in dev["env"]].count("BATCHPILOT_PROMETHEUS_URL") == 1
    assert dev["imagePullPolicy"] == "Never"
    # The chart sets the same variable from operator.prometheusUrl.
    chart = _operator_container(helm_template(sets=["operator.prometheusUrl=http://prom.example:9090"]))
    assert parse_operator_container(chart).prometheus_url == "http://prom.example:9090"
