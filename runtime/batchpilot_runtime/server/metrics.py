"""The Prometheus exporter: every metric of ``metric_names``, fed by the engine as its observer.

``MetricsExporter`` implements ``engine.EngineObserver``; the engine thread calls it after
each step and each finished request, and the HTTP layer calls it for what the engine never
sees (requests refused before they reach the queue). prometheus_client's metrics are
thread-safe, so no lock is needed here. Each exporter owns its registry, so that several
runtimes can live in one process (tests, the demo).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from batchpilot_runtime.contract import metric_names as mn
from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, WindowState

if TYPE_CHECKING:
    from batchpilot_runtime.engine.watchdog import EngineHealth
    from batchpilot_runtime.scheduling.types import RequestTimings, StepStats

EXPOSITION_CONTENT_TYPE = CONTENT_TYPE_LATEST
# Finish reasons and engine outcomes that count as a completed request.
_COMPLETED_ALIASES = frozenset({"completed", "length", "stop"})


def normalize_outcome(outcome: str) -> str:
    """Map an engine outcome or finish reason onto the bounded ``outcome`` label values."""
    if outcome in _COMPLETED_ALIASES:
        return "completed"
    return outcome if outcome in mn.OUTCOMES else "error"


class MetricsExporter:
    """Owns one registry holding every runtime metric, all labelled with this pod's model."""

    def __init__(self, model_name: str, lanes: Iterable[str] = (DEFAULT_LANE,)) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._histograms: dict[str, Histogram] = {}
        self._gauges: dict[str, Gauge] = {}
        self._counters: dict[str, Counter] = {}
        for spec in mn.RUNTIME_METRICS:
            if spec.type == "histogram":
                self._histograms[spec.name] = Histogram(
                    spec.name, spec.help, spec.labels, registry=self.registry, buckets=spec.buckets
                )
            elif spec.type == "gauge":
                self._gauges[spec.name] = Gauge(spec.name, spec.help, spec.labels, registry=self.registry)
            else:
                self._counters[spec.name] = Counter(spec.name, spec.help, spec.labels, registry=self.registry)
        self._known_lanes: set[str] = set()
        self._touch_series(lanes)

    def _touch_series(self, lanes: Iterable[str]) -> None:
        """Create every bounded label combination up front, so that series exist (at 0) before
        their first event and PromQL ``rate()`` sees the first increment."""
        model = self.model_name
        for name in (
            mn.QUEUE_DEPTH,
            mn.RUNNING_SEQUENCES,
            mn.KV_CACHE_USAGE_RATIO,
            mn.WINDOW_TARGET_BATCH_SIZE,
            mn.WINDOW_HARD_CAP,
            mn.WINDOW_MAX_WAIT_SECONDS,
            mn.WINDOW_GENERATION,
            mn.WINDOW_MAX_PREFILL_TOKENS,
            mn.ENGINE_STALLED,
            mn.ENGINE_STALL_SECONDS,
        ):
            self._gauges[name].labels(model=model)
        for name in (
            mn.GENERATED_TOKENS_TOTAL,
            mn.PROMPT_TOKENS_TOTAL,
            mn.PREFILL_TOKENS_TOTAL,
            mn.TAIL_MARKED_TOTAL,
            mn.PREEMPTIONS_TOTAL,
        ):
            self._counters[name].labels(model=model)
        for outcome in mn.OUTCOMES:
            self._counters[mn.REQUESTS_TOTAL].labels(model=model, outcome=outcome)
        for reason in mn.ADMISSION_REASONS:
            self._counters[mn.ADMISSIONS_TOTAL].labels(model=model, reason=reason)
        for phase in mn.PHASES:
            self._histograms[mn.BATCH_SIZE].labels(model=model, phase=phase)
        self.add_lanes(lanes)

    def add_lanes(self, lanes: Iterable[str]) -> None:
        """Create the per-lane series of lanes not seen yet (lanes can arrive with a window update)."""
        for lane in lanes:
            if lane in self._known_lanes:
                continue
            self._known_lanes.add(lane)
            for name in (mn.QUEUE_WAIT_SECONDS, mn.TTFT_SECONDS, mn.REQUEST_LATENCY_SECONDS, mn.INTER_TOKEN_SECONDS):
                self._histograms[name].labels(model=self.model_name, lane=lane)

    # -- EngineObserver (called on the engine thread) ------------------------------------------

    def on_step(self, stats: StepStats, step_seconds: float, forward_seconds: float) -> None:
        model = self.model_name
        if stats.batch_size > 0:
            # A step that prefills anything is a prefill step: its time is dominated by the prompt tokens.
            phase = "prefill" if stats.num_prefill_seqs > 0 else "decode"
            self._histograms[mn.STEP_SECONDS].labels(
                model=model, phase=phase, batch_bucket=mn.batch_bucket(stats.batch_size)
            ).observe(step_seconds)
            if stats.num_prefill_seqs > 0:
                self._histograms[mn.BATCH_SIZE].labels(model=model, phase="prefill").observe(stats.num_prefill_seqs)
                self._counters[mn.PREFILL_TOKENS_TOTAL].labels(model=model).inc(stats.num_prefill_tokens)
            if stats.num_decode_seqs > 0:
                self._histograms[mn.BATCH_SIZE].labels(model=model, phase="decode").observe(stats.num_decode_seqs)
        for reason, groups in stats.admissions.items():
            if groups > 0 and reason in mn.ADMISSION_REASONS:
                self._counters[mn.ADMISSIONS_TOTAL].labels(model=model, reason=reason).inc(groups)
        if stats.tail_marked > 0:
            self._counters[mn.TAIL_MARKED_TOTAL].labels(model=model).inc(stats.tail_marked)
        if stats.preempted > 0:
            self._counters[mn.PREEMPTIONS_TOTAL].labels(model=model).inc(stats.preempted)
        self.set_load(stats.queue_depth, stats.running, stats.kv_usage_ratio)

    def on_admitted(self, lane: str, queue_wait_s: float) -> None:
        self.add_lanes((lane,))
        self._histograms[mn.QUEUE_WAIT_SECONDS].labels(model=self.model_name, lane=lane).observe(max(0.0, queue_wait_s))

    def on_first_token(self, lane: str, ttft_s: float) -> None:
        self.add_lanes((lane,))
        self._histograms[mn.TTFT_SECONDS].labels(model=self.model_name, lane=lane).observe(max(0.0, ttft_s))

    def on_request_finished(self, timings: RequestTimings, outcome: str) -> None:
        # The queue wait and TTFT were observed when they happened (on_admitted, on_first_token).
        model = self.model_name
        lane = timings.lane
        self.add_lanes((lane,))
        label = normalize_outcome(outcome)
        if label == "completed" and timings.finished_s is not None:
            self._histograms[mn.REQUEST_LATENCY_SECONDS].labels(model=model, lane=lane).observe(
                max(0.0, timings.finished_s - timings.arrival_s)
            )
        self._counters[mn.REQUESTS_TOTAL].labels(model=model, outcome=label).inc()
        if timings.first_admitted_s is not None:
            self._counters[mn.PROMPT_TOKENS_TOTAL].labels(model=model).inc(timings.prompt_tokens)

    def on_tokens(self, lane: str, inter_token_gaps_s: Sequence[float]) -> None:
        histogram = self._histograms[mn.INTER_TOKEN_SECONDS].labels(model=self.model_name, lane=lane)
        for gap_s in inter_token_gaps_s:
            histogram.observe(max(0.0, gap_s))

    def on_window(self, state: WindowState) -> None:
        model = self.model_name
        window = state.window
        self._gauges[mn.WINDOW_TARGET_BATCH_SIZE].labels(model=model).set(window.target_batch_size)
        self._gauges[mn.WINDOW_HARD_CAP].labels(model=model).set(window.hard_cap)
        self._gauges[mn.WINDOW_MAX_WAIT_SECONDS].labels(model=model).set(window.max_wait_ms / 1000.0)
        self._gauges[mn.WINDOW_GENERATION].labels(model=model).set(window.generation)
        self._gauges[mn.WINDOW_MAX_PREFILL_TOKENS].labels(model=model).set(state.prefill_budget_tokens or 0)
        self.add_lanes(lane.name for lane in state.lanes)

    # -- what the HTTP layer sees ---------------------------------------------------------------

    def on_generated_tokens(self, count: int) -> None:
        """Tokens streamed to clients; counted as they are produced so that tokens/s is live."""
        if count > 0:
            self._counters[mn.GENERATED_TOKENS_TOTAL].labels(model=self.model_name).inc(count)

    def on_rejected(self) -> None:
        """A request refused before it reached the engine (queue full, draining, too long for KV)."""
        self._counters[mn.REQUESTS_TOTAL].labels(model=self.model_name, outcome="rejected").inc()

    def set_load(self, queue_depth: int, running: int, kv_usage_ratio: float) -> None:
        model = self.model_name
        self._gauges[mn.QUEUE_DEPTH].labels(model=model).set(queue_depth)
        self._gauges[mn.RUNNING_SEQUENCES].labels(model=model).set(running)
        self._gauges[mn.KV_CACHE_USAGE_RATIO].labels(model=model).set(kv_usage_ratio)

    def watch_engine(self, health: Callable[[], EngineHealth]) -> None:
        """Read the engine watchdog at every scrape: a hung engine thread cannot report itself."""
        model = self.model_name
        self._gauges[mn.ENGINE_STALLED].labels(model=model).set_function(lambda: float(health().stalled))
        self._gauges[mn.ENGINE_STALL_SECONDS].labels(model=model).set_function(lambda: health().stall_s)

    def exposition(self) -> bytes:
        """The text exposition format (version 0.0.4) of every metric."""
        return generate_latest(self.registry)
