"""A runtime pod that answers badly, on purpose: the operator's chaos tests point a profile at it.

A raw asyncio HTTP/1.1 server (not aiohttp), so that it can answer in ways no
well-behaved framework would: every path (``/admin/window``, ``/metrics``)
gets the same answer, chosen by :attr:`ChaosPod.mode`:

- ``refused``: nothing listens on the port (connection refused);
- ``http500``: ``500 Internal Server Error`` with a short text body;
- ``invalid_json``: ``200`` with ``Content-Type: application/json`` and a body
  that is not JSON (nor a metrics exposition);
- ``endless``: ``200``, chunked, one byte every ``drip_s`` for as long as the
  client keeps the connection;
- ``huge``: ``200`` and a 100 MiB body, chunked (no ``Content-Length`` to refuse it by).

Counters say what the client did: responses begun per mode, bytes sent per
response (``sent_bytes``: counted after each chunk was handed to the kernel, so
an upper bound of what the client read), and how many responses the client cut
short by hanging up (``hung_up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from dataclasses import dataclass, field

MODES = ("refused", "http500", "invalid_json", "endless", "huge")
HUGE_BYTES = 100 * 1024 * 1024
CHUNK_BYTES = 64 * 1024


@dataclass
class ChaosPod:
    host: str = "127.0.0.1"
    mode: str = "http500"
    drip_s: float = 0.2
    port: int = 0
    responses: Counter[str] = field(default_factory=Counter)  # mode -> responses begun
    hung_up: Counter[str] = field(default_factory=Counter)  # mode -> responses the client cut short
    sent_bytes: list[int] = field(default_factory=list)  # body bytes sent, per ``huge`` response
    _server: asyncio.Server | None = None
    _connections: dict[asyncio.StreamWriter, asyncio.Task[None]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}"

    async def start(self) -> str:
        if not self.port:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            with socket.socket(family) as sock:
                sock.bind((self.host, 0))
                self.port = sock.getsockname()[1]
        await self.set_mode(self.mode)
        return self.url

    async def set_mode(self, mode: str) -> None:
        """Switch what every later request gets; ``refused`` closes the listener, any other mode opens it."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        if mode == "refused" and self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        elif mode != "refused" and self._server is None:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, reuse_address=True)

    async def stop(self) -> None:
        """Stop listening and drop every open connection (their handlers end on the dropped socket)."""
        await self.set_mode("refused")
        for writer in list(self._connections):
            writer.transport.abort()
        await asyncio.gather(*self._connections.values(), return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections[writer] = task
        try:
            while await self._answer_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._connections.pop(writer, None)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read one request and answer it; True when the connection may carry another."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length:
            await reader.readexactly(length)
        mode = self.mode
        self.responses[mode] += 1
        if mode == "http500":
            await _write(writer, b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
                                 b"Content-Length: 4\r\n\r\nboom")  # fmt: skip
            return True
        if mode == "invalid_json":
            body = b'{"model": "b", "window": [not json'
            await _write(writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            return True
        if mode == "endless":
            await _write(writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
            try:
                while True:  # until the client hangs up
                    await _write(writer, b"1\r\n \r\n")
                    await asyncio.sleep(self.drip_s)
            except ConnectionError:
                self.hung_up[mode] += 1
                raise
        # huge: chunked, so that no Content-Length warns the client; only reading tells it the size
        await _write(writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        index = len(self.sent_bytes)
        self.sent_bytes.append(0)
        chunk = b'{"model": "' + b"x" * (CHUNK_BYTES - 11)
        try:
            while self.sent_bytes[index] < HUGE_BYTES:
                await _write(writer, b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.sent_bytes[index] += len(chunk)
                chunk = b"x" * CHUNK_BYTES
            await _write(writer, b"0\r\n\r\n")
        except ConnectionError:
            self.hung_up[mode] += 1
            raise
        return True


async def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    if writer.is_closing():
        raise ConnectionResetError("the client hung up")
    writer.write(data)
    await writer.drain()


def ipv6_loopback_available() -> bool:
    """True when this machine can listen on ``::1`` (some sandboxes and CI runners cannot)."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True
