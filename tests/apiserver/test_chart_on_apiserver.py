"""The chart and the kustomize overlays on a real kube-apiserver v1.37.2 (issue #27, part 3).

``helm install`` of ``charts/batchpilot`` with its defaults and with the quickstart's values, and
``kubectl apply --server-side`` of the kustomize overlays as deploy/README.md says: every object
whose API the server serves is created. A bare control plane serves no Prometheus Operator API, so
the quickstart's PodMonitor and ServiceMonitor are listed by name and left out (the install turns
them off); nothing else may be missing.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.tools import CHART, DEPLOY, helm_path, kustomize, load_documents
from tests.deploy.tools import run as run_tool
from tests.support.control_plane import ControlPlane

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUICKSTART = DEPLOY / "helm" / "quickstart-values.yaml"
MONITORING_OFF = ("monitoring.podMonitor.enabled=false", "monitoring.serviceMonitor.enabled=false")


def _helm(plane: ControlPlane, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_tool([helm_path(), "--kubeconfig", plane.kubeconfig, *args], timeout_s=300)


def _served(plane: ControlPlane) -> set[tuple[str, str]]:
    """(apiVersion, kind) of every resource the server serves, from its discovery."""
    lines = plane.kubectl("api-resources", "--no-headers").stdout.splitlines()
    served = set()
    for line in lines:
        columns = line.split()
        served.add((columns[-3], columns[-1]))  # ... APIVERSION NAMESPACED KIND
    return served


def _is_hook(doc: dict[str, Any]) -> bool:
    return "helm.sh/hook" in (doc["metadata"].get("annotations") or {})


def _missing(plane: ControlPlane, docs: list[dict[str, Any]], namespace: str) -> list[str]:
    """``kind/name`` of each object of ``docs`` the server does not have."""
    missing = []
    for doc in docs:
        scope = ["--namespace", doc["metadata"].get("namespace") or namespace]
        found = plane.kubectl("get", doc["kind"], doc["metadata"]["name"], *scope, "-o", "name", check=False)
        if found.returncode != 0:
            missing.append(f"{doc['kind']}/{doc['metadata']['name']}: {found.stderr.strip()}")
    return missing


def _template(release: str, namespace: str, *args: str | Path) -> list[dict[str, Any]]:
    rendered = run_tool([helm_path(), "template", release, CHART, "--namespace", namespace, *args]).stdout
    return [doc for doc in load_documents(rendered) if not _is_hook(doc)]


def test_the_chart_with_its_defaults_creates_every_object(control_plane: ControlPlane) -> None:
    namespace = control_plane.namespace("chart")
    _helm(control_plane, "install", "defaults", CHART, "--namespace", namespace)
    docs = _template("defaults", namespace)
    served = _served(control_plane)
    assert [f"{d['kind']}/{d['metadata']['name']}" for d in docs if (d["apiVersion"], d["kind"]) not in served] == []
    assert _missing(control_plane, docs, namespace) == []


def test_the_quickstart_creates_every_served_object_and_names_the_rest(control_plane: ControlPlane) -> None:
    namespace = control_plane.namespace("quick")
    docs = _template("quick", namespace, "--values", QUICKSTART)
    served = _served(control_plane)
    unserved = sorted(
        f"{d['kind']}/{d['metadata']['name']}" for d in docs if (d["apiVersion"], d["kind"]) not in served
    )
    # The Prometheus Operator's kinds: a bare control plane does not serve them.
    assert unserved == ["PodMonitor/quick-batchpilot-runtime", "ServiceMonitor/quick-batchpilot-operator"], unserved
    sets = [arg for setting in MONITORING_OFF for arg in ("--set", setting)]
    _helm(control_plane, "install", "quick", CHART, "--namespace", namespace, "--values", QUICKSTART, *sets)
    assert _missing(control_plane, [d for d in docs if (d["apiVersion"], d["kind"]) in served], namespace) == []
    profile = control_plane.get("batchprofile", "quick-batchpilot-chat", namespace=namespace)
    assert profile["spec"]["window"] == {"targetBatchSize": 16, "hardCap": 32, "maxWaitMs": 20, "tailMarkRatio": 2.0}


def test_the_kustomize_overlays_apply_server_side_as_the_deploy_readme_says(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    # dev: one apply (its namespace and Secret are in the overlay).
    dev = kustomize(DEPLOY / "overlays" / "dev")
    control_plane.kubectl("apply", "--server-side", "-k", str(DEPLOY / "overlays" / "dev"))
    assert _missing(control_plane, dev, "batchpilot-dev") == []

    # production: one apply cannot create the peering CRD and its object together ...
    production_dir = DEPLOY / "overlays" / "production"
    production = kustomize(production_dir)
    # A server without kopf's CRDs, as a fresh cluster is (the peering e2e test installs them with the chart).
    control_plane.kubectl(
        "delete", "crd", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev", "--ignore-not-found", "--wait"
    )
    # kubectl as a newcomer runs it: no discovery cache that still knows the kind from an earlier run.
    fresh_cache = ["--cache-dir", str(tmp_path / "kube-cache")]
    once = control_plane.kubectl("apply", "--server-side", "-k", str(production_dir), *fresh_cache, check=False)
    assert once.returncode != 0 and 'no matches for kind "ClusterKopfPeering"' in once.stderr, once.stderr
    # ... so the README applies the CRDs first, creates the namespace and the token Secret, then the overlay.
    control_plane.kubectl(
        "apply", "--server-side", "-f", str(DEPLOY.parent / "crds"), "-f", str(production_dir / "kopf-peering-crd.yaml")
    )
    control_plane.kubectl("wait", "--for=condition=Established", "crd/clusterkopfpeerings.kopf.dev", "--timeout=60s")
    if control_plane.kubectl("get", "namespace", "batchpilot-system", check=False).returncode != 0:
        control_plane.kubectl("create", "namespace", "batchpilot-system")
    control_plane.kubectl(
        "create", "secret", "generic", "batchpilot-admin-token", "--namespace", "batchpilot-system",
        "--from-literal=token=not-a-secret-test-token",
    )  # fmt: skip
    control_plane.kubectl("apply", "--server-side", "-k", str(production_dir))
    assert _missing(control_plane, production, "batchpilot-system") == []


def _has_crd(plane: ControlPlane, name: str) -> bool:
    return plane.kubectl("get", "crd", name, check=False).returncode == 0
