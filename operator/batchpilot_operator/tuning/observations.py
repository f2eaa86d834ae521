"""What the tuning policy sees of a model's live load: one :class:`Observations` per interval.

Every figure is optional: ``NaN`` means unknown (no traffic, no series, a failed query),
never zero. Latencies are in **seconds** (``*_s``), as the runtime's histograms export
them; :meth:`Observations.to_status` converts to the milliseconds of the status block.

One builder fills it (:func:`batchpilot_operator.tuning.model_metrics.to_observations`) from what
the operator's metric sources read (Prometheus's ``rate()`` and ``histogram_quantile`` over a rate
window, or two scrapes of the runtimes) and from the simulator's counts of the same events on the
very same histogram buckets (:data:`batchpilot_runtime.contract.metric_names.LATENCY_BUCKETS_S`),
interpolated with :func:`histogram_quantile`, so that the policy sees the same coarse figures in both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from batchpilot_operator.api.status import Observed
from batchpilot_runtime.contract.metric_names import LATENCY_BUCKETS_S

NAN = math.nan


def known(value: float) -> bool:
    """True when a figure was observed (not NaN, not infinite)."""
    return math.isfinite(value)


def histogram_quantile(q: float, upper_bounds: Sequence[float], counts: Sequence[float]) -> float:
    """Prometheus' ``histogram_quantile`` over per-bucket (non-cumulative) counts.

    ``counts`` has one entry per finite upper bound plus one for ``+Inf``. Linear
    interpolation inside the bucket, the lowest bucket starting at 0; a quantile that
    falls in the ``+Inf`` bucket returns the highest finite bound, as Prometheus does
    (use :func:`is_saturated` to recognise that). NaN when there are no observations.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must lie in [0, 1], got {q}")
    if len(counts) != len(upper_bounds) + 1:
        raise ValueError(f"counts must have {len(upper_bounds) + 1} entries (one per bucket and +Inf)")
    total = float(sum(counts))
    if total <= 0:
        return NAN
    rank = q * total
    cumulative = 0.0
    for index, count in enumerate(counts):
        if count <= 0:
            continue
        if cumulative + count >= rank:
            if index == len(upper_bounds):
                return float(upper_bounds[-1])
            lower = 0.0 if index == 0 else float(upper_bounds[index - 1])
            upper = float(upper_bounds[index])
            return lower + (upper - lower) * max(0.0, rank - cumulative) / count
        cumulative += count
    return float(upper_bounds[-1])


def is_saturated(quantile_s: float, upper_bounds: Sequence[float] = LATENCY_BUCKETS_S) -> bool:
    """True when a quantile lies in the top finite bucket or beyond: the histogram cannot say
    how large it really is, so the policy must treat it as "far over", not as its value."""
    return known(quantile_s) and len(upper_bounds) >= 2 and quantile_s > upper_bounds[-2]


def share_above(threshold: float, cumulative: Sequence[tuple[float, float]]) -> float:
    """Share of a histogram's observations above ``threshold``, from ``(upper bound, cumulative
    count)`` pairs (ascending, ``+Inf`` last), interpolated linearly inside the threshold's bucket as
    ``histogram_quantile`` does; the ``+Inf`` bucket counts as above. NaN without observations."""
    total = cumulative[-1][1] if cumulative else 0.0
    if total <= 0:
        return NAN
    lower, below = 0.0, 0.0
    for upper, count in cumulative:
        if upper >= threshold:
            if math.isfinite(upper) and upper > lower:
                below += (count - below) * (threshold - lower) / (upper - lower)
            return max(0.0, total - below) / total
        lower, below = upper, count
    return max(0.0, total - below) / total


@dataclass(frozen=True)
class Observations:
    """Figures of one model over the last rate window (summed or maxed over its pods).

    ``arrival_rate_per_s`` is the rate of requests that *ended* (completed, aborted or rejected), the
    runtime's ``batchpilot_requests_total``: it counts no arrivals, and the simulator counts what it
    counts; in a steady state it is the arrival rate. ``batch_hit_ratio`` is the share of admission
    groups that filled the batch, fired by the target or by the cap (not by the wait or the tail
    rule); ``tail_marked_share`` the requests tail-marked (while they waited) per request that ended
    over the window. ``samples`` is how many latency observations the quantiles rest on (the histogram's
    count increase over the window); the policy refuses to act on too few. ``itl_p99_s`` is the P99
    of the gap between two tokens of one request (``batchpilot_inter_token_seconds``), whatever the
    SLO's latency metric; it rests on far more samples than the per-request quantiles.
    ``step_s_by_batch`` maps a decode batch-size bucket (1, 2, 4, ...) to the mean step
    time at that size, the raw material of the friendliness curve. ``prefill_s_per_token`` is the
    step time one prompt token adds (prefill steps beyond a decode step of their batch size, per
    prompt token prefilled). ``itl_window_buckets`` are the inter-token histogram's cumulative counts
    ``(upper bound, count)`` over the last hour (``ERROR_BUDGET_WINDOW_S``): what share of the gaps
    the SLO's error budget has already spent; empty when the source does not give them.
    """

    p50_s: float = NAN
    p99_s: float = NAN
    p999_s: float = NAN
    p99_saturated: bool = False
    p999_saturated: bool = False
    samples: float = NAN
    queue_depth: float = NAN
    arrival_rate_per_s: float = NAN
    tokens_per_s: float = NAN
    mean_batch_size: float = NAN
    batch_hit_ratio: float = NAN
    tail_marked_share: float = NAN
    kv_usage_ratio: float = NAN
    preemptions_per_s: float = NAN
    step_s_by_batch: Mapping[int, float] = field(default_factory=dict)
    prefill_s_per_token: float = NAN
    itl_p99_s: float = NAN
    itl_p99_saturated: bool = False
    itl_window_buckets: tuple[tuple[float, float], ...] = ()
    window_s: float = NAN
    at_s: float = NAN

    def __post_init__(self) -> None:
        for name in (
            "samples",
            "queue_depth",
            "arrival_rate_per_s",
            "tokens_per_s",
            "mean_batch_size",
            "kv_usage_ratio",
            "preemptions_per_s",
            "p50_s",
            "p99_s",
            "p999_s",
            "itl_p99_s",
            "prefill_s_per_token",
        ):
            value = getattr(self, name)
            if known(value) and value < 0:
                raise ValueError(f"observations.{name} must be >= 0 or NaN, got {value}")

    def with_(self, **changes: object) -> Observations:
        return replace(self, **changes)  # type: ignore[arg-type]

    def to_status(self, at: str | None = None) -> Observed:
        """The status block's ``observed`` (milliseconds; unknown figures left out)."""

        def opt(value: float, scale: float = 1.0) -> float | None:
            return value * scale if known(value) else None

        return Observed(
            p50_ms=opt(self.p50_s, 1000.0),
            p99_ms=opt(self.p99_s, 1000.0),
            p999_ms=opt(self.p999_s, 1000.0),
            inter_token_p99_ms=opt(self.itl_p99_s, 1000.0),
            queue_depth=opt(self.queue_depth),
            arrival_rate=opt(self.arrival_rate_per_s),
            tokens_per_second=opt(self.tokens_per_s),
            mean_batch_size=opt(self.mean_batch_size),
            batch_hit_ratio=opt(self.batch_hit_ratio),
            kv_usage=opt(self.kv_usage_ratio),
            preemption_rate=opt(self.preemptions_per_s),
            at=at,
        )
