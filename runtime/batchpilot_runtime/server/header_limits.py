"""Limits on a request's head, shared by every port of the runtime and the gate (``listen.http_server``
applies both parts to each app it serves).

- ``HeaderLimits``: ASGI middleware answering 431 (Request Header Fields Too Large) to a request
  of more than ``MAX_HEADER_FIELDS`` header fields, or more than ``MAX_HEADER_BYTES`` of names and
  values together, before the app sees it. nginx and Apache allow 100 fields; 64 KiB is what
  Apache allows (8 KiB a line) and well over the 8 to 16 KiB most proxies in front of an engine
  pass, so no client a proxy would serve is refused here.
- ``BoundedHttpToolsProtocol``: uvicorn's httptools protocol, which buffers a head however long
  it grows (neither uvicorn nor httptools bounds it), with a bound on the bytes of a head still
  arriving: past ``MAX_HEAD_BYTES`` it answers 431 and reads and drops the rest, so that a head
  that never ends costs at most that and two reads of memory. The middleware then counts exactly
  what a head that did end holds.

The answer is OpenAI's error shape with ``connection: close``, on the admin port as well (a 431 is
about the connection's request, not the window).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from batchpilot_runtime.server.json_body import ApiError

MAX_HEADER_FIELDS = 100
MAX_HEADER_BYTES = 64 * 1024
# The request line and the framing of each field come on top of the header bytes.
MAX_HEAD_BYTES = MAX_HEADER_BYTES + 16 * 1024
# How long the rest of a refused head is read and dropped before the connection closes: closing with
# unread bytes would reset the connection, and the client might lose the 431 before reading it.
DRAIN_REFUSED_HEAD_S = 5.0
HEADERS_TOO_LARGE = 431

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def header_error(headers: list[tuple[bytes, bytes]]) -> ApiError | None:
    """The 431 for headers over a limit, else None."""
    if len(headers) > MAX_HEADER_FIELDS:
        message = f"request headers: {len(headers)} fields is over the limit of {MAX_HEADER_FIELDS}"
        return ApiError(HEADERS_TOO_LARGE, message)
    size = sum(len(name) + len(value) for name, value in headers)
    if size > MAX_HEADER_BYTES:
        return ApiError(HEADERS_TOO_LARGE, f"request headers: {size} bytes is over the limit of {MAX_HEADER_BYTES}")
    return None


def _answer(error: ApiError) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return [*headers, (b"connection", b"close")], body


class HeaderLimits:
    """ASGI middleware: 431 for a request whose headers are over a limit (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = header_error(scope["headers"]) if scope["type"] == "http" else None
        if error is None:
            await self.app(scope, receive, send)
            return
        headers, body = _answer(error)
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on a head still arriving (see the module docstring).

    A read is counted when the head had begun before it and has not ended after it: every byte of
    it is then the head's. The read a head begins in and the one it ends in are not counted, so
    that no byte of a body (or of the request before it) ever is; the middleware counts those heads.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._heads = 0  # heads begun on this connection: tells a new head from the one counted
        self._head_bytes: int | None = None  # of the head still arriving; None between heads
        self._refused = False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._heads += 1
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused head: dropped unparsed
        head_before = self._heads if self._head_bytes is not None else None
        super().data_received(data)
        if self._head_bytes is None or head_before != self._heads:
            return
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse_head()

    def _refuse_head(self) -> None:
        self._refused = True
        if self.cycle is not None and not self.cycle.response_complete:
            # An answer to the request before it is still going out: a 431 now would corrupt it.
            self.transport.close()
            return
        headers, body = _answer(ApiError(HEADERS_TOO_LARGE, f"request head: over the limit of {MAX_HEAD_BYTES} bytes"))
        head = b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        head += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        self.transport.write(head + b"\r\n" + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(DRAIN_REFUSED_HEAD_S, self.transport.close)
