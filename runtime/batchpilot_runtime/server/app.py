"""The serving app: OpenAI-compatible completions, models, health, readiness and metrics.

Handlers validate, submit to ``AsyncEngine`` and await its token events; they never touch
the scheduler. A completion whose client goes away is aborted at once, which frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from starlette.types import Receive, Scope, Send

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LANE_HEADER
from batchpilot_runtime.engine.types import (
    EngineStoppedError,
    GenerationRequest,
    QueueFullError,
    RequestRejected,
    TokenEvent,
)
from batchpilot_runtime.server.context import LoadedModel, ServingContext
from batchpilot_runtime.server.logs import RequestIdMiddleware
from batchpilot_runtime.server.metrics import EXPOSITION_CONTENT_TYPE
from batchpilot_runtime.server.openai_schema import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
)
from batchpilot_runtime.server.text import StopStringDetector

logger = logging.getLogger("batchpilot.server")

DRAINING_RETRY_AFTER_S = 1
# The engine's name of a request field -> the completion request's.
_API_FIELDS = {"prompt_token_ids": "prompt"}
# A prompt of the longest context in token ids is well under this; anything larger is refused unread.
MAX_BODY_BYTES = 16 * 1024 * 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class ApiError(Exception):
    """An error answered in OpenAI's shape; ``param`` names the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorDetail(message=self.message, type=self.kind, param=self.param))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: tuple[int | str, ...]) -> str:
    # pydantic names a union's member types in the location ("constrained-str", "list[int]");
    # the user wants the field and the index.
    parts = [str(p) for p in loc if isinstance(p, int) or not ("-" in p or "[" in p or p in _UNION_TAGS)]
    return ".".join(parts) or "body"


class RefusedLiteral:
    """Stands in for a value ``decode_json`` refuses (a number out of range, NaN, a string with a
    lone surrogate) so that validation reports it at its field; a field the model ignores may hold one."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"RefusedLiteral({self.reason!r})"


def _shown(literal: str) -> str:
    return literal if len(literal) <= 24 else f"{literal[:10]}...{literal[-4:]} ({len(literal)} characters)"


def _int_literal(literal: str) -> int | RefusedLiteral:
    # Python refuses to convert over 4,300 digits (a ValueError from json.loads); nothing here takes
    # an integer past 64 bits, and a window generation past it would not even fit a float gauge.
    if len(literal) <= 20 and INT64_MIN <= (value := int(literal)) <= INT64_MAX:
        return value
    return RefusedLiteral(f"{_shown(literal)} is outside the signed 64-bit integer range")


def _float_literal(literal: str) -> float | RefusedLiteral:
    value = float(literal)
    return value if math.isfinite(value) else RefusedLiteral(f"{_shown(literal)} is outside the range of a double")


def _constant_literal(literal: str) -> RefusedLiteral:
    return RefusedLiteral(f"{literal} is not a JSON number")


def _lone_surrogate(text: str) -> str | None:
    # json.loads joins an escaped surrogate pair into one character; what it leaves alone is unpaired.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"\\u{ord(text[error.start]):04x}"
    return None


def _refuse_lone_surrogates(payload: Any) -> None:
    """Replace each string value holding a lone surrogate (an escape no UTF-8 text can carry on,
    into a metric label or a response) with a ``RefusedLiteral``; such a member name is a 400."""
    pending = [payload]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            for key, child in node.items():
                if (surrogate := _lone_surrogate(key)) is not None:
                    raise ApiError(400, f"body: a member name holds a lone surrogate ({surrogate})", param="body")
                if isinstance(child, str) and (surrogate := _lone_surrogate(child)) is not None:
                    node[key] = RefusedLiteral(f"the string holds a lone surrogate ({surrogate})")
                else:
                    pending.append(child)
        elif isinstance(node, list):
            for index, child in enumerate(node):
                if isinstance(child, str) and (surrogate := _lone_surrogate(child)) is not None:
                    node[index] = RefusedLiteral(f"the string holds a lone surrogate ({surrogate})")
                else:
                    pending.append(child)


def decode_json(raw: bytes) -> Any:
    """A request body as strict JSON: UTF-8 text (no byte-order mark), numbers that are 64-bit
    integers or finite doubles, strings of Unicode characters. Refuses with a 400 naming the body;
    a refused number or string is decoded as a ``RefusedLiteral`` for validation to report at its
    field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, f"body: not UTF-8 ({error})", param="body") from None
    if "\x00" in text:  # JSON text never holds a raw NUL; UTF-16 and UTF-32 text does
        raise ApiError(400, "body: holds NUL characters; JSON must be sent as UTF-8", param="body")
    try:
        payload = json.loads(text, parse_int=_int_literal, parse_float=_float_literal, parse_constant=_constant_literal)
    except json.JSONDecodeError as error:
        raise ApiError(400, f"body: not valid JSON ({error})", param="body") from None
    except RecursionError:
        raise ApiError(400, "body: JSON nested too deeply", param="body") from None
    if _SURROGATE_ESCAPE.search(text):  # only an escape makes a surrogate out of UTF-8 text
        _refuse_lone_surrogates(payload)
    return payload


