"""``spec.tuning.canary`` and ``status.canary``: a retune tried on a share of the pods before all of them.

The rule that judges a canary, and the loop that runs it, are in
:mod:`batchpilot_operator.control.canary`; docs/canary.md explains both to users.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, JsonValue

from batchpilot_operator.api.kinds import EngineKind, TuningMode
from batchpilot_runtime.contract.window import CamelModel, Window

CANARY_MESSAGE = "tuning.canary.enabled needs engine batchpilot and tuning.mode adaptive (or unset)"

# The CEL form of canary_problems, for the spec's x-kubernetes-validations.
CANARY_RULE: dict[str, JsonValue] = {
    "rule": "!has(self.tuning) || !has(self.tuning.canary) || !has(self.tuning.canary.enabled) || "
    "!self.tuning.canary.enabled || ((!has(self.engine) || self.engine == 'batchpilot') && "
    "(!has(self.tuning.mode) || self.tuning.mode == 'adaptive'))",
    "message": CANARY_MESSAGE,
}

CanaryVerdict = Literal["running", "promoted", "rolledBack"]


class Canary(CamelModel):
    """A new window runs on the canary pods first; it goes to every pod when they keep the SLO as well as
    the others for ``intervals`` intervals, and is rolled back on them otherwise."""

    enabled: bool = Field(
        default=False,
        description=(
            "Send each new window to the canary pods first (adaptive mode, engine batchpilot). Off by default: "
            "it needs two pods or more to compare, and adds a per-pod latency query while a canary runs."
        ),
    )
    share: float = Field(
        default=0.25,
        ge=0.1,
        le=0.5,
        description=(
            "Share of the Ready pods that run a new window first: at least one pod, never all of them when "
            "there are two or more."
        ),
    )
    intervals: int = Field(
        default=3,
        ge=1,
        le=20,
        description=(
            "Intervals whose per-pod P99s must pass before the window goes to every pod. A canary that "
            "breaks an objective the other pods meet is rolled back at once; as many intervals in a row "
            "without the canary pods' data roll it back too."
        ),
    )


def canary_problems(canary: Canary, engine: str, mode: str) -> list[str]:
    """The rule of :data:`CANARY_RULE`, checked on the parsed spec (``engine`` and the mode in force)."""
    if canary.enabled and (engine != EngineKind.BATCHPILOT or mode != TuningMode.ADAPTIVE):
        return [f"{CANARY_MESSAGE}; got engine {engine}, tuning.mode {mode}"]
    return []


class CanaryStatus(CamelModel):
    """The last canary: the window it tried, on which pods, and how it ended (or that it still runs)."""

    window: Window = Field(description="The window the canary pods ran.")
    pods: list[str] = Field(default_factory=list, max_length=256, description="The canary pods (names).")
    started_at: str = Field(description="When the canary pods were sent the window (RFC 3339).")
    verdict: CanaryVerdict = Field(description="running, promoted (sent to every pod) or rolledBack.")
    reason: str = Field(default="", max_length=4096, description="One sentence saying why.")
    passed_intervals: int = Field(default=0, ge=0, description="Intervals the canary has passed so far.")
