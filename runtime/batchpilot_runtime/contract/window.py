"""The batching window: the wire contract between the operator and the runtime.

A window is what the operator tunes and the runtime applies between two steps.
This module imports neither torch nor a web framework.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator
from pydantic.alias_generators import to_camel

MAX_BATCH_SIZE = 4096
MAX_WAIT_MS_LIMIT = 60_000
MAX_TAIL_MARK_RATIO = 100.0
MAX_PREFILL_TOKENS_LIMIT = 262_144
# The largest generation: the largest integer a double holds exactly, so that the runtime's
# ``batchpilot_window_generation`` gauge and JavaScript clients carry every generation as it is. One
# window a second would take 285 million years to reach it; a push beyond it is refused (422) rather
# than put in force, where no later generation could pass it.
MAX_GENERATION = 2**53 - 1


class CamelModel(BaseModel):
    """Base for wire models: camelCase on the wire, snake_case in Python, no unknown fields."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


def target_within_cap_problem(target_batch_size: int, hard_cap: int) -> str | None:
    """The window's one rule between fields (the CRD states it in CEL too), or None when it holds."""
    if target_batch_size > hard_cap:
        return f"targetBatchSize ({target_batch_size}) must be less than or equal to hardCap ({hard_cap})"
    return None


class WindowFields(CamelModel):
    """The fields of a batching window, without a generation.

    Invariants: 1 <= targetBatchSize <= hardCap, maxWaitMs >= 0, tailMarkRatio > 1,
    maxPrefillTokens >= 1 or unset (the pod's start-up budget; none = whole prompts).
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.targetBatchSize <= self.hardCap",
                    "message": "targetBatchSize must be less than or equal to hardCap",
                }
            ]
        }
    )

    target_batch_size: int = Field(
        ge=1,
        le=MAX_BATCH_SIZE,
        description=(
            "Batch size the scheduler waits for: a group of waiting requests is admitted as soon as "
            "the running set would reach this many sequences."
        ),
    )
    hard_cap: int = Field(
        ge=1,
        le=MAX_BATCH_SIZE,
        description=(
            "Most sequences that may run at once. Reaching it admits at once; it bounds step time and KV-cache memory."
        ),
    )
    max_wait_ms: int = Field(
        ge=0,
        le=MAX_WAIT_MS_LIMIT,
        description=(
            "Longest time in milliseconds the oldest waiting request waits for the target to fill "
            "before it is admitted anyway."
        ),
    )
    tail_mark_ratio: float = Field(
        default=2.0,
        gt=1.0,
        le=MAX_TAIL_MARK_RATIO,
        description=(
            "A request that has waited longer than this multiple of the rolling P50 queue wait is "
            "marked as a tail request and admitted first."
        ),
    )
    max_prefill_tokens: int | None = Field(
        default=None,
        ge=1,
        le=MAX_PREFILL_TOKENS_LIMIT,
        description=(
            "Prompt tokens one step may prefill (chunked prefill; decodes do not count). Smaller keeps "
            "running sequences' inter-token gaps short, larger gets first tokens out sooner. Unset: the "
            "pod's start-up budget (whole prompts when it has none). vLLM: max_num_batched_tokens; "
            "SGLang: chunked_prefill_size."
        ),
    )

    @model_validator(mode="after")
    def _target_within_cap(self) -> WindowFields:
        problem = target_within_cap_problem(self.target_batch_size, self.hard_cap)
        if problem:
            raise ValueError(problem)
        return self

    @model_serializer(mode="wrap")
    def _leave_out_unset_budget(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # An unset budget is left out of the wire form rather than sent as null: a runtime that
        # predates the field still accepts the window, and a merge patch of status keeps no null.
        data: dict[str, Any] = handler(self)
        for key in ("maxPrefillTokens", "max_prefill_tokens"):
            if key in data and data[key] is None:
                del data[key]
        return data

    def fields_equal(self, other: WindowFields) -> bool:
        """True when both windows have the same fields, whatever their generations."""
        return (
            self.target_batch_size == other.target_batch_size
            and self.hard_cap == other.hard_cap
            and self.max_wait_ms == other.max_wait_ms
            and self.tail_mark_ratio == other.tail_mark_ratio
            and self.max_prefill_tokens == other.max_prefill_tokens
        )


class Window(WindowFields):
    """A window with the generation that orders updates: a runtime refuses an older one."""

    generation: int = Field(
        default=0,
        ge=0,
        le=MAX_GENERATION,
        description="Monotonic version of the window; a runtime refuses a generation older than the one in force.",
    )

    def with_generation(self, generation: int) -> Window:
        return self.model_copy(update={"generation": generation})

    @classmethod
    def from_fields(cls, fields: WindowFields, generation: int) -> Window:
        return cls(
            target_batch_size=fields.target_batch_size,
            hard_cap=fields.hard_cap,
            max_wait_ms=fields.max_wait_ms,
            tail_mark_ratio=fields.tail_mark_ratio,
            max_prefill_tokens=fields.max_prefill_tokens,
            generation=generation,
        )

    def describe(self) -> str:
        budget = "" if self.max_prefill_tokens is None else f" budget={self.max_prefill_tokens}"
        return (
            f"target={self.target_batch_size} cap={self.hard_cap} wait={self.max_wait_ms}ms "
            f"tail={self.tail_mark_ratio:g}x{budget} gen={self.generation}"
        )
