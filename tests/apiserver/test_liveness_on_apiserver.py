"""Liveness on the test control plane (a real kube-apiserver): a watch that misses changes and a stuck loop make
the probe fail; a standby skips the watch check but must keep its keep-alive landing.

The operator runs in-process (:class:`OperatorApp`, signed in as the admin, watching one namespace of the test's
own; kopf itself is not started), its watch check and its peering gate calling the real server: the check lists
BatchProfiles and compares their resourceVersions (the server's) with the ones its watch delivered (set by the
test); the gate reads the namespace's KopfPeering, whose records (kopf's keep-alives) the test writes.

A watch that the server silences while it stays open is kmock's to inject
(tests/integration/test_operator_liveness.py): a real server does not do that on demand.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import kopf
import pytest

from batchpilot_operator import API_VERSION, PLURAL
from batchpilot_operator.frontends.kopf_app import OperatorApp, RunOptions
from batchpilot_operator.io.kube import KubeConfig, load_kube_config
from tests.support.control_plane import ControlPlane
from tests.support.factories import make_manifest, make_spec_dict

pytestmark = [pytest.mark.timeout(120)]

SPEC = make_spec_dict(tuning=None)


@dataclass
class Server:
    """The control plane as this test's admin sees it: a namespace of its own, an HTTP client, a kube config."""

    namespace: str
    api: httpx.AsyncClient
    config: KubeConfig

    @property
    def profiles(self) -> str:
        return f"/apis/{API_VERSION}/namespaces/{self.namespace}/{PLURAL}"

    @property
    def peerings(self) -> str:
        return f"/apis/kopf.dev/v1/namespaces/{self.namespace}/kopfpeerings"

    def app(self, **options: Any) -> OperatorApp:
        """The operator on this namespace only, with its clock started (no kopf, no loop)."""
        app = OperatorApp(
            RunOptions(metrics_port=0, liveness=None, namespaces=[self.namespace], **options), self.config
        )
        app.controller.start_clock()
        return app


@pytest.fixture(scope="module")
def crds(control_plane: ControlPlane) -> ControlPlane:
    """The BatchProfile and KopfPeering CRDs, installed once for the module."""
    control_plane.install_crd()
    control_plane.install_kopf_peering_crd()
    return control_plane


@pytest.fixture
async def server(crds: ControlPlane) -> AsyncIterator[Server]:
    control_plane = crds
    namespace = control_plane.namespace("liveness")
    async with control_plane.async_client() as api:
        yield Server(namespace, api, load_kube_config(control_plane.kubeconfig))


def probe(app: OperatorApp) -> Any:
    """Call the registered liveness probe the way kopf's health endpoint does."""
    handlers = app.registry._activities.get_all_handlers()
    (loop_probe,) = [h for h in handlers if h.id == "loop"]
    return loop_probe.fn()


async def create_profile(server: Server, name: str) -> str:
    """A profile of this namespace, created on the server; its resourceVersion."""
    response = await server.api.post(server.profiles, json=make_manifest(SPEC, name=name, namespace=server.namespace))
    assert response.status_code == 201, response.text
    return str(response.json()["metadata"]["resourceVersion"])


async def test_watch_that_misses_changes_fails_liveness_until_it_catches_up(server: Server) -> None:
    version = await create_profile(server, "chat")
    key = f"{server.namespace}/chat"
    app = server.app()
    try:
        # The watch delivered this version: healthy.
        app.seen_versions[key] = version
        await app._check_watch()
        assert app.watch_stuck is None
        probe(app)
        # A change the watch never delivers: one check is a suspicion (events may be in flight) ...
        response = await server.api.patch(f"{server.profiles}/chat", json={"spec": {"slo": {"p99Ms": 400}}},
                                          headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json()["metadata"]["resourceVersion"] != version
        await app._check_watch()
        assert app.watch_stuck is None
        # ... the same gap on the next check is a dead watch.
        await app._check_watch()
        assert app.watch_stuck is not None and key in app.watch_stuck
        with pytest.raises(kopf.PermanentError, match="watch stuck"):
            probe(app)
        # The watch catches up (kopf reconnected): healthy again.
        listed = (await server.api.get(server.profiles)).json()
        app.seen_versions[key] = listed["items"][0]["metadata"]["resourceVersion"]
        await app._check_watch()
        probe(app)
    finally:
        await app.aclose()


async def test_stuck_loop_fails_liveness(server: Server) -> None:
    app = server.app(stuck_after_s=0.0)
    try:
        app.controller.last_tick_finished_s = -math.inf
        with pytest.raises(kopf.PermanentError, match="loop stuck"):
            probe(app)
        await app.controller.tick()  # a tick finishing heals it (with a sane limit)
        app.controller.settings = app.controller.settings.__class__(stuck_after_s=60.0)
        probe(app)
    finally:
        await app.aclose()


# ---- peering: a standby has no watch to check, but a keep-alive to keep ------------------------------------------


def peer(priority: int, *, age_s: float = 0.0, lifetime_s: int = 60) -> dict[str, Any]:
    lastseen = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=age_s)
    return {"priority": priority, "lifetime": lifetime_s, "lastseen": lastseen.isoformat()}


