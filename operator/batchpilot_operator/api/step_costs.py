"""``spec.stepCosts``: what one engine step costs on the profile's device, as ``batchpilot-runtime
calibrate`` measures it (or as read off the engine's metrics). A profile that gives no ``window``
starts from one derived from these and its SLO (:mod:`batchpilot_operator.tuning.first_window`)."""

from __future__ import annotations

from pydantic import Field

from batchpilot_runtime.contract.window import CamelModel


class StepCosts(CamelModel):
    """A step's time as a fixed part plus a part per prompt token and per decoding sequence."""

    fixed_ms: float = Field(
        ge=0, le=60_000, description="Time of a step that computes nothing, in milliseconds (calibrate's fixed_s)."
    )
    prefill_us_per_token: float = Field(
        gt=0,
        le=1_000_000,
        description="Time each prompt token adds to a step, in microseconds (calibrate's per_prefill_token_s).",
    )
    decode_us_per_sequence: float = Field(
        default=0.0,
        ge=0,
        le=1_000_000,
        description="Time each decoding sequence adds to a step, in microseconds (calibrate's per_decode_seq_s).",
    )
    source: str = Field(
        default="", max_length=256, description="Where the figures come from (the machine, the calibrate run)."
    )

    @property
    def fixed_s(self) -> float:
        return self.fixed_ms / 1000.0

    @property
    def prefill_s_per_token(self) -> float:
        return self.prefill_us_per_token / 1e6

    @property
    def decode_s_per_sequence(self) -> float:
        return self.decode_us_per_sequence / 1e6
