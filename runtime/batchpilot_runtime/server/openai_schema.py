"""Bodies of the OpenAI-compatible completions and chat completions APIs, as pydantic models.

One rule for a request's top-level fields, on both routes (``screen_fields``), the one vLLM's
clients expect: a field this server does not know is ignored (and logged), as vLLM ignores it,
since clients of vLLM-compatible servers send their own extensions; a field it knows but does not
implement (the tables below: other servers' sampling settings, tools, output formats) is refused
with a 400 naming it, unless null or a value that asks for nothing, since served without it the
text would not be what was asked and nothing would say so. Inside a chat message every member is
known or refused (``extra="forbid"``): an unknown member there changes what the conversation says.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from batchpilot_runtime.model.sampling_ranges import MAX_TOP_P, MIN_TEMPERATURE, SEED_LIMIT

MAX_STOP_STRINGS = 4
# The sampling fields' bounds are the sampler's own (``model.sampling_ranges``), narrowed here for clients:
# temperature to OpenAI's 2, and the seed to the largest integer a double holds exactly (as the
# window's generation): a JavaScript client cannot send a larger one exactly, and readers of the
# OpenAPI document that parse numbers as doubles (the API fuzzer among them) misread bounds near 2^63
# and drew seeds past them.
MAX_TEMPERATURE = 2.0
MAX_SEED = min(2**53 - 1, SEED_LIMIT - 1)
MAX_STOP_STRING_CHARS = 256


# In the field's type, not a validator, so that the OpenAPI document says what is refused.
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopStrings = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None


def stop_tuple(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


# Sampling fields of OpenAI's, vLLM's, llama.cpp's and text-generation servers' completions that this
# runtime does not implement, with the values that mean "off". A client that sends an off value (LangChain sends presence_penalty: 0 and
# logit_bias: {} by default) is served; any other value is refused naming the field, since the text
# would otherwise be sampled differently from what was asked and nothing would say so.
UNIMPLEMENTED_SAMPLING: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "length_penalty": (None, 1),
    "logit_bias": (None, {}),
    "top_k": (None, 0, -1),
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "suffix": (None, ""),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    "response_format": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "logits_processors": (None, []),
    "include_stop_str_in_output": (None, False),
    "truncate_prompt_tokens": (None,),
    # llama.cpp's server and text-generation front ends (the samplers a client of those may send).
    "typical_p": (None, 1),
    "tfs_z": (None, 1),
    "tfs": (None, 1),
    "top_a": (None, 0),
    "top_n_sigma": (None, -1),
    "mirostat": (None, 0),
    "mirostat_mode": (None, 0),
    "repeat_penalty": (None, 1),
    "dynatemp_range": (None, 0),
    "dry_multiplier": (None, 0),
    "xtc_probability": (None, 0),
    "epsilon_cutoff": (None, 0),
    "eta_cutoff": (None, 0),
    "smoothing_factor": (None, 0),
    "penalty_alpha": (None, 0),
    "n_probs": (None, 0),
    "grammar": (None, ""),
    "json_schema": (None,),
}


def _is_off(value: Any, neutral: tuple[Any, ...]) -> bool:
    # A bool is an int in Python: true must not pass for a repetition_penalty of 1, nor 0 for false.
    if isinstance(value, bool):
        return any(value is off for off in neutral)
    return any(value == off and not isinstance(off, bool) for off in neutral)


def unimplemented_sampling_fields(
    payload: Mapping[str, Any], table: Mapping[str, tuple[Any, ...]] = UNIMPLEMENTED_SAMPLING
) -> list[str]:
    """The fields of a body that ask for what this runtime does not implement (by default the
    sampling fields of a completion; the chat route passes its own, larger table)."""
    return [name for name, neutral in table.items() if name in payload and not _is_off(payload[name], neutral)]


def neutral_values(name: str, table: Mapping[str, tuple[Any, ...]] = UNIMPLEMENTED_SAMPLING) -> str:
    """What a refused field may hold instead, for the error message."""
    shown = " or ".join(json.dumps(value) for value in table[name])
    return f"leave it out or send {shown}"


@dataclass(frozen=True)
class ScreenedFields:
    """A body's top-level fields under the rule of this module: those refused (known, not
    implemented, not off) and those ignored (unknown)."""

    refused: list[str]
    ignored: list[str]

    def refusal(self, table: Mapping[str, tuple[Any, ...]]) -> str:
        return "; ".join(
            f"{name}: not supported by this runtime ({neutral_values(name, table)})" for name in self.refused
        )


def screen_fields(
    payload: Mapping[str, Any], model: type[BaseModel], table: Mapping[str, tuple[Any, ...]] = UNIMPLEMENTED_SAMPLING
) -> ScreenedFields:
    """The rule for both routes: ``table``'s fields that ask for something are refused, fields
    neither ``model`` nor ``table`` knows are ignored."""
    known = model.model_fields
    return ScreenedFields(
        refused=unimplemented_sampling_fields(payload, table),
        ignored=[name for name in payload if name not in known and name not in table],
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """``POST /v1/completions``. ``lane`` and ``ignore_eos`` are batchpilot extensions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=256, description="Served model name; checked when given.")
    prompt: (
        Annotated[str, Field(min_length=1, max_length=1_000_000)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=1_000_000)]
    ) = Field(description="A text prompt, or a prompt as a list of token ids.")
    max_tokens: int = Field(default=16, ge=1, description="Most tokens to generate.")
    temperature: float = Field(default=1.0, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, description="0 samples greedily.")
    top_p: float = Field(default=1.0, gt=0.0, le=MAX_TOP_P)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED, description="Seed of this request's sampler.")
    stop: StopStrings = Field(default=None, description="Up to 4 strings that end the completion.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="Only one choice per request is supported.")
    echo: Literal[False] = Field(default=False, description="Echoing the prompt is not supported.")
    logprobs: None = Field(default=None, description="Log probabilities are not supported.")
    best_of: int | None = Field(default=None, ge=1, le=1)
    lane: str | None = Field(default=None, min_length=1, max_length=64, description="Priority lane (batchpilot).")
    ignore_eos: bool = Field(default=False, description="Keep generating past the end-of-sequence token.")
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """A whole completion, or (with ``object="text_completion"`` and one delta) one SSE chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TextPart(BaseModel):
    """One part of a message's content; text is the only kind a text model reads."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str = Field(max_length=1_000_000)


class ChatMessage(BaseModel):
    """A message of the conversation. A list of text parts is joined with newlines, as vLLM does
    for templates that expect text."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=1_000_000)] | Annotated[list[TextPart], Field(max_length=1024)]
    name: str | None = Field(default=None, min_length=1, max_length=256, description="Passed to the template.")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``. ``lane`` and ``ignore_eos`` are batchpilot extensions; other
    fields follow the module's rule."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=256, description="Served model name; checked when given.")
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000, description="The conversation so far.")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens to generate; by default the rest of the context."
    )
    max_tokens: int | None = Field(default=None, ge=1, description="The older name of max_completion_tokens.")
    temperature: float = Field(default=1.0, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, description="0 samples greedily.")
    top_p: float = Field(default=1.0, gt=0.0, le=MAX_TOP_P)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED, description="Seed of this request's sampler.")
    stop: StopStrings = Field(default=None, description="Up to 4 strings that end the reply.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="Only one choice per request is supported.")
    lane: str | None = Field(default=None, min_length=1, max_length=64, description="Priority lane (batchpilot).")
    ignore_eos: bool = Field(
        default=False, description="Keep generating past the end-of-sequence and end-of-turn tokens (batchpilot)."
    )
    user: str | None = Field(default=None, max_length=256)

    def stop_strings(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    """A whole chat completion; streamed, each chunk is a ``chat.completion.chunk`` with a ``delta``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchpilot"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, so that OpenAI clients raise their typed errors."""

    error: ErrorDetail
