"""Liveness: a silently dead BatchProfile watch and a stuck loop make the probe fail; a standby stays live."""

from __future__ import annotations

import datetime
import math
import time
from pathlib import Path
from typing import Any

import httpx
import kopf
import pytest

from batchpilot_operator.frontends.kopf_app import OperatorApp, RunOptions
from batchpilot_operator.io.kube import KubeConfig
from tests.integration.kmock_cluster import PROFILES, OperatorProcess, profile_body, running_cluster, wait_for
from tests.support.factories import make_spec_dict

SPEC = make_spec_dict(tuning=None)


def probe(app: OperatorApp) -> Any:
    """Call the registered liveness probe the way kopf's health endpoint does."""
    handlers = app.registry._activities.get_all_handlers()
    (loop_probe,) = [h for h in handlers if h.id == "loop"]
    return loop_probe.fn()


async def test_watch_that_misses_changes_fails_liveness_until_it_catches_up() -> None:
    async with running_cluster() as (_cluster, url), httpx.AsyncClient(base_url=url) as api:
        response = await api.post("/apis/batchpilot.dev/v1alpha1/namespaces/ml/batchprofiles",
                                  json=profile_body("ml", "chat", SPEC))  # fmt: skip
        version = response.json()["metadata"]["resourceVersion"]
        app = OperatorApp(RunOptions(metrics_port=0, liveness=None), KubeConfig.for_server(url))
        try:
            app.controller.start_clock()
            # The watch delivered this version: healthy.
            app.seen_versions["ml/chat"] = version
            await app._check_watch()
            assert app.watch_stuck is None
            probe(app)
            # A change the watch never delivers: one check is a suspicion (events may be in flight) ...
            await api.patch("/apis/batchpilot.dev/v1alpha1/namespaces/ml/batchprofiles/chat",
                            json={"spec": {"slo": {"p99Ms": 400}}},
                            headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
            await app._check_watch()
            assert app.watch_stuck is None
            # ... the same gap on the next check is a dead watch.
            await app._check_watch()
            assert app.watch_stuck is not None and "ml/chat" in app.watch_stuck
            with pytest.raises(kopf.PermanentError, match="watch stuck"):
                probe(app)
            # The watch catches up (kopf reconnected): healthy again.
            listed = (await api.get("/apis/batchpilot.dev/v1alpha1/namespaces/ml/batchprofiles")).json()
            app.seen_versions["ml/chat"] = listed["items"][0]["metadata"]["resourceVersion"]
            await app._check_watch()
            probe(app)
        finally:
            await app.aclose()


async def test_stuck_loop_fails_liveness() -> None:
    async with running_cluster() as (_cluster, url):
        app = OperatorApp(RunOptions(metrics_port=0, liveness=None, stuck_after_s=0.0), KubeConfig.for_server(url))
        try:
            app.controller.start_clock()
            app.controller.last_tick_finished_s = -math.inf
            with pytest.raises(kopf.PermanentError, match="loop stuck"):
                probe(app)
            await app.controller.tick()  # a tick finishing heals it (with a sane limit)
            app.controller.settings = app.controller.settings.__class__(stuck_after_s=60.0)
            probe(app)
        finally:
            await app.aclose()


# ---- peering: a standby has no watch to check, but a keep-alive to keep ------------------------------------------

PEERING_PATH = "/apis/kopf.dev/v1/clusterkopfpeerings"


def peer(priority: int, *, age_s: float = 0.0, lifetime_s: int = 60) -> dict[str, Any]:
    lastseen = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=age_s)
    return {"priority": priority, "lifetime": lifetime_s, "lastseen": lastseen.isoformat()}


async def put_peers(api: httpx.AsyncClient, peers: dict[str, Any]) -> None:
    """Replace the peering object's records (kopf's keep-alives, written by hand)."""
    await api.delete(f"{PEERING_PATH}/batchpilot")
    body = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "batchpilot"},
            "status": peers}  # fmt: skip
    assert (await api.post(PEERING_PATH, json=body)).status_code == 200


def standby_app(url: str) -> OperatorApp:
    options = RunOptions(metrics_port=0, liveness=None, peering="required", priority=10, watch_check_s=0.0)
    app = OperatorApp(options, KubeConfig.for_server(url))
    app.gate.settle_s = 0.0
    app.controller.start_clock()
    return app


