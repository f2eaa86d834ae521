"""Observations without Prometheus: scrape the runtimes' ``/metrics`` and difference two scrapes.

Local mode without ``--prometheus-url`` uses this. Each tick scrapes every
runtime once; counters and histogram buckets are differenced against the
oldest scrape still inside the rate window (what ``rate()`` does over its
range), so that both sources feed the policy the same figures. A counter that
went down means the pod restarted: its current value is the increase, as
Prometheus assumes.

Each scrape has an overall deadline (``timeout_s``, the whole body included) and
a body cap (``max_body_bytes``): a pod whose ``/metrics`` never ends, or is
huge, is left out of that tick like an unreachable one, and holds the tick no
longer than the deadline.

The inter-token histogram's increase over the error budget's hour, which the
Prometheus source asks with ``increase(...[3600s])``, is summed here from the
increments between consecutive scrapes of each pod (:class:`GapHour`), so that
the policy's error-budget excuse and payback run in local mode and the demo too.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import httpx

from batchpilot_operator.io.engine_metrics import ExposedSeries, exposed_names
from batchpilot_operator.io.exposition import (
    BUCKET_SUFFIX,
    SeriesKey,
    bucket_bound,
    counter_increase,
    parse_exposition,
)
from batchpilot_operator.io.observe import RATE_COUNTERS, MetricsUnavailable
from batchpilot_operator.io.outbound import read_capped
from batchpilot_operator.tuning.model_metrics import (
    ERROR_BUDGET_WINDOW_S,
    INTER_TOKEN,
    LATENCY_HISTOGRAMS,
    MetricsBuilder,
    ModelKey,
    ModelMetrics,
)
from batchpilot_runtime.contract import metric_names as rm

_HISTOGRAM_TO_SLO = {histogram: slo for slo, histogram in LATENCY_HISTOGRAMS.items()}
_COUNTERS = {counter: series for series, counter in RATE_COUNTERS.items()}
_GAUGES = {rm.QUEUE_DEPTH: "queue_depth", rm.RUNNING_SEQUENCES: "running", rm.KV_CACHE_USAGE_RATIO: "kv_usage"}

# A runtime's exposition is about 250 KiB (four latency histograms of ~65 buckets per lane, the step-time
# histogram per phase and batch bucket); 8 MiB leaves room for many lanes and stops a runaway answer.
MAX_METRICS_BYTES = 8 << 20


@dataclass(frozen=True)
class Scrape:
    at_s: float
    series: dict[SeriesKey, float]


def metrics_from_scrapes(
    current: Scrape, oldest: Scrape | None, builder: MetricsBuilder, namespace: str = "", model: str = ""
) -> None:
    """Add one pod's rates (increase over the span / span) and gauges to ``builder``, whichever engine
    exported them (batchpilot's names, or vLLM's, SGLang's and llama-server's from :mod:`.engine_metrics`).
    ``model``: the target's model, for an engine whose series carry no model label (llama-server)."""
    span_s = current.at_s - oldest.at_s if oldest is not None else 0.0
    previous = oldest.series if oldest is not None else {}
    _foreign_from_scrapes(current, previous, span_s, builder, namespace, model)
    for (name, label_items), value in current.series.items():
        labels = dict(label_items)
        labelled_model = labels.get(rm.LABEL_MODEL)
        if not labelled_model or not math.isfinite(value):
            continue
        key = (namespace, labelled_model)
        if name in _GAUGES:
            builder.add_gauge(key, _GAUGES[name], value)
            if name == rm.QUEUE_DEPTH:
                builder.add_gauge(key, "pods", 1.0)
            continue
        if span_s <= 0:
            continue  # a first scrape: no rates yet
        rate = counter_increase(value, previous.get((name, label_items))) / span_s
        if (histogram_bound := bucket_bound(name, labels, _HISTOGRAM_TO_SLO)) is not None:
            histogram, bound = histogram_bound
            builder.add_bucket(key, _HISTOGRAM_TO_SLO[histogram], bound, rate)
        elif name in _COUNTERS:
            builder.add_rate(key, _COUNTERS[name], rate, labels.get(rm.LABEL_REASON, ""))
        elif name.startswith(rm.BATCH_SIZE) and labels.get(rm.LABEL_PHASE) == "decode":
            if name == f"{rm.BATCH_SIZE}_sum":
                builder.add_rate(key, "batch_sum", rate)
            elif name == f"{rm.BATCH_SIZE}_count":
                builder.add_rate(key, "batch_count", rate)
        elif name.startswith(rm.STEP_SECONDS) and (phase := labels.get(rm.LABEL_PHASE)) in rm.PHASES:
            bucket = labels.get(rm.LABEL_BATCH_BUCKET, "")
            prefix = "prefill_" if phase == "prefill" else ""
            if name == f"{rm.STEP_SECONDS}_sum":
                builder.add_rate(key, f"{prefix}step_sum", rate, bucket)
            elif name == f"{rm.STEP_SECONDS}_count":
                builder.add_rate(key, f"{prefix}step_count", rate, bucket)


