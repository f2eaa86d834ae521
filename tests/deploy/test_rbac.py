"""RBAC: the chart and the kustomize layouts grant exactly what batchpilot_operator.api.rbac declares.

Every (apiGroup, resource, verb) the operator's code uses must be allowed, and nothing else may be:
both directions are checked, per mode (cluster-wide or namespaced) and with or without peering.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from batchpilot_operator import GROUP
from batchpilot_operator.api import rbac

from .tools import DEPLOY, REPO, find, helm_template, kustomize, one

Triple = tuple[str, str, str]


def _granted(role: dict[str, Any]) -> frozenset[Triple]:
    return rbac.expand_rules(role["rules"])


def _bound_to_operator(
    docs: list[dict[str, Any]], role_kind: str, role: dict[str, Any], sa_name: str, sa_namespace: str
) -> bool:
    binding_kind = "ClusterRoleBinding" if role_kind == "ClusterRole" else "RoleBinding"
    for binding in find(docs, binding_kind):
        if binding["metadata"].get("namespace") != role["metadata"].get("namespace"):
            continue
        if binding["roleRef"] != {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": role_kind,
            "name": role["metadata"]["name"],
        }:
            continue
        subjects = binding["subjects"]
        assert subjects == [{"kind": "ServiceAccount", "name": sa_name, "namespace": sa_namespace}], subjects
        return True
    return False


def _operator_grants(docs: list[dict[str, Any]]) -> tuple[frozenset[Triple], dict[str, frozenset[Triple]]]:
    """(cluster-wide grants, namespace -> namespaced grants) of the operator's ServiceAccount."""
    operator = next(d for d in find(docs, "Deployment") if d["metadata"]["name"].endswith("-operator"))
    sa_name = operator["spec"]["template"]["spec"]["serviceAccountName"]
    sa_namespace = operator["metadata"]["namespace"]
    one(docs, "ServiceAccount", sa_name)
    cluster: set[Triple] = set()
    for role in find(docs, "ClusterRole"):
        assert _bound_to_operator(docs, "ClusterRole", role, sa_name, sa_namespace), role["metadata"]["name"]
        cluster |= _granted(role)
    namespaced: dict[str, frozenset[Triple]] = {}
    for role in find(docs, "Role"):
        assert _bound_to_operator(docs, "Role", role, sa_name, sa_namespace), role["metadata"]
        namespaced[role["metadata"]["namespace"]] = _granted(role)
    return frozenset(cluster), namespaced


def _expected(mode: rbac.Mode, peering: bool) -> tuple[frozenset[Triple], frozenset[Triple]]:
    """(cluster-wide, per watched namespace) triples the declared list asks for."""
    needed = rbac.required_permissions(mode=mode, peering=peering)
    if mode == "clusterwide":
        return rbac.permission_triples(needed), frozenset()
    return (
        rbac.permission_triples(p for p in needed if p.scope == "cluster"),
        rbac.permission_triples(p for p in needed if p.scope == "namespace"),
    )


CHART_CASES = {
    "clusterwide": ("clusterwide", False, []),
    "clusterwide+peering": ("clusterwide", True, ["operator.replicas=2", "operator.peering.enabled=true"]),
    "namespaced": ("namespaced", False, ["operator.watchNamespaces={team-a,team-b}"]),
    "namespaced+peering": (
        "namespaced",
        True,
        ["operator.watchNamespaces={team-a,team-b}", "operator.peering.enabled=true"],
    ),
}


@pytest.mark.parametrize("case", list(CHART_CASES))
def test_chart_grants_exactly_the_declared_permissions(case: str) -> None:
    mode, peering, sets = CHART_CASES[case]
    docs = helm_template(sets=sets, include_crds=False)
    cluster, namespaced = _operator_grants(docs)
    want_cluster, want_namespaced = _expected(mode, peering)  # type: ignore[arg-type]
    assert cluster == want_cluster, (
        f"missing: {sorted(want_cluster - cluster)}; not declared: {sorted(cluster - want_cluster)}"
    )
    if mode == "clusterwide":
        assert namespaced == {}
    else:
        assert set(namespaced) == {"team-a", "team-b"}
        for namespace, granted in namespaced.items():
            assert granted == want_namespaced, (
                f"{namespace}: missing {sorted(want_namespaced - granted)}; "
                f"not declared: {sorted(granted - want_namespaced)}"
            )


def test_chart_rules_read_like_the_declared_rules() -> None:
    """Same rules, one per resource, so that a reviewer can compare them line by line."""
    docs = helm_template(include_crds=False)
    role = one(docs, "ClusterRole")
    normalised = sorted(
        (
            {"apiGroups": r["apiGroups"], "resources": r["resources"], "verbs": sorted(r["verbs"])}
            for r in role["rules"]
        ),
        key=lambda r: (r["apiGroups"], r["resources"]),
    )
    assert normalised == rbac.cluster_role_rules(mode="clusterwide", peering=False)


