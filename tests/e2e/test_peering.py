"""Two operator replicas with kopf peering on the test control plane: one acts, and when it is killed the other
takes over within the peering lifetime (deploy/README.md: "the standby takes over within the peering lifetime"),
and then does all of the active one's work: it acts on a spec change and heals a runtime that restarted.

The chart is installed with ``operator.peering.enabled`` (its kopf CRDs and ClusterKopfPeering on the real
server) and two replicas; both run as hollow pods would (tests/e2e/test_cluster.py says how), with the
Deployment's own args plus a peering lifetime of 12 s instead of 60 s, a watch check every 2 s instead of 60 s,
one interval a second and fixed priorities, so that the takeover is timed in seconds and which replica acts
first is known. One runtime pod of the release runs as a hollow node runs it (tests/support/hollow_release.py).

Stands for a two-replica Deployment idling at production settings: ten minutes of it is ten watch checks and
about eleven keep-alives per replica; here the same number of watch checks happens in 20 s
(``BATCHPILOT_TEST_IDLE_WATCH_CHECKS`` sets how many), both replicas' health endpoints polled every second.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.tools import CHART
from tests.support.control_plane import ControlPlane
from tests.support.hollow_release import (
    HollowOperator,
    HollowRuntime,
    admin_token_file,
    helm,
    start_operator,
    start_runtime,
    stop_process,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

RELEASE = "bp-peer"
PROFILE = f"{RELEASE}-batchpilot-tiny"
LIFETIME_S = 12
TAKEOVER_MARGIN_S = 20  # kopf's keep-alive comes 5-10 s before expiry; a busy 2-core host adds seconds
WATCH_CHECK_S = 2
# Ten minutes of production idling is ten watch checks: each is a chance for the standby's probe to fail.
IDLE_WATCH_CHECKS = int(os.environ.get("BATCHPILOT_TEST_IDLE_WATCH_CHECKS", "10"))
# A bound for a stuck replica, not a latency target: on a 2-core host busy with other work, the watch event,
# the next tick and the push took over 30 s once (load average about 5).
PUSH_TIMEOUT_S = 90


def _status(plane: ControlPlane, namespace: str) -> dict[str, Any]:
    return dict(plane.get("batchprofile", PROFILE, namespace=namespace).get("status") or {})


def _observed(plane: ControlPlane, namespace: str) -> int:
    return int(_status(plane, namespace).get("observedGeneration") or 0)


def _wait(predicate: Any, timeout_s: float, what: str, logs: list[Path]) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in logs)
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")
        time.sleep(0.5)  # polling the API server, a log or a health endpoint
    return time.monotonic() - started


def _metric(operator: HollowOperator, name: str) -> float:
    """The sum of a metric of the operator's own (every label set); 0 while its endpoint does not answer."""
    try:
        text = httpx.get(operator.metrics_url, timeout=10).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(m) for m in re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M))


def _ticks(operator: HollowOperator) -> float:
    return _metric(operator, "batchpilot_operator_tick_seconds_count")


def _watch_checks(operator: HollowOperator) -> float:
    """Watch checks done or skipped (any outcome), from the operator's own metrics."""
    return _metric(operator, "batchpilot_operator_watch_checks_total")


def _probe_until_watch_checks(checks: int, replicas: list[HollowOperator], logs: list[Path]) -> list[str]:
    """Probe every replica's liveness once a second until each has done ``checks`` more watch checks (of any
    outcome); returns every failure seen. kopf re-runs a probe that passed at most every 10 s, so the caller also
    reads the logs for a stuck-watch verdict, which every check would log."""
    targets = [_watch_checks(replica) + checks for replica in replicas]
    failures: list[str] = []

    def probed_enough() -> bool:
        for replica in replicas:
            replica.alive()
            try:
                response = httpx.get(replica.liveness_url, timeout=5)
            except httpx.HTTPError as error:
                failures.append(f"{replica.log.stem}: {type(error).__name__}")
                continue
            if response.status_code != 200:
                failures.append(f"{replica.log.stem}: {response.status_code} {response.text[:200]}")
        return all(_watch_checks(r) >= t for r, t in zip(replicas, targets, strict=True))

    _wait(probed_enough, checks * WATCH_CHECK_S + 60, f"{checks} watch checks", logs)
    return failures


def _peer_priorities(plane: ControlPlane) -> set[int]:
    """The priorities of the replicas in the chart's ClusterKopfPeering (kopf's keep-alives)."""
    peers = plane.get("clusterkopfpeering", "batchpilot").get("status") or {}
    return {int(info.get("priority", 0)) for info in peers.values() if isinstance(info, dict)}


