"""The gate's serving port: an ASGI app that admits OpenAI requests through the ``Gate`` and passes
them to the upstream engine.

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: the body is read once with the
  runtime's strict decoder (``server.json_body``: its size limit, depth, number ranges and
  encoding), so that a client is told the same whatever engine is behind the gate: a body the
  runtime refuses unread (over the limit: 413, at once from its ``Content-Length``; not UTF-8, not
  JSON, nested too deeply: 400) gets the runtime's status and words. The gate reads no schema, so a
  literal the decoder refuses (an integer past 64 bits, NaN or a number past a double, a lone
  surrogate) is refused wherever it is, with 400 naming the path of the first one in document
  order (``prompt.1: ...``, ``param`` its first segment) in the runtime's words: no engine can be
  trusted to carry such a value on (the runtime itself ignores one in a field it does not read).
  The lane is the ``X-Batchpilot-Lane`` header, else a top-level string ``lane`` of the body.
  The request then waits for admission (503 while draining, 429 with Retry-After on a full queue,
  400 naming ``lane`` for an unknown lane) and goes upstream as the very bytes the client sent;
  the answer comes back unchanged, a streamed one chunk for chunk as the upstream sends it
  (nothing is buffered). An upstream that cannot be reached, or fails before it answers, is a 502
  naming the upstream; one that fails mid-stream ends the stream with an SSE error event. A client
  that hangs up while waiting frees its place at once. One that hangs up once its request went
  upstream keeps its place until the upstream has ended that exchange: the gate reads on, discarding,
  until the answer ends or the engine closes the connection, having first half-closed the upstream
  connection (``stop``, the default: the engine sees the hang-up as if from the client, and stops) or
  not (``finish``: the engine finishes the answer); see "Hang-ups" below.
- ``GET /v1/models`` and ``GET /health`` pass through without admission; ``/healthz`` answers for
  the gate itself, ``/readyz`` asks the upstream's ``/health``; ``/metrics`` is the gate's own
  (followed by the engine's, labelled with the model, with ``--engine-metrics``: ``engine_metrics``);
  ``/openapi.json`` is the port's document (``openapi``). Another method on a served path is a 405
  naming the methods in ``Allow``.

Hang-ups: an engine keeps working on a request after its client has gone until it notices (llama.cpp's
server checks between tokens when streaming; a whole answer, only after a second in which no request
got a result, so under load not before its end), so a slot freed when the client leaves lets the
engine run more requests than the cap. The end of its answer, or its closing
of the connection, is the only sign every HTTP engine gives that it is done with a request, so the
slot is held until then. With ``stop`` the engine is told by a half-close (every HTTP server reads
the end of the request stream as a client that has gone): llama.cpp's server then queues the
request's cancel, ahead of any later request, before it ends the answer, so its running count never
passes the cap; a server that closes the connection at once and aborts after (uvicorn's, under
vLLM, SGLang and this project's runtime) can overlap by that abort's delay, and one that closes at
once and does not abort at all by the rest of the answer. ``finish`` is exact for every engine: the
engine is not told, and the abandoned answer's work is spent under the cap.

Raw ASGI rather than a framework: the hot path is read body, await admission, stream bytes, and
each layer a framework adds is latency on every chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LANE_HEADER
from batchpilot_runtime.gate.admission import Admitted
from batchpilot_runtime.gate.engine_metrics import with_model_label
from batchpilot_runtime.gate.h1client import Response, SlotClient, UpstreamClosed, UpstreamError
from batchpilot_runtime.gate.openapi import DOCUMENT_BYTES, SERVED_METHODS
from batchpilot_runtime.gate.service import Gate
from batchpilot_runtime.gate.upstream import UpstreamSlots
from batchpilot_runtime.scheduling.types import QueueFullError, RequestRejected, RequestTimings
from batchpilot_runtime.server.json_body import (
    MAX_BODY_BYTES,
    ApiError,
    declared_length_error,
    decode_json,
    first_refused,
    over_limit_error,
)
from batchpilot_runtime.server.metrics import EXPOSITION_CONTENT_TYPE

logger = logging.getLogger("batchpilot.gate")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
PASSTHROUGH_PATHS = frozenset({"/v1/models", "/health"})
TAIL_BYTES = 65536  # of an answer kept for its usage object
ENGINE_METRICS_TIMEOUT_S = 2.0  # well under a scrape's usual 10 s timeout
DRAINING_RETRY_AFTER_S = 1
# Headers that belong to one hop (RFC 9110 section 7.6.1), never forwarded either way; uvicorn sets its own.
_HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer"}
    | {b"transfer-encoding", b"upgrade"}
)
# A forwarded request also loses the client's Host, length and accepted encodings: the gate's client
# sets them for the upstream (identity: the gate reads SSE events and usage from the bytes).
_NOT_FORWARDED = _HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding"}
_LANE_HEADER = LANE_HEADER.lower().encode()
_SSE_EVENT = b"data:"
_SSE_DONE = b"data: [DONE]"
_USAGE_KEY = b'"usage"'


HANG_UP_STOP = "stop"
HANG_UP_FINISH = "finish"
HANG_UP_MODES = (HANG_UP_STOP, HANG_UP_FINISH)


class _ClientGone(Exception):
    """The client hung up before its request was read."""


@dataclass
class _Exchange:
    """One admitted request's measurements, taken at the proxy."""

    arrival_s: float
    lane: str
    admitted: Admitted | None = None
    first_chunk_s: float | None = None
    last_chunk_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    events: int = 0
    # The answer's last bytes, where a usage object would be: at least TAIL_BYTES of them, trimmed
    # only once twice that has gathered, so that a long answer's chunks are not copied each time.
    tail: bytearray = field(default_factory=bytearray)
    outcome: str = "cancelled"
    response_started: bool = False
    streamed: bool = False
    # The slot's client once the request is going upstream (a hang-up is passed to it), and whether
    # the client has gone (nothing more is sent to it; the upstream answer is read to its end).
    upstream: SlotClient | None = None
    client_gone: bool = False


