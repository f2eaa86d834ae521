"""The BatchProfile's status: what the operator writes back (the window in force, what it observed,
its last decision, the policy's memory, pods, conditions).

Generated into the CRD's status schema by :mod:`batchpilot_operator.api.crd` alongside the spec of
:mod:`batchpilot_operator.api.profile`.
"""

from __future__ import annotations

from pydantic import Field

from batchpilot_operator.api.canary import CanaryStatus
from batchpilot_operator.api.profile import Friendliness, TuningMode
from batchpilot_operator.api.restart import RestartStatus
from batchpilot_runtime.contract.window import MAX_BATCH_SIZE, MAX_PREFILL_TOKENS_LIMIT, CamelModel, Window


class WindowInForce(Window):
    """The window the operator last decided (what it pushes to the pods)."""

    applied_at: str | None = Field(default=None, description="When this window was decided (RFC 3339).")


class Observed(CamelModel):
    """Figures the last decision was based on. Absent fields were unknown (no data)."""

    p50_ms: float | None = Field(default=None, description="P50 of the SLO's latency metric, ms.")
    p99_ms: float | None = Field(default=None, description="P99 of the SLO's latency metric, ms.")
    p999_ms: float | None = Field(default=None, description="P99.9 of the SLO's latency metric, ms.")
    inter_token_p99_ms: float | None = Field(default=None, description="P99 of the gap between two tokens, ms.")
    queue_depth: float | None = Field(default=None, description="Requests waiting, summed over pods.")
    arrival_rate: float | None = Field(default=None, description="Requests per second arriving.")
    tokens_per_second: float | None = Field(default=None, description="Generated tokens per second.")
    mean_batch_size: float | None = Field(default=None, description="Mean sequences per decode step.")
    batch_hit_ratio: float | None = Field(
        default=None, description="Share of admissions that fired because the target was reached."
    )
    kv_usage: float | None = Field(default=None, description="Highest KV-cache usage ratio among the pods.")
    preemption_rate: float | None = Field(default=None, description="Preemptions per second.")
    at: str | None = Field(default=None, description="When these were observed (RFC 3339).")


class FriendlinessPoint(CamelModel):
    batch_size: int = Field(ge=1, description="Batch-size bucket.")
    tokens_per_second: float = Field(ge=0, description="Decode tokens per second at that batch size.")


class FriendlinessStatus(CamelModel):
    """Measured batch-friendliness (when spec.batchFriendliness is auto)."""

    measured_class: Friendliness | None = Field(default=None, alias="class", description="Measured class.")
    knee_batch_size: int | None = Field(
        default=None, description="Batch size past which throughput stops growing, when found."
    )
    curve: list[FriendlinessPoint] = Field(
        default_factory=list, max_length=16, description="Throughput per batch size."
    )


POLICY_STREAK_LIMIT = 1000
POLICY_CURVE_LIMIT = 16


class StepTimePoint(CamelModel):
    batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE, description="Decode batch-size bucket.")
    step_seconds: float = Field(
        gt=0, allow_inf_nan=False, description="Mean decode step time at that batch size (weighted over intervals)."
    )


class PolicyMemory(CamelModel):
    """What the tuning policy remembers between intervals, kept here so that a restarted operator
    continues where the last one stopped (cooldown, ceilings, confirmations, measured step times)."""

    version: int = Field(
        ge=1, description="Schema version of this block; an operator ignores a version it does not know."
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation of the spec this memory was carried to."
    )
    last_change_time: str | None = Field(
        default=None, description="When the window last changed (RFC 3339, microseconds): the cooldown runs from it."
    )
    kv_cap_ceiling: int | None = Field(
        default=None,
        ge=1,
        le=MAX_BATCH_SIZE,
        description="The cap that preemptions last brought hardCap down to; it is not raised past it until memory is calm.",
    )
    budget_ceiling: int | None = Field(
        default=None,
        ge=1,
        le=MAX_PREFILL_TOKENS_LIMIT,
        description="The prefill budget that too-long inter-token gaps last brought it down to.",
    )
    calm_streak: int = Field(
        default=0, ge=0, le=POLICY_STREAK_LIMIT, description="Intervals in a row without memory pressure."
    )
    itl_calm_streak: int = Field(
        default=0, ge=0, le=POLICY_STREAK_LIMIT, description="Intervals in a row with inter-token gaps within target."
    )
    headroom_streak: int = Field(
        default=0, ge=0, le=POLICY_STREAK_LIMIT, description="Intervals in a row with P99 well under the SLO."
    )
    under_streak: int = Field(
        default=0, ge=0, le=POLICY_STREAK_LIMIT, description="Intervals in a row under 85 % of the SLO."
    )
    step_curve: list[StepTimePoint] = Field(
        default_factory=list,
        max_length=POLICY_CURVE_LIMIT,
        description="Mean decode step time per batch size, from which batch-friendliness is measured.",
    )


class PodsStatus(CamelModel):
    total: int = Field(default=0, ge=0, description="Runtime pods selected.")
    ready: int = Field(default=0, ge=0, description="Selected pods that are Ready.")
    synced: int = Field(default=0, ge=0, description="Ready pods whose window generation is the one in force.")
    summary: str = Field(default="0/0", description="synced/ready, for kubectl get.")


class Decision(CamelModel):
    time: str = Field(description="When the decision was made (RFC 3339).")
    direction: str = Field(description="up, down, hold, reset or recommend.")
    reason: str = Field(description="One sentence saying why.")


class Condition(CamelModel):
    """A condition in the metav1.Condition shape."""

    type: str = Field(description="Ready, Synced, MetricsAvailable or SLOMet.")
    status: str = Field(pattern=r"^(True|False|Unknown)$", description="True, False or Unknown.")
    reason: str = Field(
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024, description="CamelCase reason."
    )
    message: str = Field(default="", max_length=32768, description="Human-readable detail.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, ge=0, description="metadata.generation this was set for.")


class BatchProfileStatus(CamelModel):
    observed_generation: int | None = Field(default=None, description="metadata.generation last acted on.")
    mode: TuningMode | None = Field(
        default=None, description="The tuning mode in force: spec.tuning.mode, or the engine's default when unset."
    )
    window: WindowInForce | None = Field(default=None, description="The window in force.")
    starting_window: str | None = Field(
        default=None,
        max_length=512,
        description="Where the starting window came from: spec.window, or derived from spec.stepCosts and the SLO.",
    )
    observed: Observed | None = Field(default=None, description="Figures of the last observation.")
    friendliness: FriendlinessStatus | None = Field(default=None, description="Measured batch-friendliness.")
    pods: PodsStatus | None = Field(default=None, description="Runtime pods and how many run the window in force.")
    last_decision: Decision | None = Field(default=None, description="The last tuning decision.")
    recommended_window: Window | None = Field(
        default=None, description="In recommend mode: the window the operator would push."
    )
    policy: PolicyMemory | None = Field(
        default=None, description="The tuning policy's memory (cooldown, ceilings, step times), kept across restarts."
    )
    canary: CanaryStatus | None = Field(
        default=None, description="The last canary retune (tuning.canary): running, promoted or rolled back, and why."
    )
    restart: RestartStatus | None = Field(
        default=None, description="tuning.mode restart: what the restart path applied, when, and when it may next."
    )
    conditions: list[Condition] = Field(default_factory=list, max_length=16, description="Standard conditions.")


CONDITION_TYPES = ("Ready", "Synced", "MetricsAvailable", "SLOMet")
