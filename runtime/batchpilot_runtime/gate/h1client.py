"""The gate's HTTP/1.1 client for admitted requests: one kept-alive connection per request slot.

Why not httpx here: on the hot path (one streamed chunk, passed on) httpx's layers (httpcore's
connection state, anyio's cancel scopes and stream wrappers, h11's event objects) took about two
thirds of the gate's CPU per chunk, measured with cProfile under ``tests/bench/bench_gate.py``; a
chunk here is two buffered reads of an ``asyncio.StreamReader``. The gate already bounds requests in
flight, so each slot holds at most one request at a time and needs no pool: its connection is
reused while the upstream keeps it alive and dropped after ``KEEPALIVE_EXPIRY_S`` idle.

What it speaks: a request with a ``Content-Length`` body; a response framed by chunked encoding, by
``Content-Length`` or by the connection's end; keep-alive unless either side says ``close``. A
response whose head never came (the engine closed a kept-alive connection as the request went out)
raises :class:`UpstreamClosed`, which the caller may send again once; a connection that cannot be
made raises :class:`UpstreamError` at once. Closing a response before its end closes its connection.

A client that hangs up is passed on by :meth:`SlotClient.hang_up`: the gate half-closes the request's
connection (its write side: the engine reads the end of the stream, which every HTTP server takes for
a client that has gone) and keeps reading, so that it learns when the engine has stopped the request:
the answer ends, or the engine closes the connection. A half-closed connection is never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

# Below the 5 s keep-alive of uvicorn (vLLM's and SGLang's server) and of most engines: the gate drops
# an idle connection before the engine does, rather than sending a request on one the engine is closing.
KEEPALIVE_EXPIRY_S = 2.0
MAX_HEAD_BYTES = 64 * 1024
READ_BYTES = 64 * 1024
_NO_BODY_STATUS = frozenset({204, 304})


class UpstreamError(Exception):
    """The upstream could not be reached or broke the exchange; the message names what happened."""


class UpstreamClosed(UpstreamError):
    """The upstream closed the connection before any answer: the request may be sent again."""


@dataclass(frozen=True)
class Origin:
    """Where requests go: ``http(s)://host:port`` and a base path put before every request path."""

    scheme: str
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http:// or https:// URL with a host, got {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since_s = 0.0  # set when the slot keeps it
        self.half_closed = False

    def close(self) -> None:
        self.writer.close()

    def half_close(self) -> None:
        """End the write side (after what is buffered); the read side stays open."""
        if self.half_closed or self.writer.is_closing():
            return
        self.half_closed = True
        if not self.writer.can_write_eof():  # TLS has no half-close: close, and learn nothing more
            self.writer.close()
            return
        with contextlib.suppress(OSError):  # the engine has already gone: the read side will see it
            self.writer.write_eof()


