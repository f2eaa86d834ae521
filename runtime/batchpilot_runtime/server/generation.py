"""One accepted generation of an OpenAI route, from the engine's token events to the client.

``/v1/completions`` and ``/v1/chat/completions`` share it and differ only in the objects they
write (a ``ResponseShape``). A ``Generation`` turns token events into text (stop strings, the
finish reason, usage) and ends the engine request when a stop string or the client ends it;
``respond`` streams it as server-sent events or collects it into one answer. Handlers submit and
await; they never touch the scheduler. A generation whose client goes away is aborted at once,
which frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import anyio
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from batchpilot_runtime.engine.types import (
    EngineStoppedError,
    GenerationRequest,
    QueueFullError,
    RequestRejected,
    TokenEvent,
)
from batchpilot_runtime.server.context import LoadedModel, ServingContext
from batchpilot_runtime.server.json_body import ApiError
from batchpilot_runtime.server.openai_schema import ErrorDetail, Usage
from batchpilot_runtime.server.text import StopStringDetector

logger = logging.getLogger("batchpilot.server")

DRAINING_RETRY_AFTER_S = 1


class ResponseShape(Protocol):
    """The objects one route answers with (OpenAI's ``text_completion`` or ``chat.completion``)."""

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """One streamed chunk: a text delta, and the finish reason on the last one."""
        ...

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The chunk after the last, when the client asked for usage (no choices)."""
        ...

    def whole(self, text: str, finish_reason: str, usage: Usage) -> BaseModel:
        """The answer of a request that does not stream."""
        ...


def log_ignored_fields(path: str, ignored: list[str]) -> None:
    """Say which unknown fields a request was served without (vLLM warns the same way), at info:
    a client that always sends one would otherwise fill the log with warnings."""
    if ignored:
        logger.info("request fields ignored", extra={"path": path, "ignored_fields": ignored[:16]})


def draining_error() -> ApiError:
    return ApiError(
        503,
        "the server is draining; retry on another replica",
        kind="service_unavailable",
        headers={"Retry-After": str(DRAINING_RETRY_AFTER_S)},
    )


def ready_model(ctx: ServingContext) -> LoadedModel:
    """The loaded model, or the 503 a client should retry: draining, or still loading."""
    if ctx.draining:
        raise draining_error()
    if ctx.loaded is None:
        raise ApiError(
            503,
            "the model is still loading",
            kind="service_unavailable",
            headers={"Retry-After": str(DRAINING_RETRY_AFTER_S)},
        )
    return ctx.loaded


def check_model_name(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise ApiError(
            404,
            f"model: this server serves '{ctx.model_name}', not '{model}'",
            param="model",
            kind="not_found_error",
        )


def submit(
    ctx: ServingContext, loaded: LoadedModel, request: GenerationRequest, api_fields: Mapping[str, str]
) -> AsyncIterator[TokenEvent]:
    """Hands the request to the engine; a refusal is counted and becomes a 429, 400 or 503.
    ``api_fields`` maps the engine's name of a request field to the one the client sent."""
    try:
        return loaded.engine.submit(request)
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
        param = api_fields.get(error.field or "", error.field)
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


class Generation:
    """One accepted request: its engine request, its text and the cleanup owed when it ends."""

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


def accept(
    ctx: ServingContext,
    loaded: LoadedModel,
    request: GenerationRequest,
    *,
    stops: tuple[str, ...],
    api_fields: Mapping[str, str],
    stream: bool,
) -> tuple[Generation, AsyncIterator[TokenEvent]]:
    """Submits the request and counts it in flight (the drain waits for it) once the engine took it."""
    events = submit(ctx, loaded, request, api_fields)
    ctx.request_started()
    generation = Generation(ctx, loaded, request, stops)
    logger.info(
        "completion accepted",
        extra={
            "completion_id": generation.id,
            "lane": request.lane,
            "prompt_tokens": len(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "stream": stream,
        },
    )
    return generation, events


async def respond(
    generation: Generation,
    events: AsyncIterator[TokenEvent],
    shape: ResponseShape,
    *,
    stream: bool,
    include_usage: bool,
    receive: Receive,
) -> Response:
    """Streams the generation, or collects it into one answer; either way closes it at the end."""
    if stream:
        return SSEResponse(_stream(generation, events, shape, include_usage), generation.close)
    try:
        return await _collect_unless_disconnected(generation, events, shape, receive)
    finally:
        generation.close()


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


async def _stream(
    generation: Generation, events: AsyncIterator[TokenEvent], shape: ResponseShape, include_usage: bool
) -> AsyncIterator[bytes]:
    """SSE body: one chunk per generated token (so that clients can time the first token, even when
    its text is held back), a final chunk with the finish reason, optional usage, then ``[DONE]``."""
    async for event in events:
        had_token = event.token_id is not None
        delta = generation.on_event(event)
        if generation.finish_reason is not None:
            await _close_events(events)
            break
        if had_token:
            yield _sse(shape.chunk(delta, None))
    else:
        delta = ""
    if generation.finish_reason is None:
        # The engine's stream ended without a terminal event: say so rather than pretend it finished.
        generation.finish_reason = "error"
        generation.error = "the engine ended the stream without finishing the request"
    if generation.finish_reason == "error":
        if delta:
            yield _sse(shape.chunk(delta, None))
        detail = ErrorDetail(message=generation.error or "generation failed", type="server_error")
        yield _sse({"error": detail.model_dump()})
    else:
        yield _sse(shape.chunk(delta, generation.finish_reason))
    if include_usage:
        yield _sse(shape.usage_chunk(generation.usage()))
    yield _sse("[DONE]")


async def _collect_unless_disconnected(
    generation: Generation, events: AsyncIterator[TokenEvent], shape: ResponseShape, receive: Receive
) -> Response:
    async def collect() -> None:
        async for event in events:
            generation.on_event(event)
            if generation.finish_reason is not None:
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
    if generation.finish_reason is None or generation.finish_reason == "error":
        message = generation.error or "the engine ended the stream without finishing the request"
        raise ApiError(500, message, kind="server_error")
    whole = shape.whole(generation.detector.text, generation.finish_reason, generation.usage())
    return JSONResponse(whole.model_dump())
