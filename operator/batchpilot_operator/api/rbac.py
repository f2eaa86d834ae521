"""The Kubernetes API access the operator needs: the one declared list.

Every API call the operator makes, its own and kopf's, is covered by an entry
here. The Helm chart's ClusterRole/Role rules and the kustomize base grant
exactly these entries and nothing more (a test expands both and compares),
and the operator reads the list to know which features its RBAC allows.

Two modes, as in the chart:

- ``clusterwide`` (``--all-namespaces``): one ClusterRole holds everything,
  Secret reads in every namespace included.
- ``namespaced`` (``--namespace`` for each watched namespace): a Role in each
  watched namespace holds the namespace-scoped entries (Secret reads there and
  nowhere else); a small ClusterRole holds only the cluster-scoped ones kopf
  needs for scanning.

Peering (several replicas, at most one active) adds kopf's peering objects:
``clusterkopfpeerings`` in clusterwide mode, ``kopfpeerings`` in each watched
namespace otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from batchpilot_operator import GROUP, PLURAL

Scope = Literal["cluster", "namespace"]
Mode = Literal["clusterwide", "namespaced"]
MODES: tuple[Mode, ...] = ("clusterwide", "namespaced")

KOPF_GROUP = "kopf.dev"
CORE_GROUP = ""


@dataclass(frozen=True)
class Permission:
    """One resource and the verbs the operator uses on it."""

    api_group: str
    resource: str
    verbs: tuple[str, ...]
    scope: Scope
    """``cluster``: a cluster-scoped resource, which only a ClusterRole can grant."""
    why: str
    modes: frozenset[Mode] = field(default_factory=lambda: frozenset(MODES))
    needs_peering: bool = False

    def triples(self) -> frozenset[tuple[str, str, str]]:
        return frozenset((self.api_group, self.resource, verb) for verb in self.verbs)


PERMISSIONS: tuple[Permission, ...] = (
    Permission(
        GROUP,
        PLURAL,
        ("get", "list", "watch", "patch"),
        "namespace",
        "kopf watches BatchProfiles and patches its progress annotations and finalizers on them",
    ),
    Permission(
        GROUP,
        f"{PLURAL}/status",
        ("get", "patch", "update"),
        "namespace",
        "status (window in force, observations, conditions) is written through the status subresource",
    ),
    Permission(
        CORE_GROUP,
        "pods",
        ("get", "list", "watch"),
        "namespace",
        "the index of runtime pods by labels, their IPs and readiness",
    ),
    Permission(
        CORE_GROUP,
        "events",
        ("create",),
        "namespace",
        "an Event for every decision and push failure (kopf and batchpilot_operator.io.kube both post core/v1 Events)",
    ),
    Permission(
        CORE_GROUP,
        "secrets",
        ("get",),
        "namespace",
        "a profile's spec.runtime.adminTokenSecret, a Secret of the profile's own namespace, holds the bearer "
        "token for its pods' admin API. get only: the operator reads a Secret a profile names and can list none. "
        "Namespaced, a Role grants it in each watched namespace; cluster-wide, a profile in any namespace may "
        "name one, which takes the ClusterRole (resourceNames cannot help: the names are the profiles' choice)",
    ),
    Permission(
        "apps",
        "deployments",
        ("get", "patch"),
        "namespace",
        "tuning.mode restart reads the workload a profile names in spec.restart and server-side applies its "
        "engine container's args (field manager batchpilot), which rolls it",
    ),
    Permission(
        "apps",
        "statefulsets",
        ("get", "patch"),
        "namespace",
        "as deployments, for a spec.restart workload of kind StatefulSet",
    ),
    Permission(
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("list", "watch"),
        "cluster",
        "kopf scans CRDs to notice when the BatchProfile CRD appears, changes or goes",
    ),
    Permission(
        CORE_GROUP,
        "namespaces",
        ("list", "watch"),
        "cluster",
        "kopf resolves the watched namespaces and follows their creation and deletion "
        "(it lists namespaces only when not cluster-wide)",
        modes=frozenset({"namespaced"}),
    ),
    Permission(
        KOPF_GROUP,
        "clusterkopfpeerings",
        ("get", "list", "watch", "patch"),
        "cluster",
        "kopf peering of cluster-wide operators: at most one replica is active",
        modes=frozenset({"clusterwide"}),
        needs_peering=True,
    ),
    Permission(
        KOPF_GROUP,
        "kopfpeerings",
        ("get", "list", "watch", "patch"),
        "namespace",
        "kopf peering of namespaced operators, one KopfPeering per watched namespace",
        modes=frozenset({"namespaced"}),
        needs_peering=True,
    ),
)


def required_permissions(*, mode: Mode, peering: bool) -> tuple[Permission, ...]:
    """The entries the operator needs when it runs in ``mode``, with or without peering."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return tuple(p for p in PERMISSIONS if mode in p.modes and (peering or not p.needs_peering))


def policy_rules(permissions: Iterable[Permission]) -> list[dict[str, list[str]]]:
    """RBAC ``rules`` granting exactly these permissions: one rule per (group, resource), sorted."""
    verbs_by_key: dict[tuple[str, str], set[str]] = {}
    for permission in permissions:
        verbs_by_key.setdefault((permission.api_group, permission.resource), set()).update(permission.verbs)
    return [
        {"apiGroups": [group], "resources": [resource], "verbs": sorted(verbs)}
        for (group, resource), verbs in sorted(verbs_by_key.items())
    ]


def cluster_role_rules(*, mode: Mode, peering: bool) -> list[dict[str, list[str]]]:
    """Rules of the operator's ClusterRole: everything when cluster-wide, else only cluster-scoped entries."""
    needed = required_permissions(mode=mode, peering=peering)
    if mode == "clusterwide":
        return policy_rules(needed)
    return policy_rules(p for p in needed if p.scope == "cluster")


def expand_rules(rules: Sequence[Mapping[str, object]]) -> frozenset[tuple[str, str, str]]:
    """Every (apiGroup, resource, verb) a list of RBAC rules grants, wildcards kept as ``*``.

    Raises ValueError naming the rule when a field is missing or malformed, and
    for ``nonResourceURLs`` or ``resourceNames``, which this operator never uses.
    """
    granted: set[tuple[str, str, str]] = set()
    for index, rule in enumerate(rules):
        for forbidden in ("nonResourceURLs", "resourceNames"):
            if rule.get(forbidden):
                raise ValueError(f"rules[{index}].{forbidden}: not used by the operator")
        lists: dict[str, list[str]] = {}
        for key in ("apiGroups", "resources", "verbs"):
            value = rule.get(key)
            if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
                raise ValueError(f"rules[{index}].{key}: must be a non-empty list of strings")
            lists[key] = value
        for group in lists["apiGroups"]:
            for resource in lists["resources"]:
                for verb in lists["verbs"]:
                    granted.add((group, resource, verb))
    return frozenset(granted)


def permission_triples(permissions: Iterable[Permission]) -> frozenset[tuple[str, str, str]]:
    return frozenset(t for p in permissions for t in p.triples())
