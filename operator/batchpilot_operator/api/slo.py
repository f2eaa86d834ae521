"""What a BatchProfile's window is tuned for and how: the SLO and the tuning settings.

Part of the BatchProfile models (``batchpilot_operator.api.profile`` re-exports them).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from batchpilot_operator.api.bounds import WindowBounds, cel_rules
from batchpilot_operator.api.canary import Canary
from batchpilot_operator.api.kinds import LatencyMetric, TuningMode
from batchpilot_runtime.contract.window import CamelModel


class SLO(CamelModel):
    """The latency objectives the operator keeps the window under: a first-token (or queue-wait,
    or end-to-end) P99, an inter-token P99, or both at once."""

    model_config = cel_rules(
        (
            "has(self.p99Ms) || has(self.interTokenP99Ms)",
            "slo needs at least one objective: p99Ms or interTokenP99Ms",
        ),
        ("!has(self.p999Ms) || has(self.p99Ms)", "slo.p999Ms needs slo.p99Ms"),
        (
            "!has(self.p999Ms) || !has(self.p99Ms) || self.p999Ms >= self.p99Ms",
            "slo.p999Ms must be greater than or equal to slo.p99Ms",
        ),
    )

    latency_metric: LatencyMetric = Field(
        default=LatencyMetric.TTFT,
        description="Which latency p99Ms and p999Ms bound: ttft (time to first token), queueWait, or e2e (whole request).",
    )
    p99_ms: float | None = Field(
        default=None,
        gt=0,
        le=3_600_000,
        description="Target 99th-percentile latency in milliseconds (of latencyMetric).",
    )
    p999_ms: float | None = Field(
        default=None,
        gt=0,
        le=3_600_000,
        description="Optional target 99.9th-percentile latency in milliseconds; needs p99Ms.",
    )
    inter_token_p99_ms: float | None = Field(
        default=None,
        gt=0,
        le=60_000,
        description=(
            "Target 99th-percentile inter-token latency in milliseconds (the gap between two streamed "
            "tokens of one request), alone or together with p99Ms. With it the operator tunes "
            "window.maxPrefillTokens, the lever that trades first tokens against inter-token gaps."
        ),
    )

    @model_validator(mode="after")
    def _objectives(self) -> SLO:
        if self.p99_ms is None and self.inter_token_p99_ms is None:
            raise ValueError("slo needs at least one objective: p99Ms or interTokenP99Ms")
        if self.p999_ms is not None:
            if self.p99_ms is None:
                raise ValueError("slo.p999Ms needs slo.p99Ms")
            if self.p999_ms < self.p99_ms:
                raise ValueError(
                    f"slo.p999Ms ({self.p999_ms:g}) must be greater than or equal to slo.p99Ms ({self.p99_ms:g})"
                )
        return self


class Tuning(CamelModel):
    """How the operator tunes the window."""

    mode: TuningMode | None = Field(
        default=None,
        description=(
            "adaptive: retune and push; recommend: compute and report in status but never push; "
            "static: push spec.window as it is; restart (vllm, sglang, llamacpp): patch the workload's args "
            "with the recommendation and let it roll, within spec.restart's budget. Unset: adaptive, or "
            "recommend for vllm and llamacpp (their knobs are start-up flags); never restart."
        ),
    )
    interval_seconds: int = Field(
        default=15, ge=5, le=3600, description="Seconds between two observations and decisions."
    )
    bounds: WindowBounds = Field(default_factory=WindowBounds, description="Limits of each window field.")
    max_step_fraction: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="Largest relative change of any window field in one decision (0.5 = at most +/-50 %).",
    )
    cooldown_seconds: int = Field(default=30, ge=0, le=3600, description="Least time between two window changes.")
    canary: Canary = Field(
        default_factory=Canary,
        description="Canary retunes: a new window runs on a share of the pods first (docs/canary.md).",
    )
