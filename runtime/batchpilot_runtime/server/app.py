"""The serving app: OpenAI-compatible completions and chat completions, models, health,
readiness and metrics.

Handlers validate, submit to ``AsyncEngine`` and await its token events (``generation``); they
never touch the scheduler. The chat route lives in ``chat``; bodies are read in ``request_body``
(decoded by ``json_body``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LANE_HEADER
from batchpilot_runtime.engine.types import GenerationRequest
from batchpilot_runtime.server.chat import add_chat_route
from batchpilot_runtime.server.context import LoadedModel, ServingContext
from batchpilot_runtime.server.generation import (
    accept,
    check_model_name,
    draining_error,
    log_ignored_fields,
    ready_model,
    respond,
)
from batchpilot_runtime.server.json_body import ApiError, decode_json
from batchpilot_runtime.server.logs import RequestIdMiddleware
from batchpilot_runtime.server.metrics import EXPOSITION_CONTENT_TYPE
from batchpilot_runtime.server.openai_schema import (
    UNIMPLEMENTED_SAMPLING,
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    screen_fields,
)
from batchpilot_runtime.server.openapi_doc import (
    PLAIN_TEXT,
    SERVING_RESPONSES,
    allow_every_method,
    document_bodies,
    json_request_body,
)
from batchpilot_runtime.server.request_body import add_client_gone_handler, error_response, read_body, validation_error

# The engine's name of a request field -> the completion request's.
COMPLETIONS_PATH = "/v1/completions"
_API_FIELDS = {"prompt_token_ids": "prompt"}


def parse_completion_request(raw: bytes) -> CompletionRequest:
    payload = decode_json(raw)
    if not isinstance(payload, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(payload).__name__}", param="body")
    if "prompt" not in payload:
        raise ApiError(400, "prompt: field required", param="prompt")
    payload["prompt"] = _one_prompt(payload["prompt"])
    screened = screen_fields(payload, CompletionRequest, UNIMPLEMENTED_SAMPLING)
    if screened.refused:
        raise ApiError(400, screened.refusal(UNIMPLEMENTED_SAMPLING), param=screened.refused[0])
    log_ignored_fields(COMPLETIONS_PATH, screened.ignored)
    try:
        return CompletionRequest.model_validate(payload)
    except ValidationError as error:
        raise validation_error(error) from None


def _one_prompt(prompt: Any) -> Any:
    """The prompt of a request: a string, a list of token ids, or OpenAI's batch form holding one of
    them (``["text"]``, ``[[1, 2]]``), which is served as that prompt with the choice at index 0.
    A batch of several is refused naming ``prompt``: one request per prompt is what the scheduler
    batches anyway."""
    if not isinstance(prompt, list) or not any(isinstance(item, str | list) for item in prompt):
        return prompt  # a string, or token ids: the model checks them
    if len(prompt) == 1:
        return prompt[0]
    if all(isinstance(item, str | list) for item in prompt):
        raise ApiError(
            400,
            f"prompt: a list of {len(prompt)} prompts is not supported; send one request per prompt "
            "(a string, or a list of token ids)",
            param="prompt",
        )
    raise ApiError(400, "prompt: a list must hold token ids (integers) only, or be one prompt", param="prompt")


def create_serving_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="batchpilot runtime", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.ctx = ctx

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    add_client_gone_handler(app)
    _add_probe_routes(app, ctx)
    _add_completion_route(app, ctx)
    add_chat_route(app, ctx)
    document_bodies(app, [(CompletionRequest, False), (ChatCompletionRequest, False)])
    allow_every_method(app)
    app.add_middleware(RequestIdMiddleware, logger_name="batchpilot.access")
    return app


def _add_probe_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Registers /healthz, /health, /readyz, /metrics and /v1/models."""

    @app.get("/healthz", responses={503: {}})
    async def healthz() -> JSONResponse:
        """Liveness: fails when the engine loop died or stalled after the model loaded."""
        reason = ctx.not_live_reason()
        if reason is not None:
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "Alive (an empty body, as vLLM answers)", "content": {}}, 503: {}},
    )
    async def health() -> Response:
        """vLLM's, SGLang's and TGI's health path, which LLM clients and benchmarks (guidellm) check
        first: 200 with an empty body while the engine is alive, as vLLM answers; 503 naming why
        while the model loads or when the loop died or stalled (vLLM is not listening yet then)."""
        reason = "model loading" if ctx.loaded is None else ctx.not_live_reason()
        if reason is not None:
            return JSONResponse({"status": reason}, status_code=503)
        return Response(status_code=200)

    @app.get("/readyz", responses={503: {}})
    async def readyz() -> JSONResponse:
        reason = ctx.not_ready_reason()
        if reason is not None:
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        return JSONResponse({"ready": True})

    @app.get("/metrics", response_class=Response, responses={200: {"content": PLAIN_TEXT}})
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
        COMPLETIONS_PATH,
        response_model=CompletionResponse,
        responses=SERVING_RESPONSES,
        openapi_extra=json_request_body(CompletionRequest),
    )
    async def completions(request: Request) -> Response:
        loaded = ready_model(ctx)
        body = parse_completion_request(await read_body(request))
        if ctx.draining:  # the drain may have begun while the body was arriving
            raise draining_error()
        generation_request = _generation_request(ctx, loaded, body, request.headers.get(LANE_HEADER))
        generation, events = accept(
            ctx, loaded, generation_request, stops=body.stop_strings(), api_fields=_API_FIELDS, stream=body.stream
        )
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        shape = _CompletionShape(id=generation.id, model=ctx.model_name, created=int(time.time()))
        return await respond(
            generation, events, shape, stream=body.stream, include_usage=include_usage, receive=request.receive
        )


def _generation_request(
    ctx: ServingContext, loaded: LoadedModel, body: CompletionRequest, lane_header: str | None
) -> GenerationRequest:
    check_model_name(ctx, body.model)
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


@dataclass(frozen=True)
class _CompletionShape:
    """OpenAI's ``text_completion`` objects, whole and streamed."""

    id: str
    model: str
    created: int

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._head(), "choices": [], "usage": usage.model_dump()}

    def whole(self, text: str, finish_reason: str, usage: Usage) -> CompletionResponse:
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
            usage=usage,
        )

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}
