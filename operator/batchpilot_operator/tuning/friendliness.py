"""Batch-friendliness measured from step time per batch size.

A model is batch-friendly when one more sequence in the batch costs little: decode
throughput (``batch / step_s``) grows almost linearly with the batch. It stops being
friendly past the *knee*, where the memory bandwidth or the compute saturates and
throughput stops growing. The runtime exports ``batchpilot_step_seconds`` by
``batch_bucket`` (powers of two); the operator turns the mean step time per bucket into
a curve, and :func:`measure` finds the knee and the class.

Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from batchpilot_operator.api.kinds import CLASS_CAP_CEILING as CLASS_CAP_CEILING
from batchpilot_operator.api.profile import Friendliness
from batchpilot_operator.api.status import FriendlinessPoint, FriendlinessStatus

# A doubling of the batch that raises throughput by less than this is "not worth it".
KNEE_GAIN_PER_DOUBLING = 1.15
# Throughput gain per doubling, averaged over the curve, that separates the classes.
HIGH_GAIN_PER_DOUBLING = 1.6
MEDIUM_GAIN_PER_DOUBLING = 1.25


@dataclass(frozen=True)
class FriendlinessEstimate:
    """A measured curve with its knee (None: throughput still grows at the largest size seen)
    and its class (None: fewer than two batch sizes observed)."""

    curve: tuple[tuple[int, float], ...]  # (batch size, decode tokens/s), ascending
    knee_batch_size: int | None
    measured_class: Friendliness | None

    def to_status(self) -> FriendlinessStatus:
        return FriendlinessStatus(
            measured_class=self.measured_class,
            knee_batch_size=self.knee_batch_size,
            curve=[FriendlinessPoint(batch_size=b, tokens_per_second=t) for b, t in self.curve[:16]],
        )


def measure(step_s_by_batch: Mapping[int, float]) -> FriendlinessEstimate:
    """Curve, knee and class from mean step seconds per batch size (unknown sizes left out).

    The knee is the smallest measured size after which throughput grows by less than
    :data:`KNEE_GAIN_PER_DOUBLING` per doubling of the batch up to every larger size seen;
    a curve that keeps growing has no knee. The class is the mean gain per doubling.
    """
    points = sorted((int(b), b / s) for b, s in step_s_by_batch.items() if b >= 1 and math.isfinite(s) and s > 0)
    curve = tuple(points)
    if len(points) < 2:
        return FriendlinessEstimate(curve=curve, knee_batch_size=None, measured_class=None)
    knee: int | None = None
    for index, (batch, throughput) in enumerate(points[:-1]):
        later = points[index + 1 :]
        if all(_gain_per_doubling(batch, throughput, b, t) < KNEE_GAIN_PER_DOUBLING for b, t in later):
            knee = batch
            break
    first_b, first_t = points[0]
    last_b, last_t = points[-1]
    mean_gain = _gain_per_doubling(first_b, first_t, last_b, last_t)
    if mean_gain >= HIGH_GAIN_PER_DOUBLING:
        measured = Friendliness.HIGH
    elif mean_gain >= MEDIUM_GAIN_PER_DOUBLING:
        measured = Friendliness.MEDIUM
    else:
        measured = Friendliness.LOW
    return FriendlinessEstimate(curve=curve, knee_batch_size=knee, measured_class=measured)


def _gain_per_doubling(b0: int, t0: float, b1: int, t1: float) -> float:
    doublings = math.log2(b1 / b0)
    if doublings <= 0 or t0 <= 0:
        return 1.0
    return float((t1 / t0) ** (1.0 / doublings))


def merge_curve(
    previous: tuple[tuple[int, float], ...], fresh: Mapping[int, float], weight: float = 0.3
) -> tuple[tuple[int, float], ...]:
    """Exponentially weighted mean step seconds per batch size: each interval sees only the
    sizes the load produced, so the curve is accumulated across intervals."""
    merged = dict(previous)
    for batch, step_s in fresh.items():
        if batch < 1 or not math.isfinite(step_s) or step_s <= 0:
            continue
        old = merged.get(batch)
        merged[batch] = step_s if old is None else (1 - weight) * old + weight * step_s
    return tuple(sorted(merged.items()))
