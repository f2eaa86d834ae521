"""Two operator replicas with kopf peering on the test control plane: one acts, and when it is killed the other
takes over within the peering lifetime (deploy/README.md: "the standby takes over within the peering lifetime").

The chart is installed with ``operator.peering.enabled`` (its kopf CRDs and ClusterKopfPeering on the real
server) and two replicas; both run as hollow pods would (tests/e2e/test_cluster.py says how), with the
Deployment's own args plus a peering lifetime of 12 s instead of 60 s and fixed priorities, so that the
takeover is timed in seconds and which replica acts first is known.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import CHART
from tests.support.control_plane import ControlPlane
from tests.support.hollow_release import HollowOperator, helm, start_operator, stop_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

RELEASE = "bp-peer"
PROFILE = f"{RELEASE}-batchpilot-tiny"
LIFETIME_S = 12
TAKEOVER_MARGIN_S = 20  # kopf's keep-alive comes 5-10 s before expiry; a busy 2-core host adds seconds


def _observed(plane: ControlPlane, namespace: str) -> int:
    status: dict[str, Any] = plane.get("batchprofile", PROFILE, namespace=namespace).get("status") or {}
    return int(status.get("observedGeneration") or 0)


def _wait(predicate: Any, timeout_s: float, what: str, logs: list[Path]) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in logs)
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")
        time.sleep(0.5)  # polling the API server or a log
    return time.monotonic() - started


def test_the_standby_takes_over_within_the_peering_lifetime(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    plane = control_plane
    work = tmp_path_factory.mktemp("peering")
    namespace = plane.namespace("bp-peer")
    values = {
        "operator": {"replicas": 2, "peering": {"enabled": True}, "prometheusUrl": "http://127.0.0.1:9/"},
        "models": [
            {
                "name": "tiny",
                "preset": "tiny",
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
    token_file = work / "admin-token"
    token_file.write_text("unused: no runtime pod here")

    def operator(name: str, priority: int) -> HollowOperator:
        flags = (f"--peering-lifetime={LIFETIME_S}", f"--priority={priority}")
        return start_operator(plane, namespace, f"{RELEASE}-batchpilot-operator", token_file, work, *flags, name=name)

    first = operator("operator-a", 20)
    second: HollowOperator | None = None
    second_log = work / "operator-b.log"
    logs = [first.log, second_log]
    try:
        # 1. One replica acts (it registers the profile and writes its status). A second one with a lower
        #    priority joins, as in a rolling update: kopf finds the higher peer and keeps it paused, so it never
        #    registers the profile. (Two started at the same instant may both act for a moment before either
        #    has written its peer record: kopf's peering is not a lock.)
        _wait(lambda: _observed(plane, namespace) == 1, 120, "the active replica to write status", logs)
        second = operator("operator-b", 10)
        _wait(lambda: "Initial authentication has finished" in second_log.read_text(), 60, "the standby's start", logs)
        time.sleep(5)  # the standby's start-up, which would register the profile were it active
        assert "registered" not in second_log.read_text(), second_log.read_text()[-2000:]
        resumed_before = second_log.read_text().count("Resuming operations after the pause")

        # 2. The active one is killed; a spec change is then acted on only by a replica that took over.
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=30)
        window = {"targetBatchSize": 6, "hardCap": 12, "maxWaitMs": 10}
        patch = json.dumps({"spec": {"window": window}})
        plane.kubectl("patch", "batchprofile", PROFILE, "-n", namespace, "--type=merge", "-p", patch)
        _wait(
            lambda: _observed(plane, namespace) == 2, LIFETIME_S + TAKEOVER_MARGIN_S, "the standby to take over", logs
        )
        assert second_log.read_text().count("Resuming operations after the pause") == resumed_before + 1
        assert "registered" in second_log.read_text()
        status = plane.get("batchprofile", PROFILE, namespace=namespace)["status"]
        assert status["window"]["hardCap"] == 12 and status["window"]["generation"] == 2, status
    finally:
        stop_process(first.process)
        if second is not None:
            stop_process(second.process)
        helm(plane, "uninstall", RELEASE, "--namespace", namespace, check=False)
