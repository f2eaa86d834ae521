"""Liveness: a silently dead BatchProfile watch and a stuck loop make the probe fail."""

from __future__ import annotations

import math

import httpx
import kopf
import pytest

from batchpilot_operator.kopf_app import OperatorApp, RunOptions
from batchpilot_operator.kube import KubeConfig
from tests.integration.kmock_cluster import profile_body, running_cluster

SPEC = {
    "model": "chat",
    "selector": {"matchLabels": {"app": "chat"}},
    "window": {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 40},
    "slo": {"p99Ms": 500},
}


def probe(app: OperatorApp) -> None:
    """Call the registered liveness probe the way kopf's health endpoint does."""
    handlers = app.registry._activities.get_all_handlers()
    (loop_probe,) = [h for h in handlers if h.id == "loop"]
    loop_probe.fn()


async def test_watch_that_misses_changes_fails_liveness_until_it_catches_up() -> None:
    async with running_cluster() as (_cluster, url), httpx.AsyncClient(base_url=url) as api:
        response = await api.post("/apis/batchpilot.dev/v1alpha1/namespaces/ml/batchprofiles",
                                  json=profile_body("ml", "chat", SPEC))  # fmt: skip
        version = response.json()["metadata"]["resourceVersion"]
        app = OperatorApp(RunOptions(metrics_port=0, liveness=None), KubeConfig(server=url))
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
        app = OperatorApp(RunOptions(metrics_port=0, liveness=None, stuck_after_s=0.0), KubeConfig(server=url))
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