def error_message(item: ErrorDetails) -> str:
    """pydantic's message for one error, or why ``decode_json`` refused the literal it was given."""
    given = item.get("input")
    return given.reason if isinstance(given, RefusedLiteral) else item["msg"]


def validation_error(error: ValidationError) -> ApiError:
    errors = error.errors(include_url=False)
    # With a union (a prompt is text or token ids) the deepest error is the one about the member the
    # client meant: [1, -2] is a list with a bad item, not a string.
    worst = max(errors, key=lambda e: len(e["loc"]))
    field = str(worst["loc"][0]) if worst["loc"] else "body"
    return ApiError(400, f"{_field_path(tuple(worst['loc']))}: {error_message(worst)}", param=field)


async def read_body(request: Request, limit_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused with 413 past ``limit_bytes`` without buffering the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise ApiError(413, f"body: {declared} bytes is over the limit of {limit_bytes}", param="body")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise ApiError(413, f"body: over the limit of {limit_bytes} bytes", param="body")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_completion_request(raw: bytes) -> CompletionRequest:
    payload = decode_json(raw)
    if not isinstance(payload, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(payload).__name__}", param="body")
    if "prompt" not in payload:
        raise ApiError(400, "prompt: field required", param="prompt")
    try:
        return CompletionRequest.model_validate(payload)
    except ValidationError as error:
        raise validation_error(error) from None


class _Completion:
    """One accepted completion: its engine request, its text and the cleanup owed when it ends."""

    def __init__(self, ctx: ServingContext, loaded: LoadedModel, request: GenerationRequest, stops: tuple[str, ...]):
        self.ctx = ctx
        self.loaded = loaded
        self.request = request
        self.detector = StopStringDetector(loaded.tokenizer.decode, stops)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._closed = False

    @property
    def id(self) -> str:
        return self.request.request_id

    def on_event(self, event: TokenEvent) -> str:
        """Apply one engine event; returns the text delta to send."""
        delta = ""
        if event.token_id is not None and self.finish_reason is None:
            delta = self.detector.push(event.token_id)
            self.ctx.metrics.on_generated_tokens(1)
            if self.detector.stopped:
                self.finish_reason = "stop"
                # The engine does not see stop strings: end the request there (counted as completed).
                self.loaded.engine.finish(self.id, "stop")
                return delta
        if event.finish_reason is not None and self.finish_reason is None:
            self.finish_reason = event.finish_reason
            self.error = event.error
            delta += self.detector.flush()
        return delta

    def usage(self) -> Usage:
        prompt = len(self.request.prompt_token_ids)
        completion = self.detector.num_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def close(self) -> None:
        """Idempotent: abort the engine request unless it ended, and release the drain count."""
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None:
            self.loaded.engine.abort(self.id)
            logger.info("completion cancelled: client went away", extra={"completion_id": self.id})
        self.ctx.request_ended()


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """Server-sent events that stop the moment the client disconnects (not only at the next write),
    so that a request still queued is aborted before it ever takes KV."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await send(
                            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
                        )
                        async for chunk in self.body_iterator:
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    except OSError:
                        pass  # the client went away mid-write
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await _wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
        finally:
            self._on_close()


async def _close_events(events: AsyncIterator[TokenEvent]) -> None:
    # After a stop string the engine's stream still holds a cancellation event nobody will read.
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def create_serving_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="batchpilot runtime", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.ctx = ctx

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    _add_probe_routes(app, ctx)
    _add_completion_route(app, ctx)
    app.add_middleware(RequestIdMiddleware, logger_name="batchpilot.access")
    return app


def _add_probe_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Registers /healthz, /readyz, /metrics and /v1/models."""

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """Liveness: fails when the engine loop died or stalled after the model loaded."""
        reason = ctx.not_live_reason()
        if reason is not None:
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        reason = ctx.not_ready_reason()
        if reason is not None:
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        return JSONResponse({"ready": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        loaded = ctx.loaded
        if loaded is not None:
            load = loaded.engine.load()
            ctx.metrics.set_load(load.queue_depth, load.running, load.kv_usage_ratio)
        return Response(ctx.metrics.exposition(), media_type=EXPOSITION_CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        max_model_len = ctx.loaded.max_model_len if ctx.loaded is not None else 0
        return ModelList(data=[ModelCard(id=ctx.model_name, created=ctx.created_unix_s, max_model_len=max_model_len)])


def _add_completion_route(app: FastAPI, ctx: ServingContext) -> None:
    """Registers POST /v1/completions."""

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={400: {"model": ErrorResponse}, 429: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": CompletionRequest.model_json_schema()}},
            }
        },
    )
    async def completions(request: Request) -> Response:
        loaded = ctx.loaded
        if ctx.draining:
            raise _draining_error()
        if loaded is None:
            raise ApiError(
                503,
                "the model is still loading",
                kind="service_unavailable",
                headers={"Retry-After": str(DRAINING_RETRY_AFTER_S)},
            )
        body = parse_completion_request(await read_body(request))
        if ctx.draining:  # the drain may have begun while the body was arriving
            raise _draining_error()
        generation = _generation_request(ctx, loaded, body, request.headers.get(LANE_HEADER))
        events = _submit(ctx, loaded, generation)
        ctx.request_started()
        completion = _Completion(ctx, loaded, generation, body.stop_strings())
        logger.info(
            "completion accepted",
            extra={
                "completion_id": completion.id,
                "lane": generation.lane,
                "prompt_tokens": len(generation.prompt_token_ids),
                "max_tokens": generation.max_tokens,
                "stream": body.stream,
            },
        )
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return SSEResponse(_stream(ctx, completion, events, include_usage), completion.close)
        try:
            return await _collect_unless_disconnected(ctx, completion, events, request.receive)
        finally:
            completion.close()


def _draining_error() -> ApiError:
    return ApiError(
        503,
        "the server is draining; retry on another replica",
        kind="service_unavailable",
        headers={"Retry-After": str(DRAINING_RETRY_AFTER_S)},
    )


def _submit(ctx: ServingContext, loaded: LoadedModel, generation: GenerationRequest) -> AsyncIterator[TokenEvent]:
    """Hands the request to the engine; a refusal is counted and becomes a 429, 400 or 503."""
    try:
        return loaded.engine.submit(generation)
    except QueueFullError as error:
        ctx.metrics.on_rejected()
        retry_after_s = max(1, math.ceil(error.retry_after_s))
        raise ApiError(
            429,
            f"the waiting queue is full; retry in {retry_after_s} s",
            kind="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
        ) from None
    except RequestRejected as error:
        ctx.metrics.on_rejected()
        param = _API_FIELDS.get(error.field or "", error.field)
        message = str(error) if error.field is None else f"{param}: {str(error).removeprefix(f'{error.field}: ')}"
        raise ApiError(400, message, param=param) from None
    except EngineStoppedError as error:
        ctx.metrics.on_rejected()
        raise ApiError(
            503,
            f"the engine accepts no new request: {error}",
            kind="service_unavailable",
            headers={"Retry-After": str(DRAINING_RETRY_AFTER_S)},
        ) from None


def _generation_request(
    ctx: ServingContext, loaded: LoadedModel, body: CompletionRequest, lane_header: str | None
) -> GenerationRequest:
    if body.model is not None and body.model != ctx.model_name:
        raise ApiError(
            404,
            f"model: this server serves '{ctx.model_name}', not '{body.model}'",
            param="model",
            kind="not_found_error",
        )
    # The lane, the lengths and the token ids are the engine's to check (``engine.submit``), once.
    tokenizer = loaded.tokenizer
    if isinstance(body.prompt, str):
        if not body.prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        prompt_ids = tokenizer.encode(body.prompt)
    else:
        prompt_ids = list(body.prompt)
    eos = tokenizer.eos_token_id
    return GenerationRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop_token_ids=() if body.ignore_eos or eos is None else (eos,),
        lane=body.lane or lane_header or DEFAULT_LANE,
    )


def _chunk(ctx: ServingContext, completion: _Completion, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": completion.id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


async def _stream(
    ctx: ServingContext, completion: _Completion, events: AsyncIterator[TokenEvent], include_usage: bool
) -> AsyncIterator[bytes]:
    """SSE body: one chunk per generated token (so that clients can time the first token, even when
    its text is held back), a final chunk with the finish reason, optional usage, then ``[DONE]``."""
    async for event in events:
        had_token = event.token_id is not None
        delta = completion.on_event(event)
        if completion.finish_reason is not None:
            await _close_events(events)
            break
        if had_token:
            yield _sse(_chunk(ctx, completion, delta, None))
    else:
        delta = ""
    if completion.finish_reason is None:
        # The engine's stream ended without a terminal event: say so rather than pretend it finished.
        completion.finish_reason = "error"
        completion.error = "the engine ended the stream without finishing the request"
    if completion.finish_reason == "error":
        if delta:
            yield _sse(_chunk(ctx, completion, delta, None))
        detail = ErrorDetail(message=completion.error or "generation failed", type="server_error")
        yield _sse({"error": detail.model_dump()})
    else:
        yield _sse(_chunk(ctx, completion, delta, completion.finish_reason))
    if include_usage:
        yield _sse(
            {
                "id": completion.id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": ctx.model_name,
                "choices": [],
                "usage": completion.usage().model_dump(),
            }
        )
    yield _sse("[DONE]")


async def _collect_unless_disconnected(
    ctx: ServingContext, completion: _Completion, events: AsyncIterator[TokenEvent], receive: Receive
) -> Response:
    async def collect() -> None:
        async for event in events:
            completion.on_event(event)
            if completion.finish_reason is not None:
                await _close_events(events)
                return

    collect_task = asyncio.ensure_future(collect())
    watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({collect_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect_task, watch_task):
            task.cancel()
        await asyncio.gather(collect_task, watch_task, return_exceptions=True)
    if collect_task.cancelled() or collect_task.exception() is not None:
        error = None if collect_task.cancelled() else collect_task.exception()
        if error is not None:
            raise error
        # The client is gone; close() aborts the request. Nobody reads this answer.
        return Response(status_code=499)
    if completion.finish_reason is None or completion.finish_reason == "error":
        message = completion.error or "the engine ended the stream without finishing the request"
        raise ApiError(500, message, kind="server_error")
    response = CompletionResponse(
        id=completion.id,
        created=int(time.time()),
        model=ctx.model_name,
        choices=[CompletionChoice(text=completion.detector.text, finish_reason=completion.finish_reason)],
        usage=completion.usage(),
    )
    return JSONResponse(response.model_dump())
