"""A load step over the SLO on the test control plane: the operator lowers the window, and the server and
the runtimes say so.

The release runs as tests/e2e/test_cluster.py runs its own (the chart installed, the operator with its
Deployment's args and a TokenRequest token of the chart's ServiceAccount, runtime pods played by hollow
nodes), with two runtime replicas and a real Prometheus scraping both pods (with the ``namespace`` and
``pod`` labels a PodMonitor gives). Through the chart's values the operator reads a 1 s scrape interval and
decides every 2 s (``operator.extraArgs``: ``--interval-override``; a profile allows >= 5 s).

The step is tests/support/load_step.py's, so that it overloads the runtimes on any machine: their capacity
is measured first (before Prometheus scrapes them, with a cap that takes a whole burst; the operator then
pushes the profile's window), the SLO is set to 3x the P99 under light load, and the step comes at 3x the
capacity. The window must go down within 3 intervals, counted in the operator's own decisions (never in
seconds). Then, on the server: ``status.window`` lowered and ``status.lastDecision`` saying why, SLOMet
False, a Decision Event for the generation in force; both runtimes' ``/admin/window`` in that generation;
and no request of the operator refused (RBAC) through the whole run.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from batchpilot_operator import API_VERSION, PLURAL
from batchpilot_runtime.replay.loadgen import Endpoint
from tests.deploy.tools import CHART
from tests.integration.prometheus_process import (
    PrometheusProcess,
    ScrapeTarget,
    prometheus_binary,
    start_prometheus,
)
from tests.integration.runtime_process import wait_until
from tests.support import load_step
from tests.support.control_plane import ControlPlane
from tests.support.hollow_release import (
    SERVE_PORT,
    HollowOperator,
    HollowRuntime,
    admin_token_file,
    helm,
    start_operator,
    start_runtime,
    stop_process,
)
from tests.support.operator_e2e import decisions_total
from tests.support.operator_process import free_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus not installed (scripts/system-deps.sh)"),
]

RELEASE = "bp-load"
MODEL = "chat"
PROFILE = f"{RELEASE}-batchpilot-{MODEL}"
INTERVAL_S = 2.0
REPLICAS = 2


def _values(prometheus_url: str) -> dict[str, Any]:
    return {
        "operator": {
            "prometheusUrl": prometheus_url,
            "scrapeIntervalSeconds": 1,
            "extraArgs": [f"--interval-override={INTERVAL_S:g}", "--tick=0.25"],
        },
        "runtime": {"terminationGracePeriodSeconds": 10},
        "models": [
            {
                "name": MODEL,
                "preset": "tiny",
                "replicas": REPLICAS,
                "profile": {
                    "window": {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 20, "tailMarkRatio": 2.0},
                    # No SLO to speak of until the light load's P99 is known.
                    "slo": {"latencyMetric": "ttft", "p99Ms": 60_000},
                    "tuning": {"mode": "adaptive", "cooldownSeconds": 0, "maxStepFraction": 0.5},
                },
            }
        ],
    }


@dataclass
class LoadRelease:
    namespace: str
    runtimes: list[HollowRuntime]
    token: str  # the chart's admin token, for the runtimes' /admin/window
    capacity_per_s: float  # both runtimes together, on the step's requests
    prometheus: PrometheusProcess
    operator: HollowOperator
    api: httpx.Client  # the API server, as the admin

    @property
    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(url=runtime.serve_url, model=MODEL) for runtime in self.runtimes]

    def profile(self) -> dict[str, Any]:
        response = self.api.get(f"/apis/{API_VERSION}/namespaces/{self.namespace}/{PLURAL}/{PROFILE}")
        response.raise_for_status()
        return dict(response.json())

    def status(self) -> dict[str, Any]:
        return dict(self.profile().get("status") or {})

    def condition(self, type_: str) -> dict[str, Any]:
        return next((dict(c) for c in self.status().get("conditions", []) if c["type"] == type_), {})

    def decisions(self) -> float:
        return decisions_total(httpx.get(self.operator.metrics_url, timeout=10).text)

    def admin_window(self, runtime: HollowRuntime) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.token}"}
        response = httpx.get(f"{runtime.admin_url}/admin/window", headers=headers, timeout=20)
        response.raise_for_status()
        return dict(response.json()["window"])

    def events(self) -> list[dict[str, Any]]:
        """The Events about the profile, as the API server holds them."""
        selector = f"involvedObject.kind=BatchProfile,involvedObject.name={PROFILE}"
        response = self.api.get(f"/api/v1/namespaces/{self.namespace}/events", params={"fieldSelector": selector})
        response.raise_for_status()
        return list(response.json()["items"])

    def wait(self, predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """Poll ``predicate`` (every 0.2 s) until it returns a truthy value; a transient error of a busy API
        server or runtime counts as not yet. Fails with the end of the operator's log."""

        def attempt() -> Any:
            self.operator.alive()
            try:
                return predicate()
            except (httpx.HTTPError, KeyError, TypeError):
                return None

        try:
            return wait_until(attempt, timeout_s, what, interval_s=0.2)
        except TimeoutError as timeout:
            raise AssertionError(f"{timeout}: {self.status()}\n{self.operator.text()[-4000:]}") from None


