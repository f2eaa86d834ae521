"""Raw per-model metrics over one rate window, and the arithmetic on them: the one builder of
the policy's observations (:func:`to_observations`).

Both metric sources produce the same :class:`ModelMetrics` for every
(namespace, model): the Prometheus source from a handful of grouped PromQL
queries, the scraping source from the difference of two scrapes of the
runtimes' ``/metrics``; the simulator fills it from its own counts of the same
events (:mod:`batchpilot_operator.sim.intervals`). Quantiles are computed here, from bucket
increments, with Prometheus's own ``histogram_quantile`` interpolation, so that every
source gives the same figure for the same traffic — and so that a quantile that
falls in the ``+Inf`` bucket is reported as *saturated* rather than as a value.
Pure: the sources' I/O stays in :mod:`batchpilot_operator.io`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise

from batchpilot_operator.tuning.observations import Observations, histogram_quantile, is_saturated
from batchpilot_runtime.contract import metric_names as rm

INTER_TOKEN = "interToken"
# The runtime's latency histogram behind each spec.slo.latencyMetric value.
SLO_LATENCY_HISTOGRAMS: dict[str, str] = {
    "ttft": rm.TTFT_SECONDS,
    "queueWait": rm.QUEUE_WAIT_SECONDS,
    "e2e": rm.REQUEST_LATENCY_SECONDS,
}
# The latency histograms the operator reads, by name: the SLO's latencyMetric picks one of the
# first three; the inter-token histogram is read for every profile (slo.interTokenP99Ms).
LATENCY_HISTOGRAMS: dict[str, str] = {**SLO_LATENCY_HISTOGRAMS, INTER_TOKEN: rm.INTER_TOKEN_SECONDS}
# Each of them on the buckets the runtime exports it on (gaps on the shorter step buckets).
LATENCY_BUCKETS: dict[str, tuple[float, ...]] = {
    key: next(spec.buckets for spec in rm.RUNTIME_METRICS if spec.name == name)
    for key, name in LATENCY_HISTOGRAMS.items()
}
# The inter-token SLO's error budget is judged over the last hour of gaps (the policy's
# excused_gap_share): long against a 30 s rate window, short enough to notice a day's drift.
ERROR_BUDGET_WINDOW_S = 3600
# A (namespace, model) pair. Sources that see no namespace label use "".
ModelKey = tuple[str, str]


@dataclass(frozen=True)
class Quantile:
    """One quantile read from a histogram: ``value_s`` is None when there was no data."""

    value_s: float | None
    saturated: bool = False  # the rank fell in the +Inf bucket: the true value is above the top bound


@dataclass(frozen=True)
class HistogramWindow:
    """Increments of one histogram over a window: cumulative counts per upper bound (ascending, +Inf last)."""

    upper_bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum_value: float = 0.0

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    @property
    def per_bucket(self) -> tuple[float, ...]:
        """Observations in each bucket (not cumulative), the ``+Inf`` bucket last."""
        return tuple(b - a for a, b in pairwise((0.0, *self.cumulative)))

    def quantile(self, q: float) -> Quantile:
        """Prometheus's histogram_quantile on these increments (linear within a bucket).

        Delegates to :func:`batchpilot_operator.tuning.observations.histogram_quantile`, the
        function the simulator uses, so that both read the same figure from the same buckets.
        """
        if not self.cumulative or not math.isfinite(self.count) or self.count <= 0:
            return Quantile(None)
        finite = tuple(b for b in self.upper_bounds if not math.isinf(b))
        if not finite:
            return Quantile(None, saturated=True)
        value = histogram_quantile(q, finite, self.per_bucket)
        rank = q * self.count
        in_inf_bucket = self.cumulative[-2] < rank if len(self.cumulative) >= 2 else True
        return Quantile(finite_or_none(value), saturated=in_inf_bucket or is_saturated(value, finite))

    def merged(self, other: HistogramWindow) -> HistogramWindow:
        """Sum of two histograms with the same buckets (e.g. two pods, two lanes)."""
        if self.upper_bounds != other.upper_bounds:
            raise ValueError("cannot merge histograms with different buckets")
        return HistogramWindow(
            self.upper_bounds,
            tuple(a + b for a, b in zip(self.cumulative, other.cumulative, strict=True)),
            self.sum_value + other.sum_value,
        )


def histogram_from_buckets(buckets: Mapping[float, float], sum_value: float = 0.0) -> HistogramWindow:
    """Build from ``{upper_bound: cumulative increment}``; bounds are sorted, ``+Inf`` added when missing.

    Prometheus can return a slightly non-monotone cumulative series when the
    buckets were scraped at different instants; it is made monotone here as
    histogram_quantile does.
    """
    bounds = sorted(buckets)
    counts = [max(0.0, buckets[b]) if math.isfinite(buckets[b]) else 0.0 for b in bounds]
    if not bounds or not math.isinf(bounds[-1]):
        bounds.append(math.inf)
        counts.append(counts[-1] if counts else 0.0)
    for i in range(1, len(counts)):
        counts[i] = max(counts[i], counts[i - 1])
    return HistogramWindow(tuple(bounds), tuple(counts), sum_value)


@dataclass
class ModelMetrics:
    """What one model's pods did over one rate window (rates per second; gauges now).

    Absent values (None) mean the source had no series for them: unknown, not zero.
    """

    window_s: float
    latency: dict[str, HistogramWindow] = field(default_factory=dict)  # keyed by LATENCY_HISTOGRAMS keys
    # Quantiles computed by Prometheus (histogram_quantile), by latency metric then q; and observation rates.
    latency_quantiles_s: dict[str, dict[float, float]] = field(default_factory=dict)
    latency_count_per_s: dict[str, float] = field(default_factory=dict)
    # Requests that ended (completed, aborted, rejected) as batchpilot_requests_total counts them: the
    # runtime counts no arrivals, so this is the policy's arrival rate, in the simulator as well.
    requests_per_s: float | None = None
    generated_tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    admissions_per_s: dict[str, float] = field(default_factory=dict)  # by reason
    tail_marked_per_s: float | None = None
    preemptions_per_s: float | None = None
    decode_batch_sum_per_s: float | None = None
    decode_batch_count_per_s: float | None = None
    step_seconds_by_bucket: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (sum/s, count/s)
    prefill_step_seconds_by_bucket: dict[int, tuple[float, float]] = field(default_factory=dict)  # the same, prefill
    queue_depth: float | None = None
    running: float | None = None
    kv_usage_max: float | None = None
    pods_reporting: int = 0
    # Gaps between tokens over the error budget's window (ERROR_BUDGET_WINDOW_S): counts, not rates.
    itl_window: HistogramWindow | None = None

    @property
    def mean_batch_size(self) -> float | None:
        if self.decode_batch_count_per_s is None and self.running is not None and self.pods_reporting:
            # An engine without a batch-size histogram (vLLM, SGLang): its running set per pod, as sampled.
            return self.running / self.pods_reporting
        if not self.decode_batch_count_per_s or self.decode_batch_sum_per_s is None:
            return None
        return self.decode_batch_sum_per_s / self.decode_batch_count_per_s

    @property
    def batch_hit_ratio(self) -> float | None:
        """Share of admission groups that filled the batch: fired by the target or by reaching the cap
        (the scheduler counts a group once, by the strongest reason, and "cap" outranks "target")."""
        total = sum(self.admissions_per_s.values())
        if total <= 0:
            return None
        return (self.admissions_per_s.get("target", 0.0) + self.admissions_per_s.get("cap", 0.0)) / total

    @property
    def tail_marked_share(self) -> float | None:
        """Requests tail-marked (counted when the scheduler marks them, while they wait) per request that
        ended over the window: a ratio of two rates, not a share of one set of requests (the rule that
        raises the tail-mark ratio reads it)."""
        if self.tail_marked_per_s is None or not self.requests_per_s:
            return None
        return self.tail_marked_per_s / self.requests_per_s

    def step_time_per_batch_s(self) -> dict[int, float]:
        """Mean decode step time per batch-size bucket, for buckets that had steps."""
        return {b: s / c for b, (s, c) in sorted(self.step_seconds_by_bucket.items()) if c > 0}

    def prefill_seconds_per_token(self) -> float | None:
        """Step time one prompt token costs: the prefill steps' time beyond what a decode step of the
        same batch-size bucket takes, per prompt token prefilled. Without a decode step to compare
        with, the whole prefill step counts (an overestimate: the step's decodes are charged to its
        prompt tokens)."""
        if not self.prefill_tokens_per_s or not self.prefill_step_seconds_by_bucket:
            return None
        decode = self.step_time_per_batch_s()
        prefill_s = 0.0
        for bucket, (sum_s, count) in self.prefill_step_seconds_by_bucket.items():
            nearest = min(decode, key=lambda b: abs(math.log2(b / bucket)), default=None)
            decode_s = decode[nearest] if nearest is not None else 0.0
            prefill_s += max(0.0, sum_s - count * decode_s)
        return prefill_s / self.prefill_tokens_per_s


def lookup(metrics: Mapping[ModelKey, ModelMetrics], namespace: str, model: str) -> ModelMetrics | None:
    """The metrics of a profile: by (namespace, model), else by model alone when the source has no namespace."""
    return metrics.get((namespace, model)) or metrics.get(("", model))


def finite_or_none(value: float | None) -> float | None:
    """NaN and infinities (no traffic, division by zero in PromQL) are unknown, not numbers."""
    if value is None or not math.isfinite(value):
        return None
    return value


class MetricsBuilder:
    """Accumulates per-series values (already rates, or already gauges) into ModelMetrics per key.

    Each source feeds it the series it read; several pods or lanes of one model add up.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._metrics: dict[ModelKey, ModelMetrics] = {}
        self._buckets: dict[tuple[ModelKey, str], dict[float, float]] = {}
        self._window_buckets: dict[ModelKey, dict[float, float]] = {}
        # An engine behind the gate (llamacpp): its own running set and generated tokens, which replace the
        # gate's in build() (the gate sees requests in flight to it, the engine what it runs).
        self._engine_own: dict[ModelKey, dict[str, float]] = {}

    def _get(self, key: ModelKey) -> ModelMetrics:
        metrics = self._metrics.get(key)
        if metrics is None:
            metrics = self._metrics[key] = ModelMetrics(window_s=self.window_s)
        return metrics

    def add_bucket(self, key: ModelKey, latency_metric: str, upper_bound: float, rate: float) -> None:
        self._get(key)
        buckets = self._buckets.setdefault((key, latency_metric), {})
        buckets[upper_bound] = buckets.get(upper_bound, 0.0) + rate

    def add_window_bucket(self, key: ModelKey, upper_bound: float, count: float) -> None:
        """One cumulative bucket of the inter-token histogram's increase over ERROR_BUDGET_WINDOW_S."""
        self._get(key)
        buckets = self._window_buckets.setdefault(key, {})
        buckets[upper_bound] = buckets.get(upper_bound, 0.0) + count

    def add_quantile(self, key: ModelKey, latency_metric: str, q: float, value_s: float) -> None:
        """A quantile Prometheus computed; NaN (no traffic) is kept out: unknown, not zero."""
        if math.isfinite(value_s):
            self._get(key).latency_quantiles_s.setdefault(latency_metric, {})[q] = value_s

    def add_latency_count(self, key: ModelKey, latency_metric: str, rate: float) -> None:
        if math.isfinite(rate):
            counts = self._get(key).latency_count_per_s
            counts[latency_metric] = counts.get(latency_metric, 0.0) + rate

    def add_rate(self, key: ModelKey, series: str, rate: float, detail: str = "") -> None:
        """``series`` is one of requests, generated_tokens, prompt_tokens, prefill_tokens, tail_marked,
        preemptions, admissions (detail = reason), batch_sum, batch_count, and step_sum, step_count,
        prefill_step_sum and prefill_step_count (detail = batch bucket; step_* for decode-only steps);
        engine_generated_tokens: an engine's own count behind the gate, which replaces the gate's."""
        m = self._get(key)
        if not math.isfinite(rate):
            return
        if series in _ENGINE_OWN:
            own = self._engine_own.setdefault(key, {})
            own[series] = own.get(series, 0.0) + rate
        elif series == "admissions":
            m.admissions_per_s[detail] = m.admissions_per_s.get(detail, 0.0) + rate
        elif series in _STEP_SERIES:
            try:
                bucket = int(float(detail))
            except ValueError:
                return
            steps = m.prefill_step_seconds_by_bucket if series.startswith("prefill_") else m.step_seconds_by_bucket
            step_sum, step_count = steps.get(bucket, (0.0, 0.0))
            if series.endswith("_sum"):
                steps[bucket] = (step_sum + rate, step_count)
            else:
                steps[bucket] = (step_sum, step_count + rate)
        else:
            attribute = _RATE_ATTRIBUTES.get(series)
            if attribute is None:
                raise ValueError(f"unknown rate series {series!r}")
            setattr(m, attribute, (getattr(m, attribute) or 0.0) + rate)

    def add_gauge(self, key: ModelKey, series: str, value: float) -> None:
        """``series``: queue_depth and running add up over pods; kv_usage keeps the highest; pods counts;
        engine_running: an engine's own running set behind the gate, which replaces the gate's."""
        m = self._get(key)
        if not math.isfinite(value):
            return
        if series in _ENGINE_OWN:
            own = self._engine_own.setdefault(key, {})
            own[series] = own.get(series, 0.0) + value
        elif series == "queue_depth":
            m.queue_depth = (m.queue_depth or 0.0) + value
        elif series == "running":
            m.running = (m.running or 0.0) + value
        elif series == "kv_usage":
            m.kv_usage_max = value if m.kv_usage_max is None else max(m.kv_usage_max, value)
        elif series == "pods":
            m.pods_reporting += int(value)
        else:
            raise ValueError(f"unknown gauge series {series!r}")

    def build(self) -> dict[ModelKey, ModelMetrics]:
        for (key, latency_metric), buckets in self._buckets.items():
            self._metrics[key].latency[latency_metric] = histogram_from_buckets(buckets)
        for key, buckets in self._window_buckets.items():
            self._metrics[key].itl_window = histogram_from_buckets(buckets)
        for key, own in self._engine_own.items():
            metrics = self._metrics[key]
            for series, attribute in _ENGINE_OWN.items():
                if series in own:
                    setattr(metrics, attribute, own[series])
        return dict(self._metrics)


