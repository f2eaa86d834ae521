"""The push client against emulated admin endpoints: level-triggered sync and every failure path,
bad pods included (a body that never ends, a huge one, garbage, a URL httpx refuses, an IPv6 address)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from batchpilot_operator.io.outbound import base_url
from batchpilot_operator.io.push import (
    CONFLICT,
    ERROR,
    OK,
    REFUSED,
    UNAUTHORIZED,
    AdminClient,
    PodTarget,
    PushFailed,
    clamp_to_capacity,
)
from tests.integration.chaos_pod import HUGE_BYTES, ChaosPod, ipv6_loopback_available
from tests.integration.fake_admin import ROOT_POD, FakeAdminServer, closed_port_url
from tests.support.factories import make_window
from tests.support.operator_process import wait_for


async def no_sleep(_: float) -> None:
    await asyncio.sleep(0)


@pytest.fixture
async def server() -> AsyncIterator[FakeAdminServer]:
    async with FakeAdminServer(3, max_hard_cap=64) as fake:
        yield fake


@pytest.fixture
async def client() -> AsyncIterator[AdminClient]:
    admin = AdminClient(timeout_s=1.0, retries=3, backoff_s=0.01, sleep=no_sleep)
    yield admin
    await admin.aclose()


def target(server: FakeAdminServer, pod: str = "0", token: str | None = "secret") -> PodTarget:
    return PodTarget(f"ns/{pod}", server.admin_url(pod), token)


async def test_pod_behind_is_pushed_and_pod_in_sync_is_not(server: FakeAdminServer, client: AdminClient) -> None:
    result = await client.sync(target(server), make_window(generation=1))
    assert result.outcome == OK and result.pushed
    assert server.pods["0"].state.window == make_window(generation=1)
    again = await client.sync(target(server), make_window(generation=1))
    assert again.outcome == OK and not again.pushed
    assert server.pods["0"].puts == 1


async def test_restarted_pod_is_pushed_again(server: FakeAdminServer, client: AdminClient) -> None:
    await client.sync(target(server), make_window(generation=3))
    server.pods["0"].restart()
    result = await client.sync(target(server), make_window(generation=3))
    assert result.pushed and server.pods["0"].state.window.generation == 3


async def test_5xx_is_retried_with_backoff(server: FakeAdminServer) -> None:
    delays: list[float] = []

    async def record(delay: float) -> None:
        delays.append(delay)

    admin = AdminClient(timeout_s=1.0, retries=3, backoff_s=0.1, sleep=record)
    server.pods["0"].fail_next = 2
    result = await admin.sync(target(server), make_window(generation=1))
    await admin.aclose()
    assert result.outcome == OK and result.pushed
    assert len(delays) == 2 and delays[1] > delays[0] * 0.9  # exponential, with jitter in [0.5, 1]


async def test_5xx_gives_up_after_bounded_attempts(server: FakeAdminServer, client: AdminClient) -> None:
    server.pods["0"].fail_next = 100
    result = await client.sync(target(server), make_window(generation=1))
    assert result.outcome == ERROR and "503" in result.detail and result.attempts == 3


async def test_connection_refused_is_an_error_not_an_exception(client: AdminClient) -> None:
    result = await client.sync(PodTarget("ns/gone", closed_port_url(), "secret"), make_window(generation=1))
    assert result.outcome == ERROR and result.attempts == 3


async def test_timeout_is_an_error(server: FakeAdminServer) -> None:
    admin = AdminClient(timeout_s=0.2, retries=1, sleep=no_sleep)
    server.pods["0"].delay_s = 2.0
    result = await admin.sync(target(server), make_window(generation=1))
    await admin.aclose()
    assert result.outcome == ERROR and "timed out" in result.detail


async def test_a_slow_pod_does_not_block_the_others(server: FakeAdminServer) -> None:
    admin = AdminClient(timeout_s=0.5, retries=1, sleep=no_sleep)
    server.pods["0"].delay_s = 5.0
    results = await admin.sync_all([(target(server, p), make_window(generation=1), None) for p in ("0", "1", "2")])
    await admin.aclose()
    assert [r.outcome for r in results] == [ERROR, OK, OK]


async def test_wrong_token_is_unauthorized(server: FakeAdminServer, client: AdminClient) -> None:
    result = await client.sync(target(server, token="wrong"), make_window(generation=1))
    assert result.outcome == UNAUTHORIZED and result.attempts == 1


async def test_reads_carry_the_token_as_writes_do(server: FakeAdminServer, client: AdminClient) -> None:
    await client.get_state(target(server))
    await client.sync(target(server), make_window(generation=1))  # a GET, then a PUT
    assert server.pods["0"].authorizations == ["Bearer secret"] * 3
    assert (server.pods["0"].gets, server.pods["0"].puts) == (2, 1)
    with pytest.raises(PushFailed) as caught:
        await client.get_state(target(server, token=None))
    assert caught.value.outcome == UNAUTHORIZED and server.pods["0"].authorizations[-1] is None


async def test_newer_generation_on_pod_is_a_conflict(server: FakeAdminServer, client: AdminClient) -> None:
    await client.sync(target(server), make_window(generation=7))
    result = await client.sync(target(server), make_window(generation=5))
    assert result.outcome == CONFLICT and result.state is not None and result.state.window.generation == 7


async def test_422_cap_over_capacity_is_clamped_to_the_reported_capacity(
    server: FakeAdminServer, client: AdminClient
) -> None:
    result = await client.sync(target(server), make_window(generation=2, cap=128, target=100))
    assert result.outcome == OK and result.clamped is not None
    in_force = server.pods["0"].state.window
    assert (in_force.hard_cap, in_force.target_batch_size, in_force.generation) == (64, 64, 2)


async def test_422_with_nothing_to_clamp_is_refused_without_retry(server: FakeAdminServer, client: AdminClient) -> None:
    server.pods["0"].refuse_all = "maxWaitMs too large for this pod"
    result = await client.sync(target(server), make_window(generation=2, cap=16))
    assert result.outcome == REFUSED and "maxWaitMs" in result.detail
    assert result.attempts == 2  # one GET, one PUT: a refusal is final


def test_clamp_to_capacity_keeps_target_within_cap() -> None:
    from batchpilot_runtime.contract.admin_api import PodCapacity

    capacity = PodCapacity(kv_cache_tokens=1, kv_block_size=1, max_hard_cap=10, max_model_len=1)
    clamped = clamp_to_capacity(make_window(generation=1, cap=32, target=16), capacity)
    assert clamped is not None and (clamped.hard_cap, clamped.target_batch_size) == (10, 10)
    assert clamp_to_capacity(make_window(generation=1, cap=8, target=4), capacity) is None


async def test_refusal_after_clamp_is_reported_as_refused(server: FakeAdminServer, client: AdminClient) -> None:
    server.pods["0"].refuse_all = "hardCap too large for the KV cache"
    result = await client.sync(target(server), make_window(generation=2, cap=128))
    assert result.outcome == REFUSED and "clamped to capacity and refused again" in result.detail
    assert result.attempts == 3  # GET, PUT, clamped PUT; never more
    assert server.pods["0"].puts == 0


# ---- pods that answer badly: every failure is the pod's PushResult, within the deadline and the cap ----------


@pytest.fixture(params=["aiohttp", "httpcore"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def chaos_client(transport: str, *, timeout_s: float = 0.3, retries: int = 2) -> AdminClient:
    """The operator's client (aiohttp transport), or one on httpx's own transport: the deadline is the client's."""
    client = httpx.AsyncClient(timeout=timeout_s) if transport == "httpcore" else None
    return AdminClient(timeout_s=timeout_s, retries=retries, backoff_s=0.01, sleep=no_sleep, client=client)