async def _send_simple(send: Send, status: int, body: bytes, content_type: bytes, headers: dict[str, str]) -> None:
    raw_headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, error: ApiError) -> None:
    await _send_simple(send, error.status, json.dumps(error.body()).encode(), b"application/json", error.headers)


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case, as the server gives every name)."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def _read_body(scope: Scope, receive: Receive) -> bytes:
    """The body within the runtime's limit, refused as the runtime refuses it: at once from a
    ``Content-Length`` over the limit, else as soon as what arrived passes it."""
    too_long = declared_length_error(_header(scope, b"content-length"))
    if too_long is not None:
        raise too_long
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise over_limit_error()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _decoded(body: bytes) -> Any:
    """The body as the runtime's strict decoder reads it; an ``ApiError`` where the runtime would
    refuse it, and for any refused literal anywhere in it (see the module docstring)."""
    payload = decode_json(body)
    refused = first_refused(payload)
    if refused is not None:
        raise refused
    return payload


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _lane_of(scope: Scope, payload: Any) -> str:
    """The lane header, else a top-level string ``lane`` of the decoded body (the runtime's two ways)."""
    header = _header(scope, _LANE_HEADER)
    if header is not None:
        return header.strip() or DEFAULT_LANE
    lane = payload.get("lane") if isinstance(payload, dict) else None
    return lane if isinstance(lane, str) else DEFAULT_LANE


