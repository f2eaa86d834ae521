"""The gate's HTTP/1.1 client against raw loopback servers: framing, keep-alive, and which failures
may be sent again."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from batchpilot_runtime.gate import h1client
from batchpilot_runtime.gate.h1client import Origin, Response, SlotClient, UpstreamClosed, UpstreamError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving(handler: Handler, clock: Callable[[], float] | None = None) -> AsyncIterator[SlotClient]:
    """A raw server on loopback and a slot client for it (base path ``/base``)."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    origin = Origin.parse(f"http://127.0.0.1:{port}/base")
    client = SlotClient(origin, connect_timeout_s=5.0) if clock is None else SlotClient(origin, 5.0, clock=clock)
    try:
        yield client
    finally:
        client.close()
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader, heads: list[bytes]) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    heads.append(head)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length"))
    return await reader.readexactly(length)


def answering(connections: list[int], *answers: bytes, repeat: bool = False) -> Handler:
    """A handler that counts its connections and answers one connection's requests with ``answers`` in
    turn (the last one again and again with ``repeat``), ending the connection when they run out or
    the client closes it."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        for index in itertools.count():
            if index >= len(answers) and not repeat:
                return
            try:
                await read_request(reader, [])
            except asyncio.IncompleteReadError:
                return
            writer.write(answers[min(index, len(answers) - 1)])
            await writer.drain()

    return handler


async def body_of(response: Response) -> list[bytes]:
    return [chunk async for chunk in response.aiter_raw()]


async def test_a_chunked_answer_comes_chunk_for_chunk_and_the_connection_is_kept() -> None:
    heads: list[bytes] = []
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        for _ in range(2):
            body = await read_request(reader, heads)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for event in (b"data: 1\n\n", b"data: " + body + b"\n\n"):
                writer.write(f"{len(event):x};ext=1\r\n".encode() + event + b"\r\n")
                await writer.drain()
            writer.write(b"0\r\nx-trailer: t\r\n\r\n")
            await writer.drain()

    async with serving(handler) as client:
        for _ in range(2):
            response = await client.send("POST", "/v1/completions", [(b"x-batchpilot-lane", b"bulk")], b"hi")
            assert response.status_code == 200 and response.header(b"content-type") == b"text/event-stream"
            assert await body_of(response) == [b"data: 1\n\n", b"data: hi\n\n"]
            await response.aclose()
    assert len(connections) == 1  # the second request reused the first connection
    first = heads[0].decode()
    assert first.startswith("POST /base/v1/completions HTTP/1.1\r\n")
    assert "host: 127.0.0.1:" in first and "content-length: 2" in first and "accept-encoding: identity" in first
    assert "x-batchpilot-lane: bulk" in first


async def test_an_http10_answer_keeps_its_connection_only_when_it_says_keep_alive() -> None:
    connections: list[int] = []
    # keep-alive on a connection's first answer only
    handler = answering(
        connections,
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok",
    )
    async with serving(handler) as client:
        for _ in range(3):
            response = await client.send("POST", "/v1/completions", [], b"{}")
            assert await body_of(response) == [b"ok"]
    # The first answer kept its connection for the second request; the second did not say keep-alive.
    assert len(connections) == 2


@pytest.mark.parametrize("close", [True, False])
async def test_a_sized_or_close_delimited_answer_and_when_its_connection_is_reused(close: bool) -> None:
    connections: list[int] = []
    payload = b"x" * 200_000
    if close:  # no length: the body ends with the connection
        handler = answering(connections, b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + payload)
    else:
        sized = f"HTTP/1.1 200 OK\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload
        handler = answering(connections, sized, repeat=True)

    async with serving(handler) as client:
        for _ in range(2):
            response = await client.send("POST", "/v1/completions", [], b"{}")
            assert b"".join(await body_of(response)) == payload
    assert len(connections) == (2 if close else 1)


async def test_closing_an_answer_before_its_end_closes_the_connection_so_the_engine_sees_the_hang_up() -> None:
    hung_up = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, [])
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        if await reader.read(1) == b"":
            hung_up.set()

    async with serving(handler) as client:
        response = await client.send("POST", "/v1/completions", [], b"{}")
        async for chunk in response.aiter_raw():
            assert chunk == b"hello"
            break
        await response.aclose()
        await asyncio.wait_for(hung_up.wait(), 10)
        assert client._idle is None  # not kept for the next request


async def test_an_interim_answer_is_skipped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, [])
        writer.write(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 429 Too Many\r\nretry-after: 3\r\ncontent-length: 2\r\n\r\n{}"
        )
        await writer.drain()

    async with serving(handler) as client:
        response = await client.send("POST", "/v1/completions", [], b"{}")
        assert (response.status_code, response.header(b"retry-after"), await body_of(response)) == (429, b"3", [b"{}"])


async def test_a_connection_closed_before_any_answer_may_be_sent_again_other_failures_not() -> None:
    async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, [])

    async with serving(closes) as client:
        with pytest.raises(UpstreamClosed, match="closed before an answer"):
            await client.send("POST", "/v1/completions", [], b"{}")

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, [])
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async with serving(not_http) as client:
        with pytest.raises(UpstreamError, match="not HTTP") as caught:
            await client.send("POST", "/v1/completions", [], b"{}")
        assert not isinstance(caught.value, UpstreamClosed)

    async def breaks_off(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, [])
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel")
        await writer.drain()

    async with serving(breaks_off) as client:
        response = await client.send("POST", "/v1/completions", [], b"{}")
        with pytest.raises(UpstreamError, match="broke off"):
            await body_of(response)

    server = await asyncio.start_server(closes, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    refused = SlotClient(Origin.parse(f"http://127.0.0.1:{port}"), connect_timeout_s=5.0)
    with pytest.raises(UpstreamError, match="cannot connect") as caught:
        await refused.send("POST", "/v1/completions", [], b"{}")
    assert not isinstance(caught.value, UpstreamClosed)  # the engine is down: no second try


async def test_an_idle_connection_past_its_expiry_is_not_reused() -> None:
    connections: list[int] = []
    handler = answering(connections, b"HTTP/1.1 204 No Content\r\n\r\n", repeat=True)

    now = [1000.0]
    async with serving(handler, clock=lambda: now[0]) as client:
        for gap_s in (0.0, h1client.KEEPALIVE_EXPIRY_S - 0.5, h1client.KEEPALIVE_EXPIRY_S + 0.5):
            now[0] += gap_s
            response = await client.send("POST", "/v1/completions", [], b"{}")
            assert response.status_code == 204 and await body_of(response) == []
    assert len(connections) == 2  # the third request came after the expiry


@pytest.mark.parametrize(
    ("url", "origin", "host_header"),
    [
        ("http://127.0.0.1:8000", Origin("http", "127.0.0.1", 8000, ""), "127.0.0.1:8000"),
        ("https://engine.example/v1/", Origin("https", "engine.example", 443, "/v1"), "engine.example"),
        ("http://[fd00::1]:80/", Origin("http", "fd00::1", 80, ""), "[fd00::1]"),
    ],
)
def test_origin_of_an_upstream_url(url: str, origin: Origin, host_header: str) -> None:
    assert Origin.parse(url) == origin and origin.host_header == host_header


@pytest.mark.parametrize("url", ["ftp://engine", "http://", "engine:8000"])
def test_an_upstream_url_that_is_not_http_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        Origin.parse(url)