@pytest.fixture
async def chaos() -> AsyncIterator[ChaosPod]:
    pod = ChaosPod()
    await pod.start()
    yield pod
    await pod.stop()


async def test_a_body_that_never_ends_is_cut_at_the_deadline(chaos: ChaosPod, transport: str) -> None:
    await chaos.set_mode("endless")
    admin = chaos_client(transport)
    result = await admin.sync(PodTarget("ns/drip", chaos.url), make_window(generation=1))
    await admin.aclose()
    assert result.outcome == ERROR and "timed out: no complete answer within 0.3 s" in result.detail
    assert result.attempts == 1  # not retried: the pod had its whole deadline; the next tick tries again
    await wait_for(lambda: chaos.hung_up["endless"] == 1, 10, "the client to hang up the dripped answer")


async def test_a_huge_body_is_not_read_past_the_cap_nor_retried(chaos: ChaosPod, transport: str) -> None:
    await chaos.set_mode("huge")
    admin = chaos_client(transport, timeout_s=10.0)
    result = await admin.sync(PodTarget("ns/huge", chaos.url), make_window(generation=1))
    await admin.aclose()
    assert result.outcome == ERROR and "over the 1 MiB cap" in result.detail
    assert result.attempts == 1
    await wait_for(lambda: chaos.hung_up["huge"] == 1, 10, "the client to hang up")
    # Sent = read (<= the cap and one chunk) + what the kernel's socket buffers held when the client hung up.
    assert chaos.sent_bytes[0] < HUGE_BYTES // 4, chaos.sent_bytes


@pytest.mark.parametrize(
    ("mode", "detail"),
    [("invalid_json", "unreadable window state: Invalid JSON"), ("http500", "HTTP 500: boom (2 attempts)")],
)
async def test_garbage_and_5xx_are_errors_not_exceptions(chaos: ChaosPod, mode: str, detail: str) -> None:
    await chaos.set_mode(mode)
    admin = chaos_client("aiohttp")
    result = await admin.sync(PodTarget("ns/bad", chaos.url), make_window(generation=1))
    with pytest.raises(PushFailed, match=r"unreadable|HTTP 500"):
        await admin.get_state(PodTarget("ns/bad", chaos.url))
    await admin.aclose()
    assert result.outcome == ERROR and detail in result.detail


async def test_a_url_httpx_refuses_is_an_error_at_once(client: AdminClient) -> None:
    result = await client.sync(PodTarget("ns/v6", "http://fd00::1:8081"), make_window(generation=1))
    assert result.outcome == ERROR and "invalid URL" in result.detail and result.attempts == 1


@pytest.mark.skipif(not ipv6_loopback_available(), reason="this machine cannot listen on ::1")
async def test_a_pod_on_an_ipv6_address_is_pushed(client: AdminClient) -> None:
    fake = FakeAdminServer(0)
    fake.add_pod(ROOT_POD, token="secret")
    await fake.start(host="::1")
    try:
        port = int(fake.url.rsplit(":", 1)[1])
        result = await client.sync(PodTarget("ns/v6", base_url("::1", port), "secret"), make_window(generation=1))
    finally:
        await fake.stop()
    assert result.outcome == OK and result.pushed and fake.pods[ROOT_POD].state.window.generation == 1
