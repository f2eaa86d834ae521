"""The tuning policy's memory in the resource's status (``status.policy``), and back.

:class:`~batchpilot_operator.tuning.policy.PolicyState` is what the policy remembers between
intervals: the cooldown's start, the memory ceiling of the cap, the budget ceiling, the
streaks that confirm a move, and the measured step time per batch size. The controller puts
it in the status it builds every tick (so it rides on the patch the tick makes anyway, and is
written only when it changed) and reads it back when it adopts a profile, so that a
restarted operator continues instead of letting the cap climb straight back into preemption.

Invariants:

- :func:`restore` of what :func:`to_status` wrote gives the same state, except what the schema
  bounds: streaks stop at ``POLICY_STREAK_LIMIT`` (every threshold of the policy is far
  below it), the step curve keeps its ``POLICY_CURVE_LIMIT`` smallest batch sizes (the runtime
  exports 13), the last change time is kept to the microsecond, and ``decisions`` (a count
  nothing reads; kept, it would make every interval a status patch) starts at 0.
- :func:`restore` never raises: an unknown version or anything that does not validate gives a
  fresh state and says why, once, for the caller to log.
- A last change later than now (the clock of an earlier replica's node was ahead) counts as
  now, so a restored cooldown never outlasts ``cooldownSeconds``.
- A memory written for another ``metadata.generation`` (the spec changed while no operator
  ran) goes through :func:`carry_over`, the same rule the controller applies when the spec
  changes under a running operator: a restart across a spec change ends where no restart does.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from batchpilot_operator.api.profile import BatchProfileSpec, format_validation_error
from batchpilot_operator.api.status import POLICY_CURVE_LIMIT, POLICY_STREAK_LIMIT, PolicyMemory, StepTimePoint
from batchpilot_operator.tuning.policy import PolicyState
from batchpilot_runtime.contract.window import MAX_BATCH_SIZE, MAX_PREFILL_TOKENS_LIMIT

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Restored:
    """A state read back from status. ``problem``: why the memory written there was not used
    (a fresh state then); ``carried_over``: it was written for another generation of the spec."""

    state: PolicyState
    problem: str | None = None
    carried_over: bool = False


def to_status(state: PolicyState, generation: int | None) -> PolicyMemory | None:
    """The ``status.policy`` block for this state (None when there is nothing to remember).

    Values the schema cannot hold are bounded rather than refused: a status that cannot be
    built would stop the whole status of the profile from being written.
    """
    curve = [
        StepTimePoint(batch_size=batch, step_seconds=step_s)
        for batch, step_s in state.step_curve
        if 1 <= batch <= MAX_BATCH_SIZE and math.isfinite(step_s) and step_s > 0
    ][:POLICY_CURVE_LIMIT]
    memory = PolicyMemory(
        version=SCHEMA_VERSION,
        observed_generation=generation if generation is not None and generation >= 0 else None,
        last_change_time=_time_text(state.last_change_s),
        kv_cap_ceiling=_bounded(state.kv_cap_ceiling, MAX_BATCH_SIZE),
        budget_ceiling=_bounded(state.budget_ceiling, MAX_PREFILL_TOKENS_LIMIT),
        calm_streak=_streak(state.calm_streak),
        itl_calm_streak=_streak(state.itl_calm_streak),
        headroom_streak=_streak(state.headroom_streak),
        under_streak=_streak(state.under_streak),
        step_curve=curve,
    )
    if memory == PolicyMemory(version=SCHEMA_VERSION, observed_generation=memory.observed_generation):
        return None
    return memory


def restore(
    status: Mapping[str, Any] | None, spec: BatchProfileSpec | None, generation: int | None, now_s: float
) -> Restored:
    """The state kept in ``status.policy``, or a fresh one (with the reason) when it cannot be used.

    ``spec`` and ``generation`` are the profile's now; ``now_s`` the wall clock (epoch seconds).
    """
    raw = status.get("policy") if isinstance(status, Mapping) else None
    if raw is None:
        return Restored(PolicyState())
    if not isinstance(raw, Mapping):
        return Restored(PolicyState(), f"status.policy is a {type(raw).__name__}, not an object")
    version = raw.get("version")
    if type(version) is not int or version != SCHEMA_VERSION:
        return Restored(
            PolicyState(), f"status.policy.version is {repr(version)[:40]}; this operator knows {SCHEMA_VERSION}"
        )
    try:
        memory = PolicyMemory.model_validate(raw)
        last_change_s = _parse_time(memory.last_change_time)
    except ValidationError as error:
        return Restored(PolicyState(), format_validation_error(error, "status.policy"))
    except ValueError as error:
        return Restored(PolicyState(), f"status.policy.lastChangeTime: {error}")
    curve = {point.batch_size: point.step_seconds for point in memory.step_curve}
    state = PolicyState(
        last_change_s=None if last_change_s is None else min(last_change_s, now_s),
        headroom_streak=memory.headroom_streak,
        under_streak=memory.under_streak,
        calm_streak=memory.calm_streak,
        kv_cap_ceiling=memory.kv_cap_ceiling,
        budget_ceiling=memory.budget_ceiling,
        itl_calm_streak=memory.itl_calm_streak,
        step_curve=tuple(sorted(curve.items())),
    )
    if spec is not None and memory.observed_generation != generation:
        return Restored(carry_over(state, spec), carried_over=True)
    return Restored(state)


def carry_over(state: PolicyState, spec: BatchProfileSpec) -> PolicyState:
    """The state once the spec has changed to ``spec``.

    Kept: what is a fact about the model on its pods, whatever the spec says. The step curve
    (step time per batch size) and the memory ceiling of the cap (the batch at which the KV
    cache ran out) are such facts, and forgetting the ceiling is what would send the cap back
    into preemption; so are the memory-calm streak that lifts it and the last change (the pods'
    window moved then). The ceilings are clamped into the new bounds: one at or above a new
    maximum no longer limits anything (None, as the policy itself lifts it there), one below a
    new minimum rises to it (the bounds win, as everywhere in the policy).

    Reset: what was judged against the old SLO. The headroom and under-SLO streaks (which
    confirm raises of target and wait) and the calm streak of the gaps (which lifts the budget
    ceiling) measured P99s against targets that may have moved; starting them again only delays
    raises, never a cut.
    """
    bounds = spec.tuning.bounds
    kv = state.kv_cap_ceiling
    if kv is not None:
        cap_floor = max(bounds.hard_cap.min, bounds.target_batch_size.min)
        kv = None if kv >= bounds.hard_cap.max else max(kv, cap_floor)
    budget = state.budget_ceiling
    if budget is not None:
        budget_bound = bounds.max_prefill_tokens
        budget = None if budget >= budget_bound.max else max(budget, budget_bound.min)
    return replace(
        state, kv_cap_ceiling=kv, budget_ceiling=budget, headroom_streak=0, under_streak=0, itl_calm_streak=0
    )


def _streak(value: int) -> int:
    return max(0, min(POLICY_STREAK_LIMIT, value))


def _bounded(value: int | None, limit: int) -> int | None:
    return None if value is None else max(1, min(limit, value))


def _time_text(epoch_s: float | None) -> str | None:
    if epoch_s is None or not math.isfinite(epoch_s):
        return None
    try:
        moment = datetime.datetime.fromtimestamp(epoch_s, tz=datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return None
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: str | None) -> float | None:
    if text is None:
        return None
    moment = datetime.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return moment.timestamp()


__all__ = ["SCHEMA_VERSION", "Restored", "carry_over", "restore", "to_status"]
