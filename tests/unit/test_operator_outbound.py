"""Outbound calls: URLs from pod addresses (IPv6 in brackets), bodies read under a cap, metric sources
that give up on a dripping or flooding endpoint at their deadline and cap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from batchpilot_operator.frontends.local import parse_runtime
from batchpilot_operator.io.observe import MetricsUnavailable
from batchpilot_operator.io.outbound import BodyTooLarge, base_url, host_port, read_capped
from batchpilot_operator.io.promql import PrometheusSource
from batchpilot_operator.io.scrape import ScrapeSource
from tests.integration.chaos_pod import HUGE_BYTES, ChaosPod
from tests.integration.fake_admin import FakeAdminServer
from tests.support.operator_process import wait_for


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("10.0.0.7", 8081, "10.0.0.7:8081"),
        ("fd00::1", 8081, "[fd00::1]:8081"),
        ("::1", 80, "[::1]:80"),
        ("2001:db8:0:0:0:0:0:7", 9, "[2001:db8:0:0:0:0:0:7]:9"),
        ("[fd00::1]", 8081, "[fd00::1]:8081"),  # already bracketed: not twice
        ("::ffff:10.0.0.7", 1, "[::ffff:10.0.0.7]:1"),  # IPv4-mapped is IPv6
        ("runtime.ml.svc", 8081, "runtime.ml.svc:8081"),
    ],
)
def test_host_port_brackets_ipv6_literals_only(host: str, port: int, expected: str) -> None:
    assert host_port(host, port) == expected


def test_base_url_is_a_url_httpx_accepts_for_an_ipv6_pod() -> None:
    url = httpx.URL(base_url("fd00:10:244::7", 8081) + "/admin/window")
    assert (url.host, url.port, url.path) == ("fd00:10:244::7", 8081, "/admin/window")
    assert base_url("fd00::1", 443, "https") == "https://[fd00::1]:443"


def test_local_runtime_with_an_unbracketed_ipv6_url_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"admin= is not a valid URL .*in brackets"):
        parse_runtime("model=m,url=http://[::1]:8000,admin=http://::1:8081")
    assert parse_runtime("model=m,url=http://[::1]:8000,admin=http://[::1]:8081").admin == "http://[::1]:8081"


class _Chunks(httpx.AsyncByteStream):
    """A body of ``count`` chunks of ``size`` bytes, counting how many were pulled."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size, self.pulled = count, size, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.count):
            self.pulled += 1
            yield b"x" * self.size


async def _streamed(stream: httpx.AsyncByteStream, headers: dict[str, str] | None = None) -> httpx.Response:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, headers=headers, stream=stream))
    client = httpx.AsyncClient(transport=transport)
    return await client.send(client.build_request("GET", "http://pod/metrics"), stream=True)


async def test_a_body_within_the_cap_is_read_whole() -> None:
    response = await _streamed(_Chunks(4, 1000))
    assert await read_capped(response, 4000) == b"x" * 4000


async def test_a_body_over_the_cap_stops_at_the_first_chunk_past_it() -> None:
    stream = _Chunks(1600, 64 * 1024)  # 100 MiB, chunked
    response = await _streamed(stream)
    with pytest.raises(BodyTooLarge, match=r"over the 1 MiB cap") as caught:
        await read_capped(response, 1 << 20)
    assert stream.pulled == 17 and caught.value.seen_bytes == 17 * 64 * 1024


async def test_a_declared_length_over_the_cap_is_refused_before_reading() -> None:
    stream = _Chunks(1, 10)
    response = await _streamed(stream, {"Content-Length": str(100 << 20)})
    with pytest.raises(BodyTooLarge):
        await read_capped(response, 1 << 20)
    assert stream.pulled == 0


# ---- the metric sources: a /metrics or a Prometheus that drips or floods costs the deadline and the cap -------


@pytest.fixture
async def chaos() -> AsyncIterator[ChaosPod]:
    pod = ChaosPod()
    await pod.start()
    yield pod
    await pod.stop()


async def test_scrape_leaves_out_a_dripping_or_huge_pod_and_keeps_the_healthy_one(chaos: ChaosPod) -> None:
    async with FakeAdminServer(1, model="a", token=None) as fake:
        fake.pods["0"].latency_s = 0.1
        source = ScrapeSource(rate_window_s=60, timeout_s=0.3, max_body_bytes=1 << 20)
        targets = {("", "a"): [f"{fake.url}/pods/0/metrics"], ("", "b"): [f"{chaos.url}/metrics"]}
        try:
            for mode in ("endless", "huge"):
                await chaos.set_mode(mode)
                metrics = await source.collect(targets)
                assert ("", "a") in metrics and ("", "b") not in metrics
            with pytest.raises(MetricsUnavailable, match=r"BodyTooLarge: answer body over the 1 MiB cap"):
                await source.collect({("", "b"): [f"{chaos.url}/metrics"]})
            await chaos.set_mode("endless")
            with pytest.raises(MetricsUnavailable, match=r"no complete answer within 0\.3 s"):
                await source.collect({("", "b"): [f"{chaos.url}/metrics"]})
        finally:
            await source.aclose()
    assert chaos.sent_bytes and max(chaos.sent_bytes) < HUGE_BYTES // 4


@pytest.mark.parametrize(("mode", "cause"), [("endless", r"did not answer within|not complete within"),
                                             ("huge", r"over the 1 MiB cap")])  # fmt: skip
async def test_prometheus_that_drips_or_floods_frees_its_query_threads(chaos: ChaosPod, mode: str, cause: str) -> None:
    await chaos.set_mode(mode)
    source = PrometheusSource(chaos.url, timeout_s=0.5, max_body_bytes=1 << 20)
    with pytest.raises(MetricsUnavailable, match=cause):
        await source.collect({})
    # Joins the query threads (off the loop, which serves the chaos pod): each one let go of its answer,
    # the three grouped queries' and the gaps' hour's.
    await asyncio.to_thread(source.close, True)
    await wait_for(lambda: chaos.hung_up[mode] == 4, 10, "the four query threads to hang up")
    assert all(sent < HUGE_BYTES // 4 for sent in chaos.sent_bytes)
