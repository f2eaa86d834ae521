"""Bodies of the OpenAI-compatible completions API, as pydantic models.

Unknown request fields are ignored (OpenAI clients send fields this server has no use
for), but a known field with an unsupported value is refused with a message naming it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """``POST /v1/completions``. ``lane`` and ``ignore_eos`` are batchpilot extensions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=256, description="Served model name; checked when given.")
    prompt: (
        Annotated[str, Field(max_length=1_000_000)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=1_000_000)]
    ) = Field(description="A text prompt, or a prompt as a list of token ids.")
    max_tokens: int = Field(default=16, ge=1, description="Most tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 samples greedily.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, description="Seed of this request's sampler.")
    stop: str | list[str] | None = Field(default=None, description="Up to 4 strings that end the completion.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="Only one choice per request is supported.")
    echo: Literal[False] = Field(default=False, description="Echoing the prompt is not supported.")
    logprobs: None = Field(default=None, description="Log probabilities are not supported.")
    best_of: int | None = Field(default=None, ge=1, le=1)
    lane: str | None = Field(default=None, min_length=1, max_length=64, description="Priority lane (batchpilot).")
    ignore_eos: bool = Field(default=False, description="Keep generating past the end-of-sequence token.")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else (value or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}")
        for text in strings:
            if not text:
                raise ValueError("stop strings must not be empty")
            if len(text) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


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
