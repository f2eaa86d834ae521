"""What the end-to-end operator tests share: ``batchpilot-operator run`` as a subprocess against the
kmock emulator and a real Prometheus, the pods and profile it watches, the profile's status as it
writes it, and its decisions counted from its own metrics.

Intervals in these tests are counted in the operator's decisions (one per interval), never in
seconds, so that a slow machine only makes a test longer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchpilot_operator import API_VERSION, PLURAL
from tests.integration.kmock_cluster import PROFILES, KubeCluster, OperatorProcess, pod_body, profile_body
from tests.integration.prometheus_process import prometheus_binary

_DECISIONS = re.compile(r"^batchpilot_operator_decisions_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def marks(timeout_s: int) -> list[pytest.MarkDecorator]:
    """A slow test, failed after ``timeout_s``, skipped where Prometheus is not installed."""
    return [
        pytest.mark.slow,
        pytest.mark.timeout(timeout_s),
        pytest.mark.skipif(prometheus_binary() is None, reason="prometheus not installed (scripts/system-deps.sh)"),
    ]


def decisions_total(metrics_text: str) -> float:
    """The operator's decisions so far, over every profile, from its ``/metrics`` text."""
    return sum(float(match.group(1)) for match in _DECISIONS.finditer(metrics_text))


async def decisions_of(operator: OperatorProcess) -> float:
    return decisions_total(await operator.metrics_text())


def start_operator(
    workdir: Path, cluster_url: str, prometheus_url: str, *flags: str, interval_s: float, name: str = "operator"
) -> OperatorProcess:
    """The operator on every namespace, reading Prometheus (scraped every second), one interval every
    ``interval_s``, ticking every 0.25 s, without peering; ``flags`` adds to these."""
    return OperatorProcess(
        workdir, cluster_url, "-A", "--prometheus-url", prometheus_url, "--scrape-interval", "1",
        "--interval-override", f"{interval_s:g}", "--tick", "0.25", "--peering", "off", *flags, name=name,
    )  # fmt: skip


async def add_ready_pod(api: httpx.AsyncClient, namespace: str, name: str, labels: Mapping[str, str], ip: str) -> None:
    response = await api.post(
        f"/api/v1/namespaces/{namespace}/pods", json=pod_body(namespace, name, labels, ip, ready=True)
    )
    assert response.status_code == 200, response.text


async def add_profile(api: httpx.AsyncClient, namespace: str, name: str, spec: Mapping[str, Any]) -> None:
    path = f"/apis/{API_VERSION}/namespaces/{namespace}/{PLURAL}"
    response = await api.post(path, json=profile_body(namespace, name, spec))
    assert response.status_code == 200, response.text


def profile_status(cluster: KubeCluster, namespace: str, name: str) -> dict[str, Any]:
    """The profile's status as the operator last wrote it (empty before it writes one)."""
    return dict((cluster.get(PROFILES, namespace, name) or {}).get("status") or {})


def profile_condition(cluster: KubeCluster, namespace: str, name: str, type_: str) -> dict[str, Any]:
    """The profile's condition of this type (empty while it has none)."""
    conditions = profile_status(cluster, namespace, name).get("conditions", [])
    return next((dict(c) for c in conditions if c["type"] == type_), {})
