"""``POST /v1/chat/completions``: OpenAI's chat API on the model's own chat template.

The messages become a prompt through the model's chat template (``chat_template``; ChatML when
the model has none). A reply ends at the end-of-sequence token, at an end-of-turn marker the
template writes (``<|im_end|>``: its token id when the tokenizer has it as one token, else as a
stop string), at a client's ``stop`` string (not returned, as OpenAI does), or at the token limit:
``finish_reason`` "stop" or "length". Lanes, streaming, usage and the refusals (429 with
Retry-After, 503 while draining) are those of ``/v1/completions`` (``generation``).

Request fields follow the rule of ``openai_schema`` for both routes: a field the runtime knows but
does not implement (``UNIMPLEMENTED_CHAT_FIELDS``: completions' sampling fields, and tools, log
probabilities, output formats) is refused with a 400 naming it unless null or off
(``presence_penalty: 0``, ``logprobs: false``); a field it does not know is ignored and logged.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LANE_HEADER
from batchpilot_runtime.engine.types import GenerationRequest
from batchpilot_runtime.server.chat_template import ChatTemplate, ChatTemplateError
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
from batchpilot_runtime.server.openai_schema import (
    UNIMPLEMENTED_SAMPLING,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Usage,
    screen_fields,
)
from batchpilot_runtime.server.openapi_doc import SERVING_RESPONSES, json_request_body
from batchpilot_runtime.server.request_body import read_body, validation_error

CHAT_PATH = "/v1/chat/completions"


# The fields of a chat body this runtime does not implement, with the values that mean "off": the
# sampling fields completions refuse too, and the chat API's own (tools, log probabilities, output
# formats and modalities, stored completions).
UNIMPLEMENTED_CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    **UNIMPLEMENTED_SAMPLING,
    "response_format": (None, {"type": "text"}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "metadata": (None,),
    "store": (None, False),
    "service_tier": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
}


def parse_chat_request(raw: bytes) -> ChatCompletionRequest:
    """The body as a ``ChatCompletionRequest``; a 400 naming the first field it cannot serve."""
    payload = decode_json(raw)
    if not isinstance(payload, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(payload).__name__}", param="body")
    screened = screen_fields(payload, ChatCompletionRequest, UNIMPLEMENTED_CHAT_FIELDS)
    if screened.refused:
        raise ApiError(400, screened.refusal(UNIMPLEMENTED_CHAT_FIELDS), param=screened.refused[0])
    log_ignored_fields(CHAT_PATH, screened.ignored)
    if "messages" not in payload:
        raise ApiError(400, "messages: field required", param="messages")
    try:
        body = ChatCompletionRequest.model_validate(payload)
    except ValidationError as error:
        raise validation_error(error) from None
    if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
        raise ApiError(
            400,
            f"max_completion_tokens: {body.max_completion_tokens} conflicts with max_tokens {body.max_tokens}; "
            "give one of them",
            param="max_completion_tokens",
        )
    return body


def add_chat_route(app: FastAPI, ctx: ServingContext) -> None:
    """Registers POST /v1/chat/completions."""

    @app.post(
        CHAT_PATH,
        response_model=ChatCompletionResponse,
        responses=SERVING_RESPONSES,
        openapi_extra=json_request_body(ChatCompletionRequest),
    )
    async def chat_completions(request: Request) -> Response:
        loaded = ready_model(ctx)
        body = parse_chat_request(await read_body(request))
        if ctx.draining:  # the drain may have begun while the body was arriving
            raise draining_error()
        check_model_name(ctx, body.model)
        prepared = _prepare(loaded, body, request.headers.get(LANE_HEADER))
        generation, events = accept(
            ctx,
            loaded,
            prepared.request,
            stops=prepared.stop_strings,
            api_fields=prepared.api_fields,
            stream=body.stream,
        )
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        shape = _ChatShape(id=generation.id, model=ctx.model_name, created=int(time.time()))
        return await respond(
            generation, events, shape, stream=body.stream, include_usage=include_usage, receive=request.receive
        )


@dataclass(frozen=True)
class _Prepared:
    request: GenerationRequest
    stop_strings: tuple[str, ...]
    api_fields: Mapping[str, str]  # the engine's name of a field -> the one the client sent


def _prepare(loaded: LoadedModel, body: ChatCompletionRequest, lane_header: str | None) -> _Prepared:
    tokenizer = loaded.tokenizer
    try:
        template = ChatTemplate(tokenizer.chat_template)
    except ValueError as error:
        raise ApiError(500, f"the model's {error}", kind="server_error") from None
    messages = [_template_message(message.role, message.text(), message.name) for message in body.messages]
    try:
        prompt_ids = template.prompt_token_ids(messages, tokenizer)
    except ChatTemplateError as error:
        raise ApiError(400, f"messages: the model's chat template refused them: {error}", param="messages") from None
    # A marker the tokenizer has as one token ends the reply as a token; spelled in several
    # tokens (bytes, or a model without that special token) it ends it as text.
    marker_ids = {m: ids[0] for m in template.end_of_turn_markers if len(ids := tokenizer.encode(m)) == 1}
    stop_ids = (*tokenizer.stop_token_ids, *marker_ids.values())
    marker_strings = tuple(m for m in template.end_of_turn_markers if m not in marker_ids)
    limit_field = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, loaded.max_model_len - len(prompt_ids))
    request = GenerationRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop_token_ids=() if body.ignore_eos else tuple(dict.fromkeys(stop_ids)),
        lane=body.lane or lane_header or DEFAULT_LANE,
    )
    stops = body.stop_strings() + (() if body.ignore_eos else marker_strings)
    return _Prepared(request, stops, {"prompt_token_ids": "messages", "max_tokens": limit_field})


def _template_message(role: str, content: str, name: str | None) -> dict[str, str]:
    message = {"role": role, "content": content}
    if name is not None:
        message["name"] = name
    return message


@dataclass
class _ChatShape:
    """OpenAI's ``chat.completion`` and ``chat.completion.chunk`` objects. The role rides on the
    first chunk, which is the first token's (so that a client times its first token by it)."""

    id: str
    model: str
    created: int
    _role_sent: bool = field(default=False, init=False)

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta: dict[str, Any] = {} if self._role_sent else {"role": "assistant"}
        self._role_sent = True
        if text or finish_reason is None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._head(), "choices": [], "usage": usage.model_dump()}

    def whole(self, text: str, finish_reason: str, usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChatCompletionChoice(message=ChatCompletionMessage(content=text), finish_reason=finish_reason)],
            usage=usage,
        )

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