def _admin_window(runtime: HollowRuntime, token: str) -> dict[str, Any]:
    response = httpx.get(f"{runtime.admin_url}/admin/window", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    response.raise_for_status()
    return dict(response.json()["window"])


def _in_force(plane: ControlPlane, namespace: str) -> dict[str, Any]:
    return {k: v for k, v in _status(plane, namespace).get("window", {}).items() if k != "appliedAt"}


def _install_release(plane: ControlPlane, namespace: str, work: Path) -> Path:
    """Installs the chart with peering, two operator replicas and one static profile; returns the admin token file."""
    values = {
        "operator": {"replicas": 2, "peering": {"enabled": True}, "prometheusUrl": "http://127.0.0.1:9/"},
        "runtime": {"kvCacheTokens": 4096, "terminationGracePeriodSeconds": 10},
        "models": [
            {
                "name": "tiny",
                "preset": "tiny",
                "replicas": 1,
                "profile": {
                    "tuning": {"mode": "static"},
                    "window": {"targetBatchSize": 4, "hardCap": 8, "maxWaitMs": 10},
                },
            }
        ],
    }
    values_file = work / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    # The chart installs kopf's CRDs and the peering object: start from a server without them, as a fresh
    # cluster is (the kustomize overlay test leaves its own behind, which helm would refuse to take over).
    plane.kubectl(
        "delete", "crd", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev", "--ignore-not-found", "--wait"
    )
    helm(plane, "install", RELEASE, CHART, "--namespace", namespace, "--values", values_file)
    return admin_token_file(plane, namespace, f"{RELEASE}-batchpilot-admin-token", work / "admin-token")


def _assert_both_stay_live_and_the_standby_stays_paused(
    first: HollowOperator, second: HollowOperator, logs: list[Path]
) -> None:
    """Both replicas probed every second through the watch checks, no failure; the standby never ticks and never
    registers the profile (its watch is kopf's, closed while paused)."""
    failures = _probe_until_watch_checks(IDLE_WATCH_CHECKS, [first, second], logs)
    assert failures == [], "\n".join(failures)
    for replica in (first, second):
        assert "watch stuck" not in replica.text(), replica.text()[-3000:]
    assert _ticks(second) == 0 and "registered" not in second.text(), second.text()[-3000:]


def _assert_the_standby_takes_over_a_spec_change(
    plane: ControlPlane, namespace: str, second: HollowOperator, resumed_before: int, logs: list[Path]
) -> None:
    """With the active replica dead, a spec change is acted on only by a replica that took over."""
    window = {"targetBatchSize": 6, "hardCap": 12, "maxWaitMs": 10}
    patch = json.dumps({"spec": {"window": window}})
    plane.kubectl("patch", "batchprofile", PROFILE, "-n", namespace, "--type=merge", "-p", patch)
    _wait(lambda: _observed(plane, namespace) == 2, LIFETIME_S + TAKEOVER_MARGIN_S, "the standby to take over", logs)
    assert second.text().count("Resuming operations after the pause") == resumed_before + 1
    assert "registered" in second.text()
    status = _status(plane, namespace)
    assert status["window"]["hardCap"] == 12 and status["window"]["generation"] == 2, status


def _assert_the_new_active_heals_a_restarted_runtime(
    plane: ControlPlane, namespace: str, second: HollowOperator, runtime: HollowRuntime, token: str, logs: list[Path]
) -> None:
    """The runtime restarts (its container, same pod and address: the start-up window at generation 0); the new
    active replica pushes the window in force again, and its own watch checks pass."""
    runtime.restart()
    _wait(lambda: _admin_window(runtime, token) == _in_force(plane, namespace), PUSH_TIMEOUT_S,
          "the new active replica to heal the restarted runtime", logs)  # fmt: skip
    assert _in_force(plane, namespace)["generation"] == 2  # the same window, not a new decision
    failures = _probe_until_watch_checks(3, [second], logs)
    assert failures == [], "\n".join(failures)
    assert "watch stuck" not in second.text(), second.text()[-3000:]
    assert second.refused() == []


def test_the_standby_stays_live_takes_over_within_the_peering_lifetime_and_heals_a_restarted_runtime(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    plane = control_plane
    work = tmp_path_factory.mktemp("peering")
    namespace = plane.namespace("bp-peer")
    token_file = _install_release(plane, namespace, work)
    token = token_file.read_text()
    runtimes: list[HollowRuntime] = []

    def operator(name: str, priority: int) -> HollowOperator:
        flags = (f"--peering-lifetime={LIFETIME_S}", f"--priority={priority}", f"--watch-check={WATCH_CHECK_S}",
                 "--interval-override=1")  # fmt: skip
        return start_operator(plane, namespace, f"{RELEASE}-batchpilot-operator", token_file, work, *flags, name=name)

    first = operator("operator-a", 20)
    second: HollowOperator | None = None
    second_log = work / "operator-b.log"
    logs = [first.log, second_log]
    try:
        runtime = start_runtime(plane, namespace, PROFILE, token_file, work / "runtime.log")
        runtimes.append(runtime)
        logs.append(runtime.log)
        # 1. One replica acts (it registers the profile, writes its status and pushes the window). A second one
        #    with a lower priority joins, as in a rolling update: kopf finds the higher peer and keeps it paused,
        #    so it never registers the profile. (Two started at the same instant may both act for a moment
        #    before either has written its peer record: kopf's peering is not a lock.)
        _wait(lambda: _observed(plane, namespace) == 1, 120, "the active replica to write status", logs)
        _wait(lambda: _admin_window(runtime, token)["generation"] >= 1, PUSH_TIMEOUT_S, "the window pushed", logs)
        second = operator("operator-b", 10)
        # Its keep-alive is in the peering object: kopf on both sides sees the other (a replica started paused,
        # as kopf starts one whose peering is required, logs no "Pausing" line).
        _wait(lambda: _peer_priorities(plane) >= {10, 20}, 60, "the standby's peer record", logs)

        # 2. The idle period.
        _assert_both_stay_live_and_the_standby_stays_paused(first, second, logs)
        resumed_before = second.text().count("Resuming operations after the pause")

        # 3. The active one is killed.
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=30)
        _assert_the_standby_takes_over_a_spec_change(plane, namespace, second, resumed_before, logs)
        _wait(lambda: _admin_window(runtime, token) == _in_force(plane, namespace), PUSH_TIMEOUT_S,
              "the new active replica to push the change", logs)  # fmt: skip

        # 4. The runtime restarts.
        _assert_the_new_active_heals_a_restarted_runtime(plane, namespace, second, runtime, token, logs)
    finally:
        stop_process(first.process)
        if second is not None:
            stop_process(second.process)
        for runtime in runtimes:
            stop_process(runtime.process)
        helm(plane, "uninstall", RELEASE, "--namespace", namespace, check=False)