def watch_checks(app: OperatorApp, outcome: str) -> float:
    return app.metrics.registry.get_sample_value("batchpilot_operator_watch_checks_total", {"outcome": outcome}) or 0.0


async def test_standby_skips_the_watch_check_and_checks_it_again_once_active() -> None:
    async with running_cluster() as (_cluster, url), httpx.AsyncClient(base_url=url) as api:
        await api.post("/apis/batchpilot.dev/v1alpha1/namespaces/ml/batchprofiles",
                       json=profile_body("ml", "chat", SPEC))  # fmt: skip
        app = standby_app(url)
        try:
            await put_peers(api, {"rival": peer(20), app.identity: peer(10)})
            assert not await app.gate.refresh()
            # Paused: kopf closed the watch, so nothing was delivered; no check counts that against the standby.
            for _ in range(3):
                await app._watch_step()
            assert app.watch_stuck is None and watch_checks(app, "standby") == 3
            assert probe(app).startswith("standby (paused in favour of rival")
            # The rival's record expires: this replica is active; its first step only restarts the period ...
            await put_peers(api, {"rival": peer(20, age_s=120), app.identity: peer(10)})
            assert await app.gate.refresh()
            await app._watch_step()
            assert watch_checks(app, "behind") == 0
            # ... then a watch that still delivers nothing is suspected once and stuck on the next check.
            await app._watch_step()
            assert app.watch_stuck is None and watch_checks(app, "behind") == 1
            await app._watch_step()
            with pytest.raises(kopf.PermanentError, match="watch stuck"):
                probe(app)
            # Paused again: the verdict is dropped, the standby is live.
            await put_peers(api, {"rival": peer(30), app.identity: peer(10)})
            assert not await app.gate.refresh()
            await app._watch_step()
            assert app.watch_stuck is None
            probe(app)
        finally:
            await app.aclose()


async def test_standby_whose_keepalive_stops_landing_fails_liveness() -> None:
    async with running_cluster() as (_cluster, url), httpx.AsyncClient(base_url=url) as api:
        app = standby_app(url)
        lifetime_s = app.options.peering_lifetime_s
        try:
            await put_peers(api, {"rival": peer(20), app.identity: peer(10)})
            await app.gate.refresh()
            seen_alive_s = app.gate.own_alive_s
            assert seen_alive_s is not None
            # Just inside the grace (not at it exactly: (t + 60) - t in floats is 60 plus a rounding error
            # that depends on the host's monotonic clock, which failed this on a freshly booted machine).
            assert app.gate.heartbeat_problem(seen_alive_s + lifetime_s - 1e-3, grace_s=lifetime_s) is None
            # The own record expired (kopf's keep-alive task stopped): a problem once the grace is over.
            await put_peers(api, {"rival": peer(20), app.identity: peer(10, age_s=2 * lifetime_s)})
            await app.gate.refresh()
            assert app.gate.own_alive_s == seen_alive_s
            problem = app.gate.heartbeat_problem(seen_alive_s + lifetime_s + 1, grace_s=lifetime_s)
            assert problem is not None and "not alive" in problem
            app.gate.own_alive_s = time.monotonic() - lifetime_s - 1
            with pytest.raises(kopf.PermanentError, match="keep-alive missing"):
                probe(app)
            # A record removed by the other replica's kopf (dead peers are cleaned up) is just as missing.
            await put_peers(api, {"rival": peer(20)})
            await app.gate.refresh()
            with pytest.raises(kopf.PermanentError, match="keep-alive missing"):
                probe(app)
            # The keep-alive lands again: live.
            await put_peers(api, {"rival": peer(20), app.identity: peer(10)})
            await app.gate.refresh()
            probe(app)
            # An unreadable peering object says nothing about this replica: no verdict from it.
            app.gate.own_alive_s = time.monotonic() - lifetime_s - 1
            await api.delete(f"{PEERING_PATH}/batchpilot")
            await app.gate.refresh()
            assert not app.gate.active and "missing" in app.gate.reason  # required: paused, as kopf is
            probe(app)
        finally:
            await app.aclose()


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