async def put_peers(server: Server, peers: dict[str, Any]) -> None:
    """Replace the namespace's peering object and its records (kopf's keep-alives, written by hand)."""
    await delete_peering(server)
    body = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "batchpilot"}, "status": peers}
    response = await server.api.post(server.peerings, json=body)
    assert response.status_code == 201, response.text


async def delete_peering(server: Server) -> None:
    response = await server.api.delete(f"{server.peerings}/batchpilot")
    assert response.status_code in (200, 404), response.text


def standby_app(server: Server) -> OperatorApp:
    app = server.app(peering="required", priority=10, watch_check_s=0.0)
    app.gate.settle_s = 0.0
    return app


def watch_checks(app: OperatorApp, outcome: str) -> float:
    return app.metrics.registry.get_sample_value("batchpilot_operator_watch_checks_total", {"outcome": outcome}) or 0.0


async def test_standby_skips_the_watch_check_and_checks_it_again_once_active(server: Server) -> None:
    await create_profile(server, "chat")
    app = standby_app(server)
    try:
        await put_peers(server, {"rival": peer(20), app.identity: peer(10)})
        assert not await app.gate.refresh()
        # Paused: kopf closed the watch, so nothing was delivered; no check counts that against the standby.
        for _ in range(3):
            await app._watch_step()
        assert app.watch_stuck is None and watch_checks(app, "standby") == 3
        assert probe(app).startswith("standby (paused in favour of rival")
        # The rival's record expires: this replica is active; its first step only restarts the period ...
        await put_peers(server, {"rival": peer(20, age_s=120), app.identity: peer(10)})
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
        await put_peers(server, {"rival": peer(30), app.identity: peer(10)})
        assert not await app.gate.refresh()
        await app._watch_step()
        assert app.watch_stuck is None
        probe(app)
    finally:
        await app.aclose()


async def test_standby_whose_keepalive_stops_landing_fails_liveness(server: Server) -> None:
    app = standby_app(server)
    lifetime_s = app.options.peering_lifetime_s
    try:
        await put_peers(server, {"rival": peer(20), app.identity: peer(10)})
        await app.gate.refresh()
        seen_alive_s = app.gate.own_alive_s
        assert seen_alive_s is not None
        # Just inside the grace (not at it exactly: (t + 60) - t in floats is 60 plus a rounding error
        # that depends on the host's monotonic clock, which failed this on a freshly booted machine).
        assert app.gate.heartbeat_problem(seen_alive_s + lifetime_s - 1e-3, grace_s=lifetime_s) is None
        # The own record expired (kopf's keep-alive task stopped): a problem once the grace is over.
        await put_peers(server, {"rival": peer(20), app.identity: peer(10, age_s=2 * lifetime_s)})
        await app.gate.refresh()
        assert app.gate.own_alive_s == seen_alive_s
        problem = app.gate.heartbeat_problem(seen_alive_s + lifetime_s + 1, grace_s=lifetime_s)
        assert problem is not None and "not alive" in problem
        app.gate.own_alive_s = time.monotonic() - lifetime_s - 1
        with pytest.raises(kopf.PermanentError, match="keep-alive missing"):
            probe(app)
        # A record removed by the other replica's kopf (dead peers are cleaned up) is just as missing.
        await put_peers(server, {"rival": peer(20)})
        await app.gate.refresh()
        with pytest.raises(kopf.PermanentError, match="keep-alive missing"):
            probe(app)
        # The keep-alive lands again: live.
        await put_peers(server, {"rival": peer(20), app.identity: peer(10)})
        await app.gate.refresh()
        probe(app)
        # An unreadable peering object says nothing about this replica: no verdict from it.
        app.gate.own_alive_s = time.monotonic() - lifetime_s - 1
        await delete_peering(server)
        await app.gate.refresh()
        assert not app.gate.active and "missing" in app.gate.reason  # required: paused, as kopf is
        probe(app)
    finally:
        await app.aclose()
