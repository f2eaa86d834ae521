"""The tuning bounds of a BatchProfile: min..max ranges and the bounds of each window field.

Part of the BatchProfile models (``batchpilot_operator.api.profile`` re-exports
every name here); the CRD schema is generated from these classes, so their
field descriptions and CEL rules are the ones ``kubectl explain`` shows. A
range's ``min`` never exceeds its ``max``: both the schema's CEL rule and the
model validator refuse it. Each window field has its own range class whose ``min``
and ``max`` carry that field's defaults, so that a range given in part
(``maxWaitMs: {max: 2000}``) takes the other end from the defaults, here and, through
the schema's ``default``, in the API server alike.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from batchpilot_runtime.contract.window import (
    MAX_PREFILL_TOKENS_LIMIT,
    MAX_WAIT_MS_LIMIT,
    CamelModel,
    WindowFields,
)


def cel_rules(*rules: tuple[str, str]) -> ConfigDict:
    """Model config that carries CEL rules, each ``(rule, message)``, into the generated CRD schema."""
    return ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in rules]}
    )


def _disorder(low: float, high: float, given: set[str]) -> str:
    """The message for min > max, saying which end came from the defaults (a range given in part)."""
    low_text = f"{low:g}" if "min" in given else f"{low:g}, the default"
    high_text = f"{high:g}" if "max" in given else f"{high:g}, the default"
    hint = "" if {"min", "max"} <= given else "; give both ends"
    return f"min ({low_text}) must be less than or equal to max ({high_text}){hint}"


class _OrderedIntRange(CamelModel):
    """A min..max pair of integers (the fields and their limits are the subclass's)."""

    min: int
    max: int

    @model_validator(mode="after")
    def _ordered(self) -> _OrderedIntRange:
        if self.min > self.max:
            raise ValueError(_disorder(self.min, self.max, self.model_fields_set))
        return self

    def clamp(self, value: int) -> int:
        return max(self.min, min(self.max, value))

    def contains(self, value: float) -> bool:
        return self.min <= value <= self.max


class IntRange(_OrderedIntRange):
    model_config = cel_rules(("self.min <= self.max", "min must be less than or equal to max"))

    min: int = Field(ge=0, le=MAX_WAIT_MS_LIMIT, description="Lowest value the operator may set.")
    max: int = Field(ge=0, le=MAX_WAIT_MS_LIMIT, description="Highest value the operator may set.")


class TokenRange(_OrderedIntRange):
    model_config = cel_rules(("self.min <= self.max", "min must be less than or equal to max"))

    min: int = Field(ge=1, le=MAX_PREFILL_TOKENS_LIMIT, description="Lowest value the operator may set.")
    max: int = Field(ge=1, le=MAX_PREFILL_TOKENS_LIMIT, description="Highest value the operator may set.")


class FloatRange(CamelModel):
    model_config = cel_rules(("self.min <= self.max", "min must be less than or equal to max"))

    min: float = Field(gt=1.0, le=100.0, description="Lowest value the operator may set.")
    max: float = Field(gt=1.0, le=100.0, description="Highest value the operator may set.")

    @model_validator(mode="after")
    def _ordered(self) -> FloatRange:
        if self.min > self.max:
            raise ValueError(_disorder(self.min, self.max, self.model_fields_set))
        return self

    def clamp(self, value: float) -> float:
        return max(self.min, min(self.max, value))

    def contains(self, value: float) -> bool:
        return self.min <= value <= self.max


_LOWEST = "Lowest value the operator may set"
_HIGHEST = "Highest value the operator may set"


class TargetBatchSizeRange(IntRange):
    min: int = Field(default=1, ge=0, le=MAX_WAIT_MS_LIMIT, description=f"{_LOWEST}.")
    max: int = Field(default=256, ge=0, le=MAX_WAIT_MS_LIMIT, description=f"{_HIGHEST}.")


class HardCapRange(IntRange):
    min: int = Field(default=1, ge=0, le=MAX_WAIT_MS_LIMIT, description=f"{_LOWEST}.")
    max: int = Field(default=512, ge=0, le=MAX_WAIT_MS_LIMIT, description=f"{_HIGHEST}.")


class MaxWaitMsRange(IntRange):
    min: int = Field(default=0, ge=0, le=MAX_WAIT_MS_LIMIT, description=f"{_LOWEST}, ms.")
    max: int = Field(default=500, ge=0, le=MAX_WAIT_MS_LIMIT, description=f"{_HIGHEST}, ms.")


class TailMarkRatioRange(FloatRange):
    min: float = Field(default=1.5, gt=1.0, le=100.0, description=f"{_LOWEST}.")
    max: float = Field(default=4.0, gt=1.0, le=100.0, description=f"{_HIGHEST}.")


class MaxPrefillTokensRange(TokenRange):
    min: int = Field(default=128, ge=1, le=MAX_PREFILL_TOKENS_LIMIT, description=f"{_LOWEST}.")
    max: int = Field(default=16_384, ge=1, le=MAX_PREFILL_TOKENS_LIMIT, description=f"{_HIGHEST}.")


class WindowBounds(CamelModel):
    """How far the operator may move each field of the window."""

    target_batch_size: TargetBatchSizeRange = Field(
        default_factory=TargetBatchSizeRange,
        description="Range of targetBatchSize the operator may choose; an end left out takes its default.",
    )
    hard_cap: HardCapRange = Field(
        default_factory=HardCapRange,
        description="Range of hardCap the operator may choose; an end left out takes its default.",
    )
    max_wait_ms: MaxWaitMsRange = Field(
        default_factory=MaxWaitMsRange,
        description="Range of maxWaitMs the operator may choose; an end left out takes its default.",
    )
    tail_mark_ratio: TailMarkRatioRange = Field(
        default_factory=TailMarkRatioRange,
        description="Range of tailMarkRatio the operator may choose; an end left out takes its default.",
    )
    max_prefill_tokens: MaxPrefillTokensRange = Field(
        default_factory=MaxPrefillTokensRange,
        description=(
            "Range of maxPrefillTokens the operator may choose (it sets one only for an SLO with "
            "interTokenP99Ms; an unset budget stays unset otherwise); an end left out takes its default."
        ),
    )

    def fields_outside(self, window: WindowFields) -> list[str]:
        """Names of the window fields that lie outside these bounds (empty when all inside)."""
        outside = []
        if not self.target_batch_size.contains(window.target_batch_size):
            outside.append("targetBatchSize")
        if not self.hard_cap.contains(window.hard_cap):
            outside.append("hardCap")
        if not self.max_wait_ms.contains(window.max_wait_ms):
            outside.append("maxWaitMs")
        if not self.tail_mark_ratio.contains(window.tail_mark_ratio):
            outside.append("tailMarkRatio")
        if window.max_prefill_tokens is not None and not self.max_prefill_tokens.contains(window.max_prefill_tokens):
            outside.append("maxPrefillTokens")
        return outside

    def ranges_text(self, names: list[str]) -> list[str]:
        """One phrase per named window field giving its range, e.g. ``hardCap bounds are 1..512``."""
        ranges: dict[str, IntRange | FloatRange | TokenRange] = {
            "targetBatchSize": self.target_batch_size,
            "hardCap": self.hard_cap,
            "maxWaitMs": self.max_wait_ms,
            "tailMarkRatio": self.tail_mark_ratio,
            "maxPrefillTokens": self.max_prefill_tokens,
        }
        return [f"{name} bounds are {ranges[name].min:g}..{ranges[name].max:g}" for name in names]