_FOREIGN = exposed_names()


def _foreign_name(name: str) -> tuple[ExposedSeries, float | None] | None:
    """What an exposed sample of vLLM or SGLang feeds, and its bucket's ``le`` marker (NaN: a bucket)."""
    if name in _FOREIGN and _FOREIGN[name].kind != "latency":
        return _FOREIGN[name], None
    if name.endswith(BUCKET_SUFFIX) and (found := _FOREIGN.get(name.removesuffix(BUCKET_SUFFIX))) is not None:
        return (found, math.nan) if found.kind == "latency" else None
    return None


def _busy_slots(
    series: Mapping[SeriesKey, float], names: ExposedSeries, label_items: tuple[tuple[str, str], ...]
) -> float:
    """Busy slots summed over every decode call since start: the per-call mean times the calls (NaN: absent)."""
    decodes = names.engine.decodes
    per_decode = names.engine.busy_slots_per_decode
    if decodes is None or per_decode is None:
        return math.nan
    return series.get((per_decode, label_items), math.nan) * series.get((decodes, label_items), math.nan)


def _foreign_from_scrapes(
    current: Scrape,
    previous: Mapping[SeriesKey, float],
    span_s: float,
    builder: MetricsBuilder,
    namespace: str,
    target_model: str,
) -> None:
    """vLLM's, SGLang's and llama-server's series of one pod, by their tables; where a pod exports a metric
    under two names (a rename in progress), the newer name alone is read."""
    newest: dict[tuple[str, str, str], int] = {}
    for name, _ in current.series:
        if (found := _foreign_name(name)) is not None:
            exposed = found[0]
            metric = (exposed.engine.engine, exposed.kind, exposed.series)
            newest[metric] = min(newest.get(metric, exposed.rank), exposed.rank)
    for (name, label_items), value in current.series.items():
        found = _foreign_name(name)
        if found is None or not math.isfinite(value):
            continue
        exposed, bucket = found
        if exposed.rank != newest[(exposed.engine.engine, exposed.kind, exposed.series)]:
            continue
        labels = dict(label_items)
        model = labels.get(exposed.engine.model_label) or (target_model if exposed.engine.model_from_target else "")
        if not model:
            continue
        key = (namespace, model)
        if exposed.kind == "gauge":
            builder.add_gauge(key, exposed.series, value)
            if name == exposed.engine.pods_gauge:
                builder.add_gauge(key, "pods", 1.0)
            continue
        if span_s <= 0:
            continue  # a first scrape: no rates yet
        if exposed.kind == "busy_slots":
            busy_now = _busy_slots(current.series, exposed, label_items)
            busy_before = _busy_slots(previous, exposed, label_items)
            if math.isfinite(busy_now):
                before = busy_before if math.isfinite(busy_before) else None
                builder.add_rate(key, exposed.series, counter_increase(busy_now, before) / span_s)
            continue
        rate = counter_increase(value, previous.get((name, label_items))) / span_s
        if bucket is not None:
            try:
                builder.add_bucket(key, exposed.series, float(labels.get("le", "nan")), rate)
            except ValueError:
                continue
        else:
            builder.add_rate(key, exposed.series, rate)


