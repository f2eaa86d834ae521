"""Liveness when kopf's BatchProfile watch goes silent while its connection stays open: kopf reconnects, or the
probe fails in time.

Needs kmock: a real server does not silence an open watch on demand. The rest of the liveness tests (a watch
that misses changes, a stuck loop, a standby's watch check and keep-alive) run on the test control plane:
tests/apiserver/test_liveness_on_apiserver.py.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.integration.kmock_cluster import PROFILES, OperatorProcess, profile_body, running_cluster, wait_for
from tests.support.factories import make_spec_dict

SPEC = make_spec_dict(tuning=None)


# ---- a real kopf watch that dies silently -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("inactivity_timeout_s", "watch_check_s", "outcome"),
    [
        pytest.param(3.0, 600.0, "reconnects", id="kopf-inactivity-timeout-reconnects"),
        pytest.param(600.0, 1.0, "liveness-fails", id="watch-check-fails-liveness"),
    ],
)
async def test_silently_dropped_watch_is_reconnected_or_fails_liveness_in_time(
    tmp_path: Path, inactivity_timeout_s: float, watch_check_s: float, outcome: str
) -> None:
    """The emulator stops sending on the open BatchProfile watch and keeps the connection open; then the spec
    changes. Whichever of kopf's inactivity timeout and the operator's watch check comes first must act within
    its configured time: kopf reconnects (the change is handled) or liveness fails (the kubelet restarts it).
    A passing probe is cached by kopf for 10 s, hence that term in the liveness bound.

    Needs kmock: a real server does not silence an open watch on demand."""
    async with running_cluster() as (cluster, url), httpx.AsyncClient(base_url=url, timeout=10) as api:
        response = await api.post(PROFILES_PATH, json=profile_body("ml", "chat", SPEC))
        assert response.is_success, response.text
        options = {
            "peering": "off",
            "tick_s": 0.3,
            "interval_override_s": 1.0,
            "watch_inactivity_timeout_s": inactivity_timeout_s,
            "watch_client_timeout_s": 3 * inactivity_timeout_s,
            "watch_server_timeout_s": int(3 * inactivity_timeout_s),
            "watch_check_s": watch_check_s,
        }
        operator = OperatorProcess(tmp_path, url, options=options)
        try:
            await wait_for(lambda: "profile ml/chat (generation 1) registered" in operator.log_text(), 60,
                           "the profile handled")  # fmt: skip
            await wait_for(lambda: _live(operator), 60, "a passing probe")
            opened = cluster.watch_count(PROFILES)
            cluster.silence_watches(PROFILES)
            await api.patch(f"{PROFILES_PATH}/chat", json={"spec": {"slo": {"p99Ms": 400}}},
                            headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
            if outcome == "reconnects":
                await wait_for(lambda: "profile ml/chat (generation 2) registered" in operator.log_text(),
                               inactivity_timeout_s + 20, "the change handled after a reconnect")  # fmt: skip
                assert cluster.watch_count(PROFILES) > opened
                assert await operator.liveness() == 200
            else:
                await wait_for(lambda: _dead(operator), 2 * watch_check_s + 10 + 20, "liveness failing")
                assert "BatchProfile watch stuck" in operator.log_text()
                assert "generation 2" not in operator.log_text()
        finally:
            operator.stop()


PROFILES_PATH = "/apis/batchpilot.dev/v1alpha1/namespaces/ml/batchprofiles"


async def _live(operator: OperatorProcess) -> bool:
    return await operator.liveness() == 200


async def _dead(operator: OperatorProcess) -> bool:
    return await operator.liveness() == 500