@pytest.mark.parametrize(("overlay", "peering"), [("dev", False), ("production", True)])
def test_kustomize_overlays_grant_exactly_the_declared_permissions(overlay: str, peering: bool) -> None:
    docs = kustomize(DEPLOY / "overlays" / overlay)
    cluster, namespaced = _operator_grants(docs)
    want_cluster, _ = _expected("clusterwide", peering)
    assert namespaced == {}
    assert cluster == want_cluster, (
        f"missing: {sorted(want_cluster - cluster)}; not declared: {sorted(cluster - want_cluster)}"
    )


def test_no_role_grants_wildcards_or_secrets_beyond_get() -> None:
    docs = helm_template(sets=["operator.watchNamespaces={a}", "operator.peering.enabled=true"], include_crds=False)
    for role in find(docs, "ClusterRole") + find(docs, "Role"):
        for group, resource, verb in _granted(role):
            assert "*" not in (group, resource, verb)
            if resource == "secrets":
                assert verb == "get"


def test_secret_reads_are_as_narrow_as_the_install_mode_allows() -> None:
    """Namespaced: Secrets only in the watched namespaces, none cluster-wide. Cluster-wide: get, never list or
    watch (the operator reads only a Secret a profile names, and cannot enumerate them)."""
    secrets_get = ("", "secrets", "get")
    docs = helm_template(sets=["operator.watchNamespaces={team-a,team-b}"], include_crds=False)
    cluster, namespaced = _operator_grants(docs)
    assert not [t for t in cluster if t[1] == "secrets"]
    assert {ns for ns, granted in namespaced.items() if secrets_get in granted} == {"team-a", "team-b"}
    for docs in (helm_template(include_crds=False), kustomize(DEPLOY / "overlays" / "production")):
        cluster, namespaced = _operator_grants(docs)
        assert [t for t in cluster if t[1] == "secrets"] == [secrets_get] and namespaced == {}


def test_declared_list_is_consistent() -> None:
    for permission in rbac.PERMISSIONS:
        assert permission.verbs == tuple(dict.fromkeys(permission.verbs)), permission
        assert permission.why
    with pytest.raises(ValueError, match="mode must be one of"):
        rbac.required_permissions(mode="everywhere", peering=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rules\[0\]\.verbs"):
        rbac.expand_rules([{"apiGroups": [""], "resources": ["pods"]}])
    with pytest.raises(ValueError, match=r"rules\[0\]\.resourceNames"):
        rbac.expand_rules([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"], "resourceNames": ["x"]}])


_API_PATH = re.compile(
    r"/apis?/(?:(?P<group>[a-z0-9.-]+|\{GROUP\})/)?v[0-9a-z]+(?:/namespaces/\{[^}]+\})?/(?P<resource>[a-z]+)"
)


# The kubernetes client's calls: CoreV1Api's ``<verb>_namespaced_<kind>`` (resource = kind + "s"),
# and CustomObjectsApi's ``<verb>_..._custom_object`` on this project's group and plural.
_CORE_CALL = re.compile(r"\b_core\.(?:read|create|patch|replace|delete|list)_namespaced_(?P<kind>[a-z]+)\b")
_CUSTOM_CALL = re.compile(r"\b_custom\.\w+_custom_object(?:_status)?,\s*GROUP,\s*VERSION,[^)]*\bPLURAL\b")
# AppsV1Api's ``<verb>_namespaced_<kind>`` with the kind in snake case (stateful_set -> statefulsets).
_APPS_CALL = re.compile(r"\b_apps\.(?:read|create|patch|replace|delete|list)_namespaced_(?P<kind>[a-z_]+)\b")


def _client_calls(text: str) -> set[tuple[str, str]]:
    found = {("", match.group("kind") + "s") for match in _CORE_CALL.finditer(text)}
    found |= {("apps", match.group("kind").replace("_", "") + "s") for match in _APPS_CALL.finditer(text)}
    if _CUSTOM_CALL.search(text):
        found.add((GROUP, "batchprofiles"))
    return found


_PROMETHEUS_API = frozenset(
    {
        "query",
        "query_range",
        "series",
        "labels",
        "label",
        "targets",
        "rules",
        "alerts",
        "status",
        "metadata",
        "format_query",
    }
)


def test_every_resource_the_operator_code_calls_is_declared() -> None:
    """The operator's own REST calls (besides kopf's) name only resources of the declared list."""
    declared = {(p.api_group, p.resource) for p in rbac.PERMISSIONS}
    source = REPO / "operator" / "batchpilot_operator"
    found: set[tuple[str, str]] = set()
    for path in source.rglob("*.py"):
        for match in _API_PATH.finditer(path.read_text()):
            group = match.group("group") or ""
            group = GROUP if group == "{GROUP}" else group
            if not match.group(0).startswith("/apis/"):
                group = ""
            if not group and match.group("resource") in _PROMETHEUS_API:
                continue  # Prometheus' HTTP API (the demo's fake Prometheus), not Kubernetes'
            found.add((group, match.group("resource")))
        found |= _client_calls(path.read_text())
    assert ("", "secrets") in found and ("", "events") in found  # the extraction sees the calls
    assert (GROUP, "batchprofiles") in found
    assert ("apps", "deployments") in found and ("apps", "statefulsets") in found
    assert found <= declared, f"undeclared: {sorted(found - declared)}"
