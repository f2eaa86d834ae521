"""The tuning bounds of a BatchProfile: min..max ranges and the bounds of each window field.

Part of the BatchProfile models (``batchpilot_operator.api.profile`` re-exports
every name here); the CRD schema is generated from these classes, so their
field descriptions and CEL rules are the ones ``kubectl explain`` shows. A
range's ``min`` never exceeds its ``max``: both the schema's CEL rule and the
model validator refuse it.
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


class _OrderedIntRange(CamelModel):
    """A min..max pair of integers (the fields and their limits are the subclass's)."""

    min: int
    max: int

    @model_validator(mode="after")
    def _ordered(self) -> _OrderedIntRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be less than or equal to max ({self.max})")
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
            raise ValueError(f"min ({self.min:g}) must be less than or equal to max ({self.max:g})")
        return self

    def clamp(self, value: float) -> float:
        return max(self.min, min(self.max, value))

    def contains(self, value: float) -> bool:
        return self.min <= value <= self.max


def _int_range(lo: int, hi: int) -> IntRange:
    return IntRange(min=lo, max=hi)


class WindowBounds(CamelModel):
    """How far the operator may move each field of the window."""

    target_batch_size: IntRange = Field(
        default_factory=lambda: _int_range(1, 256),
        description="Range of targetBatchSize the operator may choose.",
    )
    hard_cap: IntRange = Field(
        default_factory=lambda: _int_range(1, 512),
        description="Range of hardCap the operator may choose.",
    )
    max_wait_ms: IntRange = Field(
        default_factory=lambda: _int_range(0, 500),
        description="Range of maxWaitMs the operator may choose.",
    )
    tail_mark_ratio: FloatRange = Field(
        default_factory=lambda: FloatRange(min=1.5, max=4.0),
        description="Range of tailMarkRatio the operator may choose.",
    )
    max_prefill_tokens: TokenRange = Field(
        default_factory=lambda: TokenRange(min=128, max=16_384),
        description=(
            "Range of maxPrefillTokens the operator may choose (it sets one only for an SLO with "
            "interTokenP99Ms; an unset budget stays unset otherwise)."
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
