"""Overload and disconnects: a burst of 3x the queue is answered 200 or 429 and nothing is lost;
memory returns to its level before the burst; clients that hang up free their KV."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_runtime.contract import metric_names as mn
from tests.integration.runtime_process import ThreadRuntime, rss_bytes, runtime_thread, wait_until

MAX_QUEUE = 8
BURST = 3 * MAX_QUEUE
BURST_MAX_TOKENS = 24
# Memory may settle a little higher after the first bursts (allocator arenas, caches); a leak of
# the burst's requests, KV or event queues would show as growth on every burst.
RSS_TOLERANCE_BYTES = 48 * 1024 * 1024


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    with runtime_thread(
        tmp_path_factory.mktemp("overload"),
        max_queue=MAX_QUEUE,
        target_batch_size=2,
        hard_cap=2,
        max_wait_ms=0,
        kv_cache_tokens=4096,
    ) as started:
        yield started


def counters(serve_url: str) -> dict[str, float]:
    text = httpx.get(f"{serve_url}/metrics", timeout=30.0).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == mn.REQUESTS_TOTAL:
                values[sample.labels["outcome"]] = sample.value
            elif sample.name in (mn.KV_CACHE_USAGE_RATIO, mn.RUNNING_SEQUENCES, mn.QUEUE_DEPTH):
                values[sample.name] = sample.value
    return values


def engine_idle(runtime: ThreadRuntime) -> bool:
    ctx = runtime.ctx
    load = ctx.loaded.engine.load()
    return (load.queue_depth, load.running, load.kv_usage_ratio, ctx.inflight_requests) == (0, 0, 0.0, 0)


async def burst(serve_url: str) -> list[httpx.Response]:
    body = {"prompt": [65, 66, 67, 68], "max_tokens": BURST_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
    async with httpx.AsyncClient(base_url=serve_url, timeout=120.0, limits=limits) as client:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(BURST))))


@pytest.mark.slow
async def test_burst_of_three_times_the_queue(runtime: ThreadRuntime) -> None:
    await burst(runtime.serve_url)  # warm-up: pools, caches and arenas reach their working size
    await asyncio.to_thread(wait_until, lambda: engine_idle(runtime), 60.0, "the engine to go idle")
    gc.collect()
    rss_before = rss_bytes(os.getpid())
    before = counters(runtime.serve_url)
    accepted = rejected = 0
    for _ in range(3):
        responses = await burst(runtime.serve_url)
        for response in responses:
            if response.status_code == 200:
                accepted += 1
                choice = response.json()["choices"][0]
                assert choice["finish_reason"] == "length"
                assert response.json()["usage"]["completion_tokens"] == BURST_MAX_TOKENS
            else:
                assert response.status_code == 429, response.text
                rejected += 1
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["error"]["type"] == "rate_limit_exceeded"
    # Every request got an explicit answer; the queue bounded what was accepted.
    assert accepted + rejected == 3 * BURST
    assert accepted >= 3 and rejected >= 3
    await asyncio.to_thread(wait_until, lambda: engine_idle(runtime), 60.0, "the engine to go idle")
    after = counters(runtime.serve_url)
    assert after["completed"] - before["completed"] == accepted
    assert after["rejected"] - before["rejected"] == rejected
    assert after["cancelled"] == before["cancelled"]
    assert after["error"] == before["error"]
    assert runtime.ctx.loaded.engine.engine.live_request_ids == []
    gc.collect()
    assert rss_bytes(os.getpid()) - rss_before < RSS_TOLERANCE_BYTES
    ready = await asyncio.to_thread(httpx.get, f"{runtime.serve_url}/readyz", timeout=30.0)
    assert ready.status_code == 200


async def test_clients_that_hang_up_free_their_kv(runtime: ThreadRuntime) -> None:
    cancelled_before = counters(runtime.serve_url)["cancelled"]
    body = {"prompt": [70] * 32, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=runtime.serve_url, timeout=120.0) as client:
        # Two streams run (the cap is 2) and two wait in the queue; all four hang up.
        streams = [client.stream("POST", "/v1/completions", json=body) for _ in range(4)]
        responses = [await s.__aenter__() for s in streams]
        assert [r.status_code for r in responses] == [200] * 4
        for response in responses[:2]:
            lines = response.aiter_lines()
            seen = 0
            while seen < 2:
                if (await lines.__anext__()).startswith("data:"):
                    seen += 1
        # The load snapshot is published between steps: wait for one that shows both running.
        load = await asyncio.to_thread(
            wait_until, lambda: (ld := runtime.ctx.loaded.engine.load()).running == 2 and ld, 30.0, "two running"
        )
        assert load.kv_usage_ratio > 0
        for stream in reversed(streams):
            await stream.__aexit__(None, None, None)
        # A non-streaming client that gives up (its timeout) hangs up too.
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json={**body, "stream": False}, timeout=httpx.Timeout(120.0, read=0.5))
    await asyncio.to_thread(wait_until, lambda: engine_idle(runtime), 60.0, "KV usage to return to 0")
    after = await asyncio.to_thread(
        wait_until,
        lambda: (c := counters(runtime.serve_url))["cancelled"] - cancelled_before == 5 and c,
        30.0,
        "five cancellations in /metrics",
    )
    assert after[mn.KV_CACHE_USAGE_RATIO] == 0.0
    assert after[mn.RUNNING_SEQUENCES] == 0.0
    assert after[mn.QUEUE_DEPTH] == 0.0