@pytest.fixture
def release(control_plane: ControlPlane, tmp_path: Path) -> Iterator[LoadRelease]:
    plane = control_plane
    namespace = plane.namespace("bp-load")
    # The operator's Prometheus URL is in the chart's values, but Prometheus starts only after the runtimes'
    # capacity is measured (the bursts must be in no rate window the operator reads): its port is chosen now.
    prometheus_port = free_port()
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(_values(f"http://127.0.0.1:{prometheus_port}")))
    helm(plane, "install", RELEASE, CHART, "--namespace", namespace, "--values", values)
    token_file = admin_token_file(plane, namespace, f"{RELEASE}-batchpilot-admin-token", tmp_path / "admin-token")
    runtimes: list[HollowRuntime] = []
    with ExitStack() as stack:
        stack.callback(helm, plane, "uninstall", RELEASE, "--namespace", namespace, check=False)
        # 1. The runtime pods, with the container's args but the capacity-measuring cap (the operator sets
        #    the profile's window once it runs).
        for replica in range(REPLICAS):
            runtime = start_runtime(
                plane, namespace, PROFILE, token_file, tmp_path / f"runtime-{replica}.log",
                replace={"--hard-cap": str(load_step.CAPACITY_HARD_CAP)},
            )  # fmt: skip
            stack.callback(stop_process, runtime.process)
            runtimes.append(runtime)
        endpoints = [Endpoint(url=runtime.serve_url, model=MODEL) for runtime in runtimes]
        # 2. What these runtimes complete per second on this machine as it is now.
        capacity = asyncio.run(load_step.measure_capacity(endpoints))
        # 3. Prometheus scrapes both pods, then the operator starts.
        targets = [
            ScrapeTarget(f"{runtime.ip}:{SERVE_PORT}", {"namespace": namespace, "pod": runtime.pod})
            for runtime in runtimes
        ]
        prometheus = start_prometheus(tmp_path / "prometheus", targets, scrape_interval_s=1.0, port=prometheus_port)
        stack.callback(prometheus.stop)
        operator = start_operator(plane, namespace, f"{RELEASE}-batchpilot-operator", token_file, tmp_path)
        stack.callback(stop_process, operator.process)
        api = stack.enter_context(plane.client())
        yield LoadRelease(namespace, runtimes, token_file.read_text(), capacity, prometheus, operator, api)


def _lowered(window: dict[str, Any], before: dict[str, Any]) -> bool:
    """A newer window with a smaller target or a shorter wait (the policy may raise the cap in the same
    move when the queue is long, and then calls the whole change "up")."""
    return window.get("generation", 0) > before["generation"] and (
        window["targetBatchSize"] < before["targetBatchSize"] or window["maxWaitMs"] < before["maxWaitMs"]
    )


def _wait_for_the_profile_window_on_both_runtimes(release: LoadRelease) -> None:
    """Both runtimes get the profile's window, and Prometheus scrapes both."""
    release.wait(
        lambda: release.condition("Synced").get("status") == "True" and release.status()["pods"]["synced"] == REPLICAS,
        120,
        "both pods Synced",
    )
    assert [release.admin_window(runtime)["hardCap"] for runtime in release.runtimes] == [16] * REPLICAS
    release.wait(release.prometheus.targets_up, 60, "Prometheus to scrape both runtimes")


def _set_the_slo_from_a_light_load(
    release: LoadRelease, loads: list[subprocess.Popen[bytes]], tmp_path: Path
) -> tuple[float, float]:
    """Light load: metrics flow; the SLO is set to 3x the P99 it gives on this machine. Returns the light-load
    P99 and the SLO, in ms; the light load goes on (in ``loads``)."""
    loads.append(load_step.start_light_load(release.endpoints, tmp_path / "light.log"))
    release.wait(lambda: release.condition("MetricsAvailable").get("status") == "True", 90, "metrics")
    light_p99_ms = release.wait(lambda: release.status()["observed"]["p99Ms"], 30, "a light-load P99")
    slo_ms = load_step.slo_from_light_p99(light_p99_ms)
    patch = {"spec": {"slo": {"p99Ms": round(slo_ms)}}}
    release.api.patch(
        f"/apis/{API_VERSION}/namespaces/{release.namespace}/{PLURAL}/{PROFILE}",
        content=json.dumps(patch),
        headers={"Content-Type": "application/merge-patch+json"},
    ).raise_for_status()
    release.wait(lambda: release.condition("Synced").get("observedGeneration") == 2, 30, "generation 2 observed")
    return light_p99_ms, slo_ms


