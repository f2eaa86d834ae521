"""The canary's per-pod query through a real Prometheus: two runtime-like pods of one model, one slow,
each pod's first-token P99 read back apart, by the same parser as the model-wide figures."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from batchpilot_operator.io.promql import PrometheusSource
from batchpilot_operator.tuning.model_metrics import to_observations
from tests.integration.fake_admin import render_metrics
from tests.integration.prometheus_process import ScrapeTarget, prometheus_binary, start_prometheus
from tests.support.engine_expositions import serve_exposition

pytestmark = [
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus is not installed (scripts/system-deps.sh)"),
    pytest.mark.timeout(120),
]


@contextmanager
def runtime_metrics(model: str, ttft_s: float) -> Iterator[str]:
    """A /metrics whose requests grow 50 a second, every one with this TTFT; yields host:port."""
    started = time.monotonic()
    with serve_exposition(
        lambda: render_metrics(model, ttft_s, int((time.monotonic() - started) * 50)).encode()
    ) as address:
        yield address


async def test_each_pods_p99_comes_back_apart_from_one_query(tmp_path: Path) -> None:
    with runtime_metrics("chat", 0.2) as fast, runtime_metrics("chat", 1.5) as slow:
        targets = [
            ScrapeTarget(fast, {"namespace": "ml", "pod": "chat-0"}),
            ScrapeTarget(slow, {"namespace": "ml", "pod": "chat-1"}),
        ]
        prometheus = start_prometheus(tmp_path / "prometheus", targets, scrape_interval_s=1.0)
        try:
            deadline = time.monotonic() + 60
            while len(prometheus.query("rate(batchpilot_requests_total[4s]) > 0")) < 2:
                assert time.monotonic() < deadline, "Prometheus never had a rate for both pods"
                await asyncio.sleep(0.5)
            source = PrometheusSource(prometheus.url, scrape_interval_s=1.0, interval_s=2.0)
            try:
                per_pod = await source.collect_pods({("ml", "chat"): {"chat-0": "", "chat-1": ""}})
                other_model = await source.collect_pods({("ml", "other"): {"other-0": ""}})
            finally:
                source.close(wait=True)
        finally:
            prometheus.stop()
    obs = {pod: to_observations(m, "ttft", 0.0) for pod, m in per_pod[("ml", "chat")].items()}
    assert sorted(obs) == ["chat-0", "chat-1"]
    assert 0.2 <= obs["chat-0"].p99_s <= 0.2 * 1.2  # within the bucket above the true value
    assert 1.5 <= obs["chat-1"].p99_s <= 1.5 * 1.2
    assert obs["chat-0"].samples > 20 and obs["chat-1"].samples > 20
    assert other_model == {}  # only the canary models are read
    assert source.queries_total == 2