class GapHour:
    """One pod's inter-token histogram increase over the last ``window_s``, from the increments
    between its consecutive scrapes.

    Increments are summed into slots of ``slot_s`` by the time of the scrape that saw them, so the
    memory is bounded (``window_s / slot_s + 1`` slots of one histogram, whatever the scrape
    interval) and the window's start is exact to a slot (a minute of the hour by default).
    """

    def __init__(self, window_s: float = ERROR_BUDGET_WINDOW_S, slot_s: float = 60.0) -> None:
        if not 0 < slot_s <= window_s:
            raise ValueError(f"slot_s must lie in (0, window_s], got {slot_s}")
        self.window_s = window_s
        self.slot_s = slot_s
        self._slots: deque[tuple[int, dict[float, float]]] = deque()  # (slot index, cumulative increments)

    def add(self, at_s: float, cumulative: Mapping[float, float]) -> None:
        """The increments seen by the scrape at ``at_s``, as cumulative counts by upper bound."""
        index = math.floor(at_s / self.slot_s)
        if not self._slots or self._slots[-1][0] != index:
            self._slots.append((index, {}))
        counts = self._slots[-1][1]
        for bound, count in cumulative.items():
            counts[bound] = counts.get(bound, 0.0) + count
        self._forget_before(at_s)

    def total(self, now_s: float) -> dict[float, float]:
        """Cumulative counts by upper bound over the window ending at ``now_s`` (empty: nothing seen)."""
        self._forget_before(now_s)
        total: dict[float, float] = {}
        for _, counts in self._slots:
            for bound, count in counts.items():
                total[bound] = total.get(bound, 0.0) + count
        return total

    @property
    def slots_held(self) -> int:
        return len(self._slots)

    def _forget_before(self, now_s: float) -> None:
        # A slot leaves once it ends at or before the window's start.
        while self._slots and (self._slots[0][0] + 1) * self.slot_s <= now_s - self.window_s:
            self._slots.popleft()


def gap_increments(
    current: Scrape, previous: Scrape, namespace: str = "", model: str = ""
) -> dict[ModelKey, dict[float, float]]:
    """Each model's inter-token histogram increase between two scrapes of one pod, as cumulative
    counts by upper bound, read through the same names as the rates (any engine's)."""
    span_s = current.at_s - previous.at_s
    if span_s <= 0:
        return {}
    builder = MetricsBuilder(span_s)
    metrics_from_scrapes(current, previous, builder, namespace, model)
    increments: dict[ModelKey, dict[float, float]] = {}
    for key, metrics in builder.build().items():
        gaps = metrics.latency.get(INTER_TOKEN)
        if gaps is not None:
            increments[key] = {
                bound: rate * span_s for bound, rate in zip(gaps.upper_bounds, gaps.cumulative, strict=True)
            }
    return increments


