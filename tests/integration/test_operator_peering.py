"""Two replicas with kopf peering against the emulator: one active at a time, the other takes over."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.integration.fake_admin import ROOT_POD, FakeAdminServer
from tests.integration.kmock_cluster import (
    OperatorProcess,
    free_port,
    pod_body,
    profile_body,
    running_cluster,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def ticks(metrics_text: str) -> float:
    match = re.search(r"^batchpilot_operator_tick_seconds_count ([0-9.e+]+)$", metrics_text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
async def pod() -> AsyncIterator[tuple[FakeAdminServer, int]]:
    port = free_port("127.0.0.4")
    fake = FakeAdminServer(0)
    fake.add_pod(ROOT_POD, model="chat", token="t")
    await fake.start(port, host="127.0.0.4")
    yield fake, port
    await fake.stop()


async def test_only_the_highest_priority_replica_is_active(pod: tuple[FakeAdminServer, int], tmp_path: Path) -> None:
    fake, port = pod
    token_file = tmp_path / "token"
    token_file.write_text("t")
    async with running_cluster() as (_cluster, url), httpx.AsyncClient(base_url=url, timeout=10) as api:
        peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "batchpilot"}}
        assert (await api.post("/apis/kopf.dev/v1/clusterkopfpeerings", json=peering)).status_code == 200
        body = pod_body("ml", "chat-0", {"app": "chat"}, "127.0.0.4", ready=True)
        assert (await api.post("/api/v1/namespaces/ml/pods", json=body)).status_code == 200
        spec = {
            "model": "chat",
            "selector": {"matchLabels": {"app": "chat"}},
            "window": {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 40},
            "slo": {"p99Ms": 500},
            "runtime": {"adminPort": port},
        }
        profile = profile_body("ml", "chat", spec)
        assert (await api.post("/apis/batchpilot.dev/v1alpha1/namespaces/ml/batchprofiles", json=profile)).is_success
        # A peering lifetime well above a starved machine's scheduling hiccups: with 4 s the active
        # replica's keepalive could come late on a loaded host and the low one would take over.
        common = ["-A", "--admin-token-file", str(token_file), "--admin-token-namespace", "ml",
                  "--interval-override", "1", "--tick", "0.3", "--peering", "auto", "--peering-lifetime", "12"]  # fmt: skip
        high = OperatorProcess(tmp_path / "high", url, *common, "--priority", "20", name="high")
        low: OperatorProcess | None = None
        try:
            await wait_for(lambda: _ticks(high), 60, "the high replica ticking")
            await wait_for(lambda: fake.pods[ROOT_POD].state.window.generation >= 1, 60, "the window pushed")
            # A second replica with a lower priority joins (as in a rolling update): it must stay paused.
            low = OperatorProcess(tmp_path / "low", url, *common, "--priority", "10", name="low")
            await wait_for(lambda: "Pausing operations in favour of" in low.log_text(), 60, "the low one to pause")
            high_ticks = await _ticks(high)
            await wait_for(lambda: _ticks_above(high, high_ticks + 2), 30, "the high replica still ticking")
            assert ticks(await low.metrics_text()) == 0, low.log_text()[-3000:]

            # The active replica crashes: the other one takes over once its peer record expires (4 s here).
            high.kill()
            await wait_for(lambda: _ticks(low), 60, "the low replica taking over")  # type: ignore[arg-type]
            puts = fake.pods[ROOT_POD].puts
            fake.pods[ROOT_POD].restart()
            await wait_for(lambda: fake.pods[ROOT_POD].puts > puts, 30, "the new active replica healing a pod")
        finally:
            high.stop()
            if low is not None:
                low.stop()


async def _ticks(operator: OperatorProcess) -> float:
    try:
        return ticks(await operator.metrics_text())
    except httpx.HTTPError:
        return 0.0


async def _ticks_above(operator: OperatorProcess, threshold: float) -> bool:
    return await _ticks(operator) > threshold
