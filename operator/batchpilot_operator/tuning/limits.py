"""How far one decision may move a window field, and the bounds it must stay within.

A field moves at most ``maxStepFraction`` of its value per decision, or one unit (one sequence,
5 ms, 0.1) when that is larger, so that a field at 0 or 1 can move at all; every value these
functions return lies within the bounds they are given.
"""

from __future__ import annotations

import math

from batchpilot_operator.api.profile import BatchProfileSpec, Friendliness, WindowBounds
from batchpilot_operator.tuning.friendliness import CLASS_CAP_CEILING, FriendlinessEstimate
from batchpilot_runtime.contract.window import Window

WAIT_MIN_STEP_MS = 5
RATIO_MIN_STEP = 0.1
SIZE_MIN_STEP = 1


def allowed_step(old: float, fraction: float, min_step: float) -> float:
    """Largest change of a field in one decision: ``fraction`` of it, or ``min_step``."""
    return max(abs(old) * fraction, min_step)


def _limit_whole(old: int, desired: float, step: float, lo: int, hi: int) -> int:
    if desired > old:
        value = min(math.floor(desired), math.floor(old + step))
    else:
        value = max(math.ceil(desired), math.ceil(old - step))
    return max(lo, min(hi, value))


def limit_size(old: int, desired: float, fraction: float, lo: int, hi: int) -> int:
    """A size (sequences or tokens) moved towards ``desired`` by at most one step, within [lo, hi]."""
    return _limit_whole(old, desired, allowed_step(old, fraction, SIZE_MIN_STEP), lo, hi)


def limit_wait(old: int, desired: float, fraction: float, lo: int, hi: int) -> int:
    """A wait in ms moved towards ``desired`` by at most one step, within [lo, hi]."""
    return _limit_whole(old, desired, allowed_step(old, fraction, WAIT_MIN_STEP_MS), lo, hi)


def limit_ratio(old: float, desired: float, fraction: float, lo: float, hi: float) -> float:
    """A ratio moved towards ``desired`` by at most one step, within [lo, hi]."""
    step = allowed_step(old, fraction, RATIO_MIN_STEP)
    value = min(desired, old + step) if desired > old else max(desired, old - step)
    # Rounded for a readable status, then clamped so that rounding cannot step outside the bounds.
    return max(lo, min(hi, round(value, 3)))


def clamp_into_bounds(window: Window, bounds: WindowBounds) -> Window:
    """The window with every field inside ``bounds`` and the target within the cap."""
    cap = bounds.hard_cap.clamp(window.hard_cap)
    cap = max(cap, bounds.target_batch_size.min)
    target = min(bounds.target_batch_size.clamp(window.target_batch_size), cap)
    return window.model_copy(
        update={
            "target_batch_size": target,
            "hard_cap": cap,
            "max_wait_ms": bounds.max_wait_ms.clamp(window.max_wait_ms),
            "tail_mark_ratio": bounds.tail_mark_ratio.clamp(window.tail_mark_ratio),
            "max_prefill_tokens": (
                None
                if window.max_prefill_tokens is None
                else bounds.max_prefill_tokens.clamp(window.max_prefill_tokens)
            ),
        }
    )


def lift_ceiling(ceiling: int | None, streak: int, needed: int, fraction: float, top: int) -> tuple[int | None, int]:
    """A ceiling one step higher once ``streak`` calm intervals reach ``needed`` (the streak then
    restarts); gone once it reaches ``top``. Returns the ceiling and the streak."""
    if ceiling is None or streak < needed:
        return ceiling, streak
    lifted = math.floor(ceiling + allowed_step(ceiling, fraction, SIZE_MIN_STEP))
    return (None if lifted >= top else lifted), 0


def cap_floor(bounds: WindowBounds) -> int:
    """Lowest cap a move may choose: the cap's bound, and room for the smallest target."""
    return max(bounds.hard_cap.min, bounds.target_batch_size.min)


def cap_ceiling(spec: BatchProfileSpec, estimate: FriendlinessEstimate | None, kv_cap_ceiling: int | None) -> int:
    """Highest cap the policy may choose now: bounds, friendliness class, memory ceiling."""
    ceiling = spec.tuning.bounds.hard_cap.max
    friendliness = spec.batch_friendliness
    if friendliness == Friendliness.AUTO:
        measured = estimate.measured_class if estimate is not None else None
        friendliness = measured or Friendliness.MEDIUM
    ceiling = min(ceiling, CLASS_CAP_CEILING[friendliness])
    if kv_cap_ceiling is not None:
        ceiling = min(ceiling, kv_cap_ceiling)
    return max(ceiling, spec.tuning.bounds.hard_cap.min, spec.tuning.bounds.target_batch_size.min)