class ScrapeSource:
    """Scrapes each runtime's ``/metrics`` once per tick and keeps the scrapes of the last rate window."""

    def __init__(
        self,
        *,
        rate_window_s: float = 60.0,
        timeout_s: float = 3.0,
        max_body_bytes: int = MAX_METRICS_BYTES,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate_window_s = rate_window_s
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._clock = clock
        self._history: dict[str, deque[Scrape]] = {}
        self._by_url: dict[str, dict[ModelKey, ModelMetrics]] = {}  # each pod's figures from the last collect
        # Each pod's gaps over the error budget's hour, by the target it is scraped for, then by model.
        self._gap_hours: dict[tuple[ModelKey, str], dict[ModelKey, GapHour]] = {}
        self.scrapes_total = 0

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _scrape(self, url: str) -> Scrape:
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._client.stream("GET", url, timeout=self.timeout_s) as response:
                    response.raise_for_status()
                    body = await read_capped(response, self.max_body_bytes)
        except TimeoutError:
            raise MetricsUnavailable(f"no complete answer within {self.timeout_s:g} s") from None
        return Scrape(self._clock(), parse_exposition(body.decode("utf-8", errors="replace")))

    def _oldest_within_window(self, url: str, current: Scrape) -> Scrape | None:
        history = self._history.setdefault(url, deque())
        # Keep one scrape at or beyond the window edge so the span covers the whole window.
        while len(history) >= 2 and current.at_s - history[1].at_s >= self.rate_window_s:
            history.popleft()
        oldest = history[0] if history else None
        history.append(current)
        return oldest

    async def collect(
        self, targets: Mapping[ModelKey, Sequence[str]], engines: Collection[str] = ()
    ) -> dict[ModelKey, ModelMetrics]:
        """Scrape every URL of every key concurrently. Unreachable pods are left out; when no pod
        answers at all the whole collection is unavailable. ``engines`` is not needed: each exposed
        name says which engine's it is."""
        del engines
        urls = sorted({(key, url) for key, key_urls in targets.items() for url in key_urls})
        results = await asyncio.gather(*(self._scrape(url) for _, url in urls), return_exceptions=True)
        self.scrapes_total += len(urls)
        builder = MetricsBuilder(self.rate_window_s)
        failures: list[str] = []
        for (key, url), result in zip(urls, results, strict=True):
            if isinstance(result, BaseException):
                failures.append(f"{url}: {type(result).__name__}: {result}")
                self._history.pop(url, None)
                self._by_url.pop(url, None)
                continue
            history = self._history.get(url)
            previous = history[-1] if history else None
            oldest = self._oldest_within_window(url, result)
            metrics_from_scrapes(result, oldest, builder, namespace=key[0], model=key[1])
            self._add_gap_hour(key, url, result, previous, builder)
            # The same scrapes alone: this pod's figures, for a canary (collect_pods).
            own = MetricsBuilder(result.at_s - oldest.at_s if oldest is not None else 0.0)
            metrics_from_scrapes(result, oldest, own, namespace=key[0], model=key[1])
            self._by_url[url] = own.build()
        if urls and len(failures) == len(urls):
            raise MetricsUnavailable("no runtime answered /metrics: " + "; ".join(failures[:3]))
        for url in set(self._by_url) - {url for _, url in urls}:
            del self._by_url[url]  # a pod no longer scraped
        for target in set(self._gap_hours) - set(urls):
            del self._gap_hours[target]
        built = builder.build()
        spans = [h[-1].at_s - h[0].at_s for _, u in urls if (h := self._history.get(u))]
        for metrics in built.values():
            metrics.window_s = max(spans, default=0.0)
        return built

    def _add_gap_hour(
        self, key: ModelKey, url: str, current: Scrape, previous: Scrape | None, builder: MetricsBuilder
    ) -> None:
        """Adds the gaps since ``previous`` to the pod's hour, and the hour to ``builder``. A pod that missed
        a scrape keeps its hour but not the gaps of the span it missed (its history starts again)."""
        hours = self._gap_hours.setdefault((key, url), {})
        if previous is not None:
            for model_key, increments in gap_increments(current, previous, *key).items():
                hours.setdefault(model_key, GapHour()).add(current.at_s, increments)
        for model_key, hour in hours.items():
            for bound, count in hour.total(current.at_s).items():
                builder.add_window_bucket(model_key, bound, count)

    async def collect_pods(
        self, targets: Mapping[ModelKey, Mapping[str, str]]
    ) -> dict[ModelKey, dict[str, ModelMetrics]]:
        """Each pod's figures (by pod name) from the scrapes of the last :meth:`collect`, which scraped every
        pod already: no request here, and a pod that did not answer then has none."""
        per_key: dict[ModelKey, dict[str, ModelMetrics]] = {}
        for key, pods in targets.items():
            for pod, url in pods.items():
                metrics = self._by_url.get(url, {}).get(key)
                if metrics is not None:
                    per_key.setdefault(key, {})[pod] = metrics
        return per_key
