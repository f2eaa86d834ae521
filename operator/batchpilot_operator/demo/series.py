"""From scrapes of a runtime's ``/metrics`` to the demo's figures. Pure: no I/O, no clock.

A :class:`Snapshot` holds one model's cumulative counters, gauges and histogram buckets
at one instant (histograms summed over lanes). Every figure of a phase is a difference
of two snapshots: the phase's own histograms are its last snapshot minus its first, and a
point of a time series is the snapshot at ``t`` minus the one a trailing window earlier.
Quantiles use the operator's own ``histogram_quantile``, so the demo reads the same figure
from the same buckets as the policy does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from batchpilot_operator.demo.results import (
    DecisionRecord,
    Histogram,
    LoadCounts,
    ModelPhaseResult,
    TimeSeries,
    WindowSnapshot,
    round_figure,
)
from batchpilot_operator.io.exposition import bucket_bound, counter_increase, parse_exposition
from batchpilot_operator.tuning.model_metrics import LATENCY_HISTOGRAMS, SLO_LATENCY_HISTOGRAMS, histogram_from_buckets
from batchpilot_operator.tuning.observations import histogram_quantile
from batchpilot_runtime.contract import metric_names as rm

DECODE_BATCH = f"{rm.BATCH_SIZE}:decode"
_HISTOGRAMS = frozenset({*LATENCY_HISTOGRAMS.values(), rm.BATCH_SIZE})
_GAUGES = frozenset(
    {
        rm.QUEUE_DEPTH,
        rm.RUNNING_SEQUENCES,
        rm.KV_CACHE_USAGE_RATIO,
        rm.WINDOW_TARGET_BATCH_SIZE,
        rm.WINDOW_HARD_CAP,
        rm.WINDOW_MAX_WAIT_SECONDS,
        rm.WINDOW_GENERATION,
        rm.WINDOW_MAX_PREFILL_TOKENS,
    }
)
_COUNTERS = frozenset(
    {rm.REQUESTS_TOTAL, rm.GENERATED_TOKENS_TOTAL, rm.PROMPT_TOKENS_TOTAL, rm.PREEMPTIONS_TOTAL, rm.ADMISSIONS_TOTAL}
)


@dataclass(frozen=True)
class Snapshot:
    """One model's metrics at ``at_s`` (seconds on the demo's clock).

    ``counters`` are keyed by ``name`` or ``name:label_value`` (outcome, reason), and hold
    each histogram's ``_sum`` and ``_count`` (as ``histogram_sum``, ``histogram_count``);
    ``histograms`` by histogram name (``batchpilot_batch_size:decode`` for the batch
    sizes of decode steps), each ``{upper bound: cumulative count}`` summed over lanes.
    """

    at_s: float
    gauges: Mapping[str, float] = field(default_factory=dict)
    counters: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, Mapping[float, float]] = field(default_factory=dict)

    def counter(self, key: str) -> float:
        return self.counters.get(key, 0.0)

    def counters_with_prefix(self, name: str) -> dict[str, float]:
        """Values of a labelled counter by label value (e.g. requests by outcome)."""
        prefix = f"{name}:"
        return {k.removeprefix(prefix): v for k, v in self.counters.items() if k.startswith(prefix)}

    def budget(self) -> int | None:
        """The window's prompt-token budget per step; None for whole prompts (the gauge's 0) or unknown."""
        value = self.gauges.get(rm.WINDOW_MAX_PREFILL_TOKENS)
        return int(value) if value else None

    def window(self) -> WindowSnapshot | None:
        try:
            return WindowSnapshot(
                target_batch_size=int(self.gauges[rm.WINDOW_TARGET_BATCH_SIZE]),
                hard_cap=int(self.gauges[rm.WINDOW_HARD_CAP]),
                max_wait_ms=_ms(self.gauges[rm.WINDOW_MAX_WAIT_SECONDS]),
                generation=int(self.gauges[rm.WINDOW_GENERATION]),
                max_prefill_tokens=self.budget(),
            )
        except KeyError:
            return None


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def snapshot_from_exposition(text: str, model: str, at_s: float) -> Snapshot:
    """The samples of ``model`` in a Prometheus text exposition; histograms summed over lanes."""
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    histograms: dict[str, dict[float, float]] = {}
    for (name, label_items), value in parse_exposition(text).items():
        labels = dict(label_items)
        if labels.get(rm.LABEL_MODEL) != model or not math.isfinite(value):
            continue
        if (histogram_bound := bucket_bound(name, labels, _HISTOGRAMS)) is not None:
            histogram, bound = histogram_bound
            if histogram == rm.BATCH_SIZE:
                histogram = f"{histogram}:{labels.get(rm.LABEL_PHASE, '')}"
            buckets = histograms.setdefault(histogram, {})
            buckets[bound] = buckets.get(bound, 0.0) + value
        elif name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in _HISTOGRAMS:
            histogram, suffix = name.rsplit("_", 1)
            if histogram == rm.BATCH_SIZE:
                histogram = f"{histogram}:{labels.get(rm.LABEL_PHASE, '')}"
            key = f"{histogram}_{suffix}"
            counters[key] = counters.get(key, 0.0) + value
        elif name in _GAUGES:
            gauges[name] = value
        elif name in _COUNTERS:
            label = labels.get(rm.LABEL_OUTCOME) or labels.get(rm.LABEL_REASON)
            key = f"{name}:{label}" if label else name
            counters[key] = counters.get(key, 0.0) + value
    return Snapshot(at_s, gauges, counters, histograms)


def histogram_between(before: Snapshot | None, after: Snapshot, name: str) -> Histogram:
    """Observations of histogram ``name`` between two snapshots, per bucket.

    A bucket that went down means the runtime restarted: its current value is the
    increase, as Prometheus assumes for counters. The increments are made monotone as the
    operator's metric sources do (:func:`~batchpilot_operator.tuning.model_metrics.histogram_from_buckets`).
    """
    now = after.histograms.get(name, {})
    then = before.histograms.get(name, {}) if before is not None else {}
    bounds = sorted(b for b in now if math.isfinite(b))
    increments = histogram_from_buckets(
        {bound: counter_increase(now.get(bound, 0.0), then.get(bound)) for bound in [*bounds, math.inf]}
    )
    return Histogram(upper_bounds=bounds, counts=list(increments.per_bucket))


def quantile_ms(histogram: Histogram, q: float) -> float | None:
    """The ``q`` quantile in milliseconds (Prometheus's interpolation); None without observations."""
    if histogram.total <= 0 or not histogram.upper_bounds:
        return None
    return round_figure(1000.0 * histogram_quantile(q, histogram.upper_bounds, histogram.counts))


def share_at_most(histogram: Histogram, bound_s: float) -> float | None:
    """Share of observations at or below ``bound_s``, interpolating linearly inside its bucket."""
    total = histogram.total
    if total <= 0:
        return None
    below = 0.0
    lower = 0.0
    for upper, count in zip([*histogram.upper_bounds, math.inf], histogram.counts, strict=True):
        if bound_s >= upper:
            below += count
        else:
            if math.isfinite(upper) and bound_s > lower:
                below += count * (bound_s - lower) / (upper - lower)
            break
        lower = upper
    return below / total


def mean_between(before: Snapshot, after: Snapshot, histogram: str) -> float | None:
    """Mean observation of a histogram between two snapshots, from its ``_sum`` and ``_count``."""
    count = increase_between(before, after, f"{histogram}_count")
    total = increase_between(before, after, f"{histogram}_sum")
    return total / count if count > 0 else None


def _gauge(snapshot: Snapshot, name: str, scale: float = 1.0) -> float | None:
    value = snapshot.gauges.get(name)
    return None if value is None else round_figure(value * scale)


def _trailing(snapshots: Sequence[Snapshot], index: int, window_s: float) -> Snapshot:
    """The latest snapshot at least ``window_s`` before ``snapshots[index]`` (or the first one)."""
    at_s = snapshots[index].at_s
    chosen = snapshots[0]
    for snapshot in snapshots[: index + 1]:
        if at_s - snapshot.at_s >= window_s:
            chosen = snapshot
        else:
            break
    return chosen


def build_series(snapshots: Sequence[Snapshot], slo_histogram: str, window_s: float) -> TimeSeries:
    """One point per snapshot after the first (which marks the phase's start)."""
    series = TimeSeries()
    if not snapshots:
        return series
    start_s = snapshots[0].at_s
    for index in range(1, len(snapshots)):
        now = snapshots[index]
        before = _trailing(snapshots, index, window_s)
        latency = histogram_between(before, now, slo_histogram)
        span_s = now.at_s - before.at_s
        tokens = increase_between(before, now, rm.GENERATED_TOKENS_TOTAL)
        series.t_s.append(round(now.at_s - start_s, 2))
        series.p50_ms.append(quantile_ms(latency, 0.5))
        series.p99_ms.append(quantile_ms(latency, 0.99))
        series.p999_ms.append(quantile_ms(latency, 0.999))
        series.queue_depth.append(_gauge(now, rm.QUEUE_DEPTH))
        series.running.append(_gauge(now, rm.RUNNING_SEQUENCES))
        series.kv_usage.append(_gauge(now, rm.KV_CACHE_USAGE_RATIO))
        series.tokens_per_s.append(round_figure(tokens / span_s) if span_s > 0 else None)
        series.target_batch_size.append(_gauge(now, rm.WINDOW_TARGET_BATCH_SIZE))
        series.hard_cap.append(_gauge(now, rm.WINDOW_HARD_CAP))
        series.max_wait_ms.append(_gauge(now, rm.WINDOW_MAX_WAIT_SECONDS, 1000.0))
        series.itl_p99_ms.append(quantile_ms(histogram_between(before, now, rm.INTER_TOKEN_SECONDS), 0.99))
        budget = now.budget()
        series.max_prefill_tokens.append(None if budget is None else float(budget))
    return series


def increase_between(before: Snapshot, after: Snapshot, key: str) -> float:
    """Increase of counter ``key`` between two snapshots (a runtime restart in between counts as a reset)."""
    return counter_increase(after.counter(key), before.counter(key))


def outcomes_between(before: Snapshot, after: Snapshot) -> dict[str, int]:
    """``batchpilot_requests_total`` increase by outcome."""
    outcomes = after.counters_with_prefix(rm.REQUESTS_TOTAL)
    return {
        outcome: round(increase_between(before, after, f"{rm.REQUESTS_TOTAL}:{outcome}"))
        for outcome in sorted(outcomes)
    }


def peak(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


CHANGE_DIRECTIONS = frozenset({"up", "down", "reset"})


def summarize_model_phase(
    *,
    model: str,
    latency_metric: str,
    slo_p99_ms: float,
    slo_itl_p99_ms: float | None = None,
    snapshots: Sequence[Snapshot],
    load: LoadCounts,
    decisions: Sequence[DecisionRecord],
    series_window_s: float,
) -> ModelPhaseResult:
    """One model's figures over one phase; ``snapshots`` run from the phase's start to its end."""
    if len(snapshots) < 2:
        raise ValueError(f"model {model}: a phase needs a snapshot at its start and one at its end")
    first, last = snapshots[0], snapshots[-1]
    slo_histogram = SLO_LATENCY_HISTOGRAMS[latency_metric]
    latency = histogram_between(first, last, slo_histogram)
    e2e = histogram_between(first, last, rm.REQUEST_LATENCY_SECONDS)
    span_s = last.at_s - first.at_s
    tokens = increase_between(first, last, rm.GENERATED_TOKENS_TOTAL)
    tokens_per_s = tokens / span_s if span_s > 0 else None
    met = share_at_most(latency, slo_p99_ms / 1000.0)
    itl = histogram_between(first, last, rm.INTER_TOKEN_SECONDS)
    itl_met = share_at_most(itl, slo_itl_p99_ms / 1000.0) if slo_itl_p99_ms is not None else None
    series = build_series(snapshots, slo_histogram, series_window_s)
    return ModelPhaseResult(
        model=model,
        load=load,
        runtime_outcomes=outcomes_between(first, last),
        p50_ms=quantile_ms(latency, 0.5),
        p99_ms=quantile_ms(latency, 0.99),
        p999_ms=quantile_ms(latency, 0.999),
        e2e_p99_ms=quantile_ms(e2e, 0.99),
        slo_met_share=round_figure(met),
        tokens_per_s=round_figure(tokens_per_s),
        goodput_tokens_per_s=round_figure(tokens_per_s * met) if tokens_per_s is not None and met is not None else None,
        mean_decode_batch_size=round_figure(mean_between(first, last, DECODE_BATCH)),
        kv_usage_max=peak(series.kv_usage),
        queue_depth_max=peak(series.queue_depth),
        preemptions=round(increase_between(first, last, rm.PREEMPTIONS_TOTAL)),
        decisions=sum(1 for d in decisions if d.model == model and d.direction in CHANGE_DIRECTIONS),
        window_start=first.window(),
        window_end=last.window(),
        series=series,
        decode_batch_size=histogram_between(first, last, DECODE_BATCH),
        queue_wait_s=histogram_between(first, last, rm.QUEUE_WAIT_SECONDS),
        itl_p50_ms=quantile_ms(itl, 0.5),
        itl_p99_ms=quantile_ms(itl, 0.99),
        itl_slo_met_share=round_figure(itl_met),
    )