# The series an engine behind the gate reports of its own, by the attribute whose gate figure they replace.
_ENGINE_OWN = {"engine_running": "running", "engine_generated_tokens": "generated_tokens_per_s"}
_STEP_SERIES = ("step_sum", "step_count", "prefill_step_sum", "prefill_step_count")
_RATE_ATTRIBUTES = {
    "requests": "requests_per_s",
    "generated_tokens": "generated_tokens_per_s",
    "prompt_tokens": "prompt_tokens_per_s",
    "prefill_tokens": "prefill_tokens_per_s",
    "tail_marked": "tail_marked_per_s",
    "preemptions": "preemptions_per_s",
    "batch_sum": "decode_batch_sum_per_s",
    "batch_count": "decode_batch_count_per_s",
}


def _quantiles(metrics: ModelMetrics, name: str) -> tuple[tuple[Quantile, Quantile, Quantile], float]:
    """P50, P99, P99.9 of one latency histogram and the observations they rest on (NaN: unknown)."""
    histogram = metrics.latency.get(name)
    if histogram is not None and histogram.count > 0:
        p50, p99, p999 = (histogram.quantile(q) for q in (0.5, 0.99, 0.999))
        return (p50, p99, p999), histogram.count * metrics.window_s
    if name in metrics.latency_quantiles_s:
        # Prometheus returns the top finite bound for a quantile in +Inf: is_saturated recognises it.
        quantiles = metrics.latency_quantiles_s[name]
        p50, p99, p999 = (
            Quantile(v, is_saturated(v, LATENCY_BUCKETS[name]))
            if (v := quantiles.get(q)) is not None
            else Quantile(None)
            for q in (0.5, 0.99, 0.999)
        )
        count = metrics.latency_count_per_s.get(name)
        return (p50, p99, p999), count * metrics.window_s if count is not None else math.nan
    return (Quantile(None), Quantile(None), Quantile(None)), math.nan