class Response:
    """An answer whose head has been read; its body streams from :meth:`aiter_raw`."""

    def __init__(
        self, slot: SlotClient, connection: _Connection, status: int, headers: list[tuple[bytes, bytes]], http10: bool
    ):
        self.status_code = status
        self.headers = headers  # names lower-cased, in the upstream's order
        self._slot = slot
        self._connection: _Connection | None = connection
        # HTTP/1.1 keeps a connection unless it says close; HTTP/1.0 only when it says keep-alive.
        said = (self.header(b"connection") or b"").lower()
        self._reusable = b"keep-alive" in said if http10 else b"close" not in said

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as the upstream sends them, transfer framing removed; ``UpstreamError``
        when the upstream breaks off or sends what is not HTTP."""
        connection = self._connection
        if connection is None:
            return
        reader = connection.reader
        try:
            if self.status_code in _NO_BODY_STATUS:
                pass
            elif b"chunked" in (self.header(b"transfer-encoding") or b"").lower():
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, dropped
                            pass
                        break
                    data = await reader.readexactly(size)
                    if await reader.readexactly(2) != b"\r\n":
                        raise ValueError("chunk not followed by CRLF")
                    yield data
            elif (length := self.header(b"content-length")) is not None:
                left = int(length)
                while left > 0:
                    data = await reader.read(min(left, READ_BYTES))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
            else:
                self._reusable = False  # framed by the connection's end
                while data := await reader.read(READ_BYTES):
                    yield data
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as error:
            self._reusable = False
            self._finish()
            raise UpstreamError(f"the answer broke off: {error!r}") from error
        self._finish()

    async def aclose(self) -> None:
        """End the exchange: a body not read to its end closes the connection (the engine sees the
        hang-up and aborts the request)."""
        if self._connection is not None:
            self._reusable = False
            self._finish()

    def _finish(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        self._slot.exchange_ended(connection)
        if self._reusable and not connection.half_closed:
            self._slot.keep(connection)
        else:
            connection.close()


class SlotClient:
    """One request slot's connection to the upstream (one request at a time)."""

    def __init__(
        self,
        origin: Origin,
        connect_timeout_s: float,
        tls: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.origin = origin
        self.connect_timeout_s = connect_timeout_s
        self._clock = clock
        self._tls = tls if tls is not None else (ssl.create_default_context() if origin.scheme == "https" else None)
        self._idle: _Connection | None = None
        # The connection of the exchange in progress (from the request's sending to the answer's end),
        # and whether the client has hung up on it.
        self._active: _Connection | None = None
        self.hung_up = False  # reset by the slot's owner when it starts a request

    def hang_up(self) -> None:
        """The client of the exchange in progress has gone: half-close its connection now, or, if the
        request has not gone out yet, make :meth:`send` not send it (it raises ``UpstreamError``)."""
        self.hung_up = True
        if self._active is not None:
            self._active.half_close()

    def exchange_ended(self, connection: _Connection) -> None:
        if self._active is connection:
            self._active = None

    async def send(self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> Response:
        """Send the request and read the answer's head. A connection closed before any answer is
        :class:`UpstreamClosed`; anything else that fails is :class:`UpstreamError`."""
        connection = self._take_idle() or await self._connect()
        if self.hung_up:  # while connecting: nothing went out, nothing to stop upstream
            connection.close()
            raise UpstreamError("the client hung up before the request went out")
        self._active = connection
        head = [f"{method} {self.origin.base_path}{path} HTTP/1.1\r\n".encode()]
        head.append(f"host: {self.origin.host_header}\r\ncontent-length: {len(body)}\r\n".encode())
        head.append(b"accept-encoding: identity\r\n")  # the gate reads SSE events and usage from the bytes
        head.extend(name + b": " + value + b"\r\n" for name, value in headers)
        head.append(b"\r\n")
        try:
            connection.writer.write(b"".join(head) + body)
            await connection.writer.drain()
            status, response_headers, http10 = await self._read_head(connection.reader)
        except (OSError, asyncio.IncompleteReadError) as error:
            self.exchange_ended(connection)
            connection.close()
            if connection.half_closed:  # the engine stopped the request the client left: not to send again
                raise UpstreamError(f"the connection closed after the client hung up: {error!r}") from error
            raise UpstreamClosed(f"the connection closed before an answer: {error!r}") from error
        except (asyncio.LimitOverrunError, ValueError) as error:
            self.exchange_ended(connection)
            connection.close()
            raise UpstreamError(f"the answer is not HTTP/1.1: {error!r}") from error
        except BaseException:
            self.exchange_ended(connection)
            connection.close()  # cancelled (the gate is stopping): the engine sees the hang-up
            raise
        return Response(self, connection, status, response_headers, http10)

    def keep(self, connection: _Connection) -> None:
        if self._idle is not None:
            self._idle.close()
        connection.idle_since_s = self._clock()
        self._idle = connection

    def close(self) -> None:
        if self._idle is not None:
            self._idle.close()
            self._idle = None

    def _take_idle(self) -> _Connection | None:
        connection, self._idle = self._idle, None
        if connection is None:
            return None
        if self._clock() - connection.idle_since_s > KEEPALIVE_EXPIRY_S or connection.reader.at_eof():
            connection.close()
            return None
        return connection

    async def _connect(self) -> _Connection:
        origin = self.origin
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(origin.host, origin.port, ssl=self._tls, limit=MAX_HEAD_BYTES),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError) as error:
            raise UpstreamError(f"cannot connect: {error!r}") from error
        return _Connection(reader, writer)

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> tuple[int, list[tuple[bytes, bytes]], bool]:
        while True:
            raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw[:-4].split(b"\r\n")
            version, _, rest = lines[0].partition(b" ")
            if not version.startswith(b"HTTP/1."):
                raise ValueError(f"status line {lines[0][:80]!r}")
            status = int(rest[:3])
            if 100 <= status < 200:
                continue  # an interim answer; the real one follows
            headers = []
            for line in lines[1:]:
                name, colon, value = line.partition(b":")
                if not colon:
                    raise ValueError(f"header line {line[:80]!r}")
                headers.append((name.strip().lower(), value.strip()))
            return status, headers, version == b"HTTP/1.0"