def _assert_the_step_lowers_the_window_within_three_intervals(
    release: LoadRelease, before: dict[str, Any], step: subprocess.Popen[bytes], slo_ms: float
) -> None:
    """Intervals are counted in the operator's own decisions, from the first interval whose observation has P99
    over the SLO (the status carries both in one patch); the step is stopped once the window is lowered."""
    release.wait(lambda: release.status()["observed"]["p99Ms"] > slo_ms, 120, f"P99 over the SLO ({slo_ms:.0f} ms)")
    decisions_at_first_miss = release.decisions()
    release.wait(lambda: _lowered(release.status()["window"], before), 120, "a lowered window")
    decisions_at_down = release.decisions()
    # The first over-SLO interval counts as one: the lowering comes within it or the next two.
    assert decisions_at_down - decisions_at_first_miss <= 2, (decisions_at_first_miss, decisions_at_down)
    status = release.status()
    print(f"lowered {decisions_at_down - decisions_at_first_miss:g} decisions after the first P99 over the SLO: "
          f"{before} -> {status['window']} ({status['lastDecision']})")  # fmt: skip
    assert status["lastDecision"]["reason"] and status["lastDecision"]["time"]
    assert status["observed"]["p99Ms"] > slo_ms
    assert release.condition("SLOMet")["status"] == "False"
    load_step.stop_load(step)  # what follows does not need it


def _wait_for_the_status_and_both_runtimes_to_agree(release: LoadRelease) -> dict[str, Any]:
    """The window in force once the server's status and both runtimes agree on it. The operator keeps deciding
    every interval (the light load goes on), so agreement is awaited between two pushes."""

    def agreed() -> dict[str, Any] | None:
        status = release.status()
        synced = next(c for c in status["conditions"] if c["type"] == "Synced")
        if status["pods"]["synced"] != REPLICAS or synced["status"] != "True":
            return None
        in_force = {k: v for k, v in status["window"].items() if k != "appliedAt"}
        windows = [release.admin_window(runtime) for runtime in release.runtimes]
        if all(window == in_force for window in windows) and release.status()["window"] == status["window"]:
            return in_force
        return None

    return dict(release.wait(agreed, 60, "the status and both runtimes to agree on the window"))


def _assert_a_decision_event_names_the_generation_in_force(release: LoadRelease, in_force: dict[str, Any]) -> None:
    release.wait(
        lambda: any(e["reason"] in ("DecisionDown", "DecisionUp") for e in release.events()), 30, "a Decision Event"
    )
    described_generation = f"gen={in_force['generation']}"
    release.wait(
        lambda: any(described_generation in e["message"] for e in release.events()),
        30,
        f"an Event for the window in force ({described_generation})",
    )
    assert all(e["involvedObject"]["namespace"] == release.namespace for e in release.events())


def test_a_load_step_over_the_slo_lowers_the_window_on_the_server_and_in_the_runtimes(
    release: LoadRelease, tmp_path: Path
) -> None:
    loads: list[subprocess.Popen[bytes]] = []
    try:
        # 1. Both runtimes get the profile's window.
        _wait_for_the_profile_window_on_both_runtimes(release)
        # 2. The SLO from a light load.
        light_p99_ms, slo_ms = _set_the_slo_from_a_light_load(release, loads, tmp_path)
        before = release.status()["window"]
        # 3. The step.
        step, described = load_step.start_step(release.endpoints, release.capacity_per_s, tmp_path / "step.log")
        loads.append(step)
        print(f"SLO {slo_ms:.0f} ms (light P99 {light_p99_ms:.1f} ms); {described}")
        _assert_the_step_lowers_the_window_within_three_intervals(release, before, step, slo_ms)
        # 4. The server's status and both runtimes agree on the window in force.
        in_force = _wait_for_the_status_and_both_runtimes_to_agree(release)
        assert in_force["generation"] > before["generation"]
        # 5. The decisions are Events on the server; one names the generation in force.
        _assert_a_decision_event_names_the_generation_in_force(release, in_force)
        # 6. Nothing the operator asked of the server was refused, through the whole run.
        assert release.operator.refused() == []
    finally:
        for load in loads:
            load_step.stop_load(load)