def _usage_tokens(tail: bytes, streamed: bool) -> tuple[int, int] | None:
    """(prompt, completion) tokens of the usage object that ends an answer (``tail``: its last bytes;
    streamed: the last SSE event carrying one), when the upstream sent one."""
    if _USAGE_KEY not in tail:
        return None
    if streamed:
        events = [e for e in tail.split(b"\n\n") if _USAGE_KEY in e]
        text = events[-1].strip().removeprefix(_SSE_EVENT)
    else:
        text = tail
    try:
        usage = json.loads(text).get("usage")
    except (ValueError, AttributeError):
        return None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        return prompt, completion
    return None


class GateApp:
    """The serving port's ASGI app (see the module docstring)."""

    def __init__(
        self,
        gate: Gate,
        upstream: str,
        slots: UpstreamSlots,
        on_hang_up: str = HANG_UP_STOP,
        engine_metrics_path: str | None = None,
    ) -> None:
        if on_hang_up not in HANG_UP_MODES:
            raise ValueError(f"on_hang_up: expected one of {', '.join(HANG_UP_MODES)}, got {on_hang_up!r}")
        self.gate = gate
        self.upstream = upstream.rstrip("/")
        self.slots = slots
        self.on_hang_up = on_hang_up
        if engine_metrics_path is not None and not engine_metrics_path.startswith("/"):
            raise ValueError(f"engine_metrics_path: expected a path starting with '/', got {engine_metrics_path!r}")
        self.engine_metrics_path = engine_metrics_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            if path in ADMITTED_PATHS and method == "POST":
                await self._admitted(scope, receive, send)
            elif path in PASSTHROUGH_PATHS and method == "GET":
                await self._passthrough(scope, send)
            elif path == "/metrics" and method == "GET":
                await self._metrics(send)
            elif path == "/healthz" and method == "GET":
                await _send_simple(send, 200, b"ok", b"text/plain", {})
            elif path == "/readyz" and method == "GET":
                await self._readyz(send)
            elif path == "/openapi.json" and method == "GET":
                await _send_simple(send, 200, DOCUMENT_BYTES, b"application/json", {})
            elif path in SERVED_METHODS:
                allowed = ", ".join(SERVED_METHODS[path])
                raise ApiError(
                    405,
                    f"{method} {path}: the gate serves {allowed} here",
                    kind="invalid_request_error",
                    headers={"Allow": allowed},
                )
            else:
                raise ApiError(404, f"{method} {path}: not served by batchpilot-gate", kind="not_found_error")
        except ApiError as refusal:
            await _send_error(send, refusal)

    # -- the admitted routes -------------------------------------------------------------------

    async def _admitted(self, scope: Scope, receive: Receive, send: Send) -> None:
        gate = self.gate
        arrival_s = gate.clock()
        try:
            body = await _read_body(scope, receive)
        except _ClientGone:
            return
        if gate.draining:
            raise ApiError(
                503,
                "the gate is draining; retry on another replica",
                kind="service_unavailable",
                headers={"Retry-After": str(DRAINING_RETRY_AFTER_S)},
            )
        lane = _lane_of(scope, _decoded(body))
        try:
            request_id, admission = gate.enqueue(lane)
        except QueueFullError as error:
            retry_after_s = max(1, math.ceil(error.retry_after_s))
            raise ApiError(
                429,
                f"the waiting queue is full; retry in {retry_after_s} s",
                kind="rate_limit_exceeded",
                headers={"Retry-After": str(retry_after_s)},
            ) from None
        except RequestRejected as error:
            raise ApiError(400, str(error), param=error.field) from None
        exchange = _Exchange(arrival_s=arrival_s, lane=lane)
        work = asyncio.ensure_future(self._forward(scope, body, admission, exchange, send))
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client hung up
                exchange.client_gone = True
                if exchange.upstream is None:  # still waiting: nothing upstream to stop
                    work.cancel()
                elif self.on_hang_up == HANG_UP_STOP:  # the slot is held until the engine ends the exchange
                    exchange.upstream.hang_up()
            await asyncio.gather(work, return_exceptions=True)
            failure = None if work.cancelled() else work.exception()
            if exchange.client_gone or isinstance(failure, OSError):  # OSError: a write to a client that has gone
                exchange.outcome = "cancelled"
            elif failure is not None:
                logger.error("gate request failed", exc_info=failure)
                exchange.outcome = "error"
                if not exchange.response_started:
                    await _send_error(send, ApiError(500, f"the gate failed: {failure!r}", kind="internal_error"))
        finally:
            watch.cancel()
            gate.release(request_id)
            self._report(exchange)

    async def _forward(
        self, scope: Scope, body: bytes, admission: asyncio.Future[Admitted], exchange: _Exchange, send: Send
    ) -> None:
        exchange.admitted = admitted = await admission
        # Observed at admission, as the runtime observes its own, not when the request ends.
        self.gate.metrics.on_admitted(exchange.lane, admitted.admitted_s - exchange.arrival_s)
        headers = [(k, v) for k, v in scope["headers"] if k not in _NOT_FORWARDED]
        slot, client = self.slots.take()
        exchange.upstream = client
        try:
            try:
                response = await self._send_upstream(client, scope, body, headers)
            except UpstreamError as error:
                if exchange.client_gone:
                    return
                exchange.outcome = "error"
                await self._bad_gateway(send, error)
                return
            try:
                await self._relay(response, exchange, send)
            finally:
                await response.aclose()
        finally:
            self.slots.give_back(slot)

    async def _send_upstream(
        self, client: SlotClient, scope: Scope, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> Response:
        """The upstream's answer (its head; the body streams). A connection the engine closed before
        answering (a kept-alive one it was closing just as the request went out) is sent again, once,
        on a new connection, unless the client has gone meanwhile. A refused connection is not retried
        (the engine is down: 502 at once)."""
        try:
            return await client.send(scope["method"], scope["path"], headers, body)
        except UpstreamClosed as error:
            if client.hung_up:  # the client has gone meanwhile: nothing to send again
                raise
            logger.info("upstream closed a connection unanswered; sending again", extra={"error": repr(error)})
        return await client.send(scope["method"], scope["path"], headers, body)

    async def _relay(self, response: Response, exchange: _Exchange, send: Send) -> None:
        """Pass the answer on to the client; once the client has gone, read it to its end unsent."""
        # The body's bytes go back as they came (not decoded), so the upstream's encoding holds.
        headers = [(k, v) for k, v in response.headers if k not in _HOP_BY_HOP]
        if exchange.client_gone:
            await self._drain(response)
            return
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        exchange.response_started = True
        streamed = exchange.streamed = (response.header(b"content-type") or b"").startswith(b"text/event-stream")
        clock = self.gate.clock
        try:
            async for chunk in response.aiter_raw():
                if exchange.client_gone:  # the rest is read only to learn when the engine has stopped
                    continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                now_s = clock()
                if streamed:
                    first = exchange.first_chunk_s is None
                    self._observe_chunk(exchange, chunk, now_s)
                    if first and exchange.first_chunk_s is not None:  # the TTFT, observed when it happens
                        self.gate.metrics.on_first_token(exchange.lane, now_s - exchange.arrival_s)
                exchange.tail += chunk
                if len(exchange.tail) > 2 * TAIL_BYTES:
                    del exchange.tail[:-TAIL_BYTES]
        except UpstreamError as error:
            if exchange.client_gone:  # the engine closed the connection the client left: it has stopped
                return
            exchange.outcome = "error"
            logger.warning("upstream failed mid-answer", extra={"upstream": self.upstream, "error": repr(error)})
            if streamed:
                message = f"upstream {self.upstream} failed mid-stream: {error}"
                event = json.dumps({"error": {"message": message, "type": "bad_gateway", "param": None, "code": 502}})
                await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if exchange.client_gone:
            return
        await send({"type": "http.response.body", "body": b""})
        status = response.status_code
        exchange.outcome = "completed" if status < 400 else "rejected" if status < 500 else "error"

    @staticmethod
    async def _drain(response: Response) -> None:
        try:
            async for _ in response.aiter_raw():
                pass
        except UpstreamError:
            pass  # the engine closed the connection: it has stopped the request

    @staticmethod
    def _observe_chunk(exchange: _Exchange, chunk: bytes, now_s: float) -> None:
        events = chunk.count(_SSE_EVENT) - chunk.count(_SSE_DONE)
        if events <= 0:
            return
        if exchange.first_chunk_s is None:
            exchange.first_chunk_s = now_s
        elif exchange.last_chunk_s is not None:
            exchange.gaps_s.append(now_s - exchange.last_chunk_s)
        exchange.last_chunk_s = now_s
        exchange.events += events

    async def _bad_gateway(self, send: Send, error: Exception) -> None:
        await _send_error(send, ApiError(502, f"upstream {self.upstream} did not answer: {error}", kind="bad_gateway"))

    def _report(self, exchange: _Exchange) -> None:
        admitted = exchange.admitted
        tail = bytes(exchange.tail[-TAIL_BYTES:])
        usage = _usage_tokens(tail, exchange.streamed) if exchange.response_started else None
        prompt_tokens, completion_tokens = usage if usage is not None else (0, exchange.events)
        finished_s = self.gate.clock()
        timings = RequestTimings(
            arrival_s=exchange.arrival_s,
            first_admitted_s=None if admitted is None else admitted.admitted_s,
            first_token_s=exchange.first_chunk_s,
            finished_s=finished_s,
            prompt_tokens=prompt_tokens,
            output_tokens=completion_tokens,
            lane=exchange.lane,
            tail_marked=admitted is not None and admitted.tail_marked,
            preemptions=0,
        )
        self.gate.finished(timings, exchange.outcome, completion_tokens, exchange.gaps_s)

    # -- the routes without admission ----------------------------------------------------------

    async def _passthrough(self, scope: Scope, send: Send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k not in _NOT_FORWARDED]
        try:
            response = await self.slots.side.get(self.upstream + scope["path"], headers=headers)
        except httpx.HTTPError as error:
            await self._bad_gateway(send, error)
            return
        # httpx decoded the body: its encoding and length headers no longer apply.
        dropped = _NOT_FORWARDED | {b"content-encoding"}
        kept = {k: v for k, v in response.headers.items() if k.encode() not in dropped}
        content_type = kept.pop("content-type", "application/json")
        await _send_simple(send, response.status_code, response.content, content_type.encode(), kept)

    async def _metrics(self, send: Send) -> None:
        """The gate's metrics, then the engine's own (``engine_metrics``) when asked for; an engine that
        does not answer leaves them out, and says so in the log, rather than failing the gate's."""
        body = self.gate.metrics.exposition()
        if self.engine_metrics_path is not None:
            url = self.upstream + self.engine_metrics_path
            try:
                response = await self.slots.side.get(url, timeout=ENGINE_METRICS_TIMEOUT_S)
                response.raise_for_status()
            except httpx.HTTPError as error:
                logger.warning("engine metrics not read", extra={"url": url, "error": repr(error)})
            else:
                body += with_model_label(response.content, self.gate.model_name)
        await _send_simple(send, 200, body, EXPOSITION_CONTENT_TYPE.encode(), {})

    async def _readyz(self, send: Send) -> None:
        if self.gate.draining:
            raise ApiError(503, "draining", kind="service_unavailable")
        try:
            response = await self.slots.side.get(self.upstream + "/health", timeout=2.0)
        except httpx.HTTPError as error:
            raise ApiError(
                503, f"upstream {self.upstream} is not reachable: {error!r}", kind="service_unavailable"
            ) from None
        if response.status_code != 200:
            raise ApiError(
                503, f"upstream {self.upstream}/health answered {response.status_code}", kind="service_unavailable"
            )
        await _send_simple(send, 200, b"ok", b"text/plain", {})