def to_observations(metrics: ModelMetrics | None, latency_metric: str, at_s: float) -> Observations:
    """The policy's view of one profile: unknown figures stay NaN (never zero).

    The one builder of observations: the live sources (Prometheus, scraping) and the simulator
    all fill a :class:`ModelMetrics` with the same counters and come through here."""
    nan = math.nan
    if metrics is None:
        return Observations(at_s=at_s)
    (p50, p99, p999), samples = _quantiles(metrics, latency_metric)
    (_, itl_p99, _), _ = _quantiles(metrics, INTER_TOKEN)

    def num(value: float | None) -> float:
        known_value = finite_or_none(value)
        return nan if known_value is None else known_value

    return Observations(
        p50_s=num(p50.value_s),
        p99_s=num(p99.value_s),
        p999_s=num(p999.value_s),
        p99_saturated=p99.saturated,
        p999_saturated=p999.saturated,
        samples=samples,
        queue_depth=num(metrics.queue_depth),
        arrival_rate_per_s=num(metrics.requests_per_s),
        tokens_per_s=num(metrics.generated_tokens_per_s),
        mean_batch_size=num(metrics.mean_batch_size),
        batch_hit_ratio=num(metrics.batch_hit_ratio),
        tail_marked_share=num(metrics.tail_marked_share),
        itl_p99_s=num(itl_p99.value_s),
        itl_p99_saturated=itl_p99.saturated,
        itl_window_buckets=(
            tuple(zip(metrics.itl_window.upper_bounds, metrics.itl_window.cumulative, strict=True))
            if metrics.itl_window is not None
            else ()
        ),
        kv_usage_ratio=num(metrics.kv_usage_max),
        preemptions_per_s=num(metrics.preemptions_per_s),
        step_s_by_batch=metrics.step_time_per_batch_s(),
        prefill_s_per_token=num(metrics.prefill_seconds_per_token()),
        window_s=metrics.window_s,
        at_s=at_s,
    )
