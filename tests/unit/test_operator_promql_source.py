"""PrometheusSource against an emulated Prometheus HTTP API: answers, NaN, slowness, absence."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
import requests
from aiohttp import web

from batchpilot_operator.io import promql
from batchpilot_operator.io.observe import MetricsUnavailable
from batchpilot_operator.io.promql import PrometheusSource
from batchpilot_operator.tuning.model_metrics import lookup, to_observations
from tests.integration.fake_admin import closed_port_url


class FakePrometheus:
    def __init__(self) -> None:
        self.mode = "ok"  # ok | nan | empty | slow | error
        self.queries: list[str] = []
        self.release = asyncio.Event()
        self.url = ""

    def vector(self, query: str) -> list[dict[str, Any]]:
        base = {"namespace": "ml", "model": "chat"}
        value = "NaN" if self.mode == "nan" else None
        if "histogram_quantile" in query:
            return [
                {"metric": {**base, "bp_quantile": q, "bp_series": "ttft"}, "value": [0, value or v]}
                for q, v in (("0.5", "0.1"), ("0.99", "0.2"), ("0.999", "0.25"))
            ] + [{"metric": {**base, "bp_series": "ttft_count"}, "value": [0, value or "10"]}]
        if "queue_depth" in query:
            return [{"metric": {**base, "bp_series": "queue_depth"}, "value": [0, value or "3"]}]
        return [{"metric": {**base, "bp_series": "requests"}, "value": [0, value or "2"]}]

    async def handle(self, request: web.Request) -> web.Response:
        query = request.query.get("query", "")
        self.queries.append(query)
        if self.mode == "slow":
            await self.release.wait()
        if self.mode == "error":
            return web.json_response({"status": "error", "error": "boom"}, status=500)
        result = [] if self.mode == "empty" else self.vector(query)
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})


@pytest.fixture
async def prom() -> AsyncIterator[FakePrometheus]:
    fake = FakePrometheus()
    app = web.Application()
    app.router.add_get("/api/v1/query", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    yield fake
    fake.release.set()
    await runner.cleanup()


async def test_three_grouped_queries_per_collection_and_the_gaps_hour_once_a_minute(prom: FakePrometheus) -> None:
    source = PrometheusSource(prom.url, scrape_interval_s=15, interval_s=15, timeout_s=5)
    metrics = await source.collect({("ml", "chat"): [], ("ml", "other"): []})
    assert len(prom.queries) == 4 and sum("increase(" in q for q in prom.queries) == 1
    await source.collect({("ml", "chat"): [], ("ml", "other"): []})  # the next interval: the three alone
    source.close(wait=True)
    assert len(prom.queries) == 7 and sum("increase(" in q for q in prom.queries) == 1
    assert all("[60s]" in q for q in prom.queries if "rate(" in q)
    obs = to_observations(lookup(metrics, "ml", "chat"), "ttft", 0.0)
    assert obs.p50_s == pytest.approx(0.1) and obs.queue_depth == 3 and obs.arrival_rate_per_s == 2


async def test_nan_answers_are_unknown_not_zero(prom: FakePrometheus) -> None:
    prom.mode = "nan"
    source = PrometheusSource(prom.url, timeout_s=5)
    metrics = await source.collect({})
    source.close(wait=True)
    obs = to_observations(lookup(metrics, "ml", "chat"), "ttft", 0.0)
    assert math.isnan(obs.p99_s) and math.isnan(obs.queue_depth) and math.isnan(obs.arrival_rate_per_s)


async def test_empty_answer_has_no_series(prom: FakePrometheus) -> None:
    prom.mode = "empty"
    source = PrometheusSource(prom.url, timeout_s=5)
    assert await source.collect({}) == {}
    source.close(wait=True)


async def test_slow_prometheus_times_out_without_blocking_the_loop(prom: FakePrometheus) -> None:
    prom.mode = "slow"
    source = PrometheusSource(prom.url, timeout_s=0.5)
    ticker_ran = asyncio.Event()

    async def ticker() -> None:
        await asyncio.sleep(0.05)
        ticker_ran.set()

    task = asyncio.create_task(ticker())
    with pytest.raises(MetricsUnavailable, match=r"did not answer within 0\.5 s"):
        await source.collect({})
    await task
    assert ticker_ran.is_set()
    prom.release.set()
    source.close(wait=True)


async def test_unreachable_and_failing_prometheus_name_the_cause(prom: FakePrometheus) -> None:
    source = PrometheusSource(closed_port_url(), timeout_s=2)
    with pytest.raises(MetricsUnavailable, match="failed"):
        await source.collect({})
    source.close(wait=True)
    prom.mode = "error"
    source = PrometheusSource(prom.url, timeout_s=2)
    with pytest.raises(MetricsUnavailable, match=r"500|boom"):
        await source.collect({})
    source.close(wait=True)


def test_a_read_timeout_wrapped_by_the_client_still_reads_as_too_slow() -> None:
    """Under load the query thread's own read timeout can fire before the event loop's; requests then
    raises a ConnectionError around urllib3's MaxRetryError(ReadTimeoutError)."""
    from urllib3.exceptions import MaxRetryError, NewConnectionError, ReadTimeoutError

    read_timeout = ReadTimeoutError(None, "/api/v1/query", "Read timed out.")  # type: ignore[arg-type]
    wrapped = requests.ConnectionError(MaxRetryError(None, "/api/v1/query", read_timeout))  # type: ignore[arg-type]
    refused = requests.ConnectionError(
        MaxRetryError(None, "/api/v1/query", NewConnectionError(None, "refused"))  # type: ignore[arg-type]
    )
    assert promql.timed_out(wrapped)
    assert promql.timed_out(requests.ReadTimeout("Read timed out."))
    assert not promql.timed_out(refused)
    assert not promql.timed_out(ValueError("boom"))
