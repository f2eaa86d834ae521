"""Discrete-event simulator: the runtime's real scheduler on a virtual clock.

The simulator replays a trace (arrival times and token counts) into
:class:`batchpilot_runtime.scheduling.scheduler.Scheduler`, the very code the engine runs, with
synthetic token ids. One engine step is ``schedule(now)``, a duration from the
:class:`~batchpilot_runtime.replay.cost_model.CostModel` for the plan's composition, then
``update_from_output(plan, sampled, now + duration)``. Between steps the clock jumps to the
next arrival, the scheduler's next admission deadline, or the next controller tick.

Every ``interval_s`` a *controller* (the tuning policy, a static window, AIMD...) sees the
figures the operator would see: quantiles of the SLO's latency metric read from the
runtime's own histogram buckets over a rate window, queue depth, arrival rate, KV usage
and so on, as :class:`~batchpilot_operator.tuning.observations.Observations`, and may put a new
window in force; the scheduler applies it at the next step boundary, as the runtime does.

Deterministic: no wall clock, no randomness (token ids are fixed, the trace is the input).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from batchpilot_operator.api.profile import LatencyMetric
from batchpilot_operator.sim.intervals import (
    ITL_BUCKETS_S,
    ITL_NUM_BUCKETS,
    LATENCY_BUCKETS_S,
    Interval,
    interval_metrics,
)
from batchpilot_operator.tuning.model_metrics import ERROR_BUDGET_WINDOW_S, to_observations
from batchpilot_operator.tuning.observations import NAN, Observations
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import CostModel, StepComposition
from batchpilot_runtime.replay.trace import TraceRequest
from batchpilot_runtime.scheduling.kv_blocks import blocks_for_tokens
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import (
    QueueFullError,
    RequestOutput,
    RequestRejected,
    SchedRequest,
    ScheduledSeq,
    SchedulerConfig,
)

# The token every simulated step "samples": never a stop token, so requests end by length.
SYNTHETIC_TOKEN = 7
# Exact inter-token quantiles over a whole run come from a fine histogram (0.1 ms bins up to 60 s):
# millions of gaps, no list of them.
GAP_BIN_S = 1e-4
_GAP_BINS = 600_000


class GapHistogram:
    """Every inter-token gap of a run, in 0.1 ms bins (the last bin holds everything longer)."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (_GAP_BINS + 1)
        self.total = 0

    def add(self, gap_s: float, count: int = 1) -> None:
        self.counts[min(_GAP_BINS, int(gap_s / GAP_BIN_S))] += count
        self.total += count

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile, as the upper edge of its bin (NaN without gaps)."""
        if self.total == 0:
            return NAN
        rank = max(1, math.ceil(q * self.total))
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return math.inf if index == _GAP_BINS else (index + 1) * GAP_BIN_S
        return math.inf


class Controller(Protocol):
    """Decides the window at each interval from what the operator would observe."""

    name: str

    def on_interval(self, now_s: float, observations: Observations, window: Window) -> Window | None:
        """A new window to put in force, or None to keep the one in force."""
        ...


@dataclass(frozen=True)
class SimConfig:
    """How to run one simulation.

    ``rate_window_s`` is the PromQL rate window the observations are computed over.
    ``max_sim_s`` stops the run (requests still unfinished count as missing the SLO);
    ``abort_after_misses`` stops it early once that many requests have missed the SLO
    (the grid search uses it to drop windows that cannot meet the SLO);
    ``abort_after_gap_misses`` once that many inter-token gaps exceeded ``slo_itl_p99_s``.
    """

    cost: CostModel
    scheduler: SchedulerConfig
    slo_p99_s: float
    latency_metric: LatencyMetric = LatencyMetric.TTFT
    slo_itl_p99_s: float | None = None
    interval_s: float = 15.0
    rate_window_s: float = 60.0
    max_sim_s: float | None = None
    abort_after_misses: int | None = None
    record_timeline: bool = True
    # (time, cost model): from that time on steps cost what the second model says (a heavier model
    # version rolled out mid-replay, say).
    cost_change: tuple[float, CostModel] | None = None
    abort_after_gap_misses: int | None = None
    # A per-step prompt budget derived from an inter-token target (what fits in it after the
    # step's decodes, from the cost model itself: an oracle no live engine has); None: off.
    step_budget_itl_s: float | None = None

    def __post_init__(self) -> None:
        if not self.slo_p99_s > 0:
            raise ValueError(f"slo_p99_s must be > 0, got {self.slo_p99_s}")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if not self.rate_window_s > 0:
            raise ValueError(f"rate_window_s must be > 0, got {self.rate_window_s}")


def scheduler_config_for(
    cost: CostModel,
    kv_block_size: int = 16,
    max_model_len: int = 8192,
    max_prefill_tokens_per_step: int | None = None,
    max_queue: int = 4096,
    kv_capacity_tokens: int | None = None,
) -> SchedulerConfig:
    """A scheduler config whose KV pool holds the cost profile's KV capacity."""
    capacity = kv_capacity_tokens or cost.kv_capacity_tokens or 65_536
    return SchedulerConfig(
        num_kv_blocks=max(1, blocks_for_tokens(capacity, kv_block_size) - 1),
        kv_block_size=kv_block_size,
        max_model_len=max_model_len,
        max_prefill_tokens_per_step=max_prefill_tokens_per_step,
        max_queue=max_queue,
    )


@dataclass
class RequestRecord:
    """What happened to one trace request (times in seconds; NaN = never happened)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    admitted_s: float = NAN
    first_token_s: float = NAN
    last_token_s: float = NAN
    finished_s: float = NAN
    rejected: bool = False

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for a one-token answer; inf when unfinished)."""
        if math.isnan(self.finished_s):
            return math.inf
        return (self.finished_s - self.first_token_s) / max(1, self.output_tokens - 1)

    @property
    def queue_wait_s(self) -> float:
        return self.admitted_s - self.arrival_s if not math.isnan(self.admitted_s) else math.inf

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s if not math.isnan(self.first_token_s) else math.inf

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s if not math.isnan(self.finished_s) else math.inf

    def latency_s(self, metric: LatencyMetric) -> float:
        if metric == LatencyMetric.QUEUE_WAIT:
            return self.queue_wait_s
        if metric == LatencyMetric.E2E:
            return self.e2e_s
        return self.ttft_s


@dataclass(frozen=True)
class TimelinePoint:
    t_s: float
    arrival_rate_per_s: float  # arrivals over the rate window (the observations count requests that ended)
    p99_s: float
    itl_p99_s: float
    queue_depth: int
    running: int
    kv_usage_ratio: float
    target_batch_size: int
    hard_cap: int
    max_wait_ms: int
    tail_mark_ratio: float
    max_prefill_tokens: int | None
    changed: bool


@dataclass
class SimResult:
    records: list[RequestRecord]
    timeline: list[TimelinePoint]
    interval_admissions: list[tuple[float, dict[str, int]]]  # (arrival rate, admissions by reason) per interval
    window_changes: int
    final_window: Window
    sim_end_s: float
    steps: int
    aborted: bool
    trace_span_s: float
    gaps: GapHistogram = field(default_factory=GapHistogram)


class Simulator:
    """Replays ``requests`` through a fresh :class:`Scheduler` under ``controller``."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        window: Window,
        config: SimConfig,
        controller: Controller | None = None,
    ) -> None:
        self.requests = requests
        self.initial_window = window
        self.config = config
        self.controller = controller

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        cfg = self.config
        cost = cfg.cost
        sched = Scheduler(cfg.scheduler, self.initial_window)
        if cfg.step_budget_itl_s is not None:
            sched.set_step_budget_rule(itl_budget_rule(cost, cfg.step_budget_itl_s))
        requests = self.requests
        n = len(requests)
        records = [RequestRecord(i, r.arrival_s, r.prompt_tokens, r.output_tokens) for i, r in enumerate(requests)]
        end_limit_s = cfg.max_sim_s if cfg.max_sim_s is not None else math.inf
        ticks = _Ticks(cfg, self.controller, self.initial_window, progress)
        tally = _Tally(records, cfg, ticks.current)
        current = ticks.current
        next_tick_s = ticks.next_tick_s
        miss_limit = cfg.abort_after_misses if cfg.abort_after_misses is not None else math.inf
        gap_miss_limit = cfg.abort_after_gap_misses if cfg.abort_after_gap_misses is not None else math.inf
        steps = 0
        aborted = False
        next_arrival = 0
        now_s = 0.0
        prompt_cache: dict[int, tuple[int, ...]] = {}
        while True:
            # 1. Arrivals up to now enter the queue (their arrival time is their own, not now).
            if next_arrival < n and requests[next_arrival].arrival_s <= now_s:
                first = next_arrival
                next_arrival, rejected = _enqueue_arrivals(sched, requests, first, now_s, records, prompt_cache)
                tally.misses += rejected
                current.arrivals += next_arrival - first
                current.ended_requests += rejected
            # 2. Controller ticks that are due: observe, decide, stage the window.
            if next_tick_s <= now_s:
                ticks.run_due(now_s, sched)
                current = tally.current = ticks.current
                next_tick_s = ticks.next_tick_s
            if tally.misses > miss_limit or tally.gap_misses > gap_miss_limit:
                aborted = True
                break
            if now_s >= end_limit_s:
                break
            # 3. One step, or a jump to the next event when there is nothing to run.
            plan = sched.schedule(now_s)
            if plan.is_empty:
                next_arrival_s = requests[next_arrival].arrival_s if next_arrival < n else None
                next_event_s = _next_event_s(now_s, next_tick_s, next_arrival_s, sched)
                if next_event_s is None:
                    break
                now_s = next_event_s
                continue
            stats = plan.stats
            seqs = plan.seqs
            if cfg.cost_change is not None and now_s >= cfg.cost_change[0]:
                cost = cfg.cost_change[1]
            step_s = cost.step_seconds(StepComposition.from_seqs(seqs))
            start_s = now_s
            now_s = start_s + step_s
            steps += 1
            if stats.admitted_requests:
                tally.admitted(seqs, start_s)
            current.add_step(stats, step_s)
            sampled = {seq.request_id: SYNTHETIC_TOKEN for seq in seqs if seq.sample}
            outputs = sched.update_from_output(plan, sampled, now_s)
            current.generated_tokens += len(outputs)
            tally.outputs(outputs, now_s)
        tally.gaps.total = sum(tally.gaps.counts)
        return SimResult(
            gaps=tally.gaps,
            records=records,
            timeline=ticks.timeline,
            interval_admissions=ticks.interval_admissions,
            window_changes=ticks.changes,
            final_window=ticks.window,
            sim_end_s=now_s,
            steps=steps,
            aborted=aborted,
            trace_span_s=requests[-1].arrival_s if n else 0.0,
        )

    @staticmethod
    def _observations(
        recent: Sequence[Interval],
        cfg: SimConfig,
        sched: Scheduler,
        now_s: float,
        itl_window_counts: Sequence[int] = (),
    ) -> Observations:
        """What the operator's queries would return over the last rate window (and the gaps over the
        error budget's window): the simulator's counters as the live sources' :class:`ModelMetrics`,
        through the same builder."""
        return to_observations(
            interval_metrics(recent, cfg.interval_s, cfg.latency_metric, sched, itl_window_counts),
            cfg.latency_metric,
            now_s,
        )


def _enqueue_arrivals(
    sched: Scheduler,
    requests: Sequence[TraceRequest],
    first: int,
    now_s: float,
    records: list[RequestRecord],
    prompt_cache: dict[int, tuple[int, ...]],
) -> tuple[int, int]:
    """Hands the scheduler the requests from ``first`` on that arrived by ``now_s``; returns the
    index of the next one still to arrive and how many the scheduler rejected."""
    n = len(requests)
    index = first
    rejected = 0
    while index < n and requests[index].arrival_s <= now_s:
        req = requests[index]
        length = req.prompt_tokens
        prompt = prompt_cache.get(length)
        if prompt is None:
            prompt = (SYNTHETIC_TOKEN,) * length
            prompt_cache[length] = prompt
        try:
            sched.add_request(SchedRequest(str(index), prompt, max(1, req.output_tokens), req.arrival_s))
        except (QueueFullError, RequestRejected):
            records[index].rejected = True
            rejected += 1
        index += 1
    return index, rejected


def _next_event_s(now_s: float, next_tick_s: float, next_arrival_s: float | None, sched: Scheduler) -> float | None:
    """When an idle scheduler next has something to do: the next tick, arrival or admission
    deadline; None when every request has arrived and finished."""
    candidates = [next_tick_s]
    if next_arrival_s is not None:
        candidates.append(next_arrival_s)
    deadline = sched.next_deadline_s()
    if deadline is not None and deadline > now_s:
        candidates.append(deadline)
    if next_arrival_s is None and not sched.has_unfinished:
        return None
    return max(now_s, min(candidates))


class _Tally:
    """A run's per-request accounting: admission and token times, the latency metric's
    observations against the SLO, inter-token gaps, and the misses of both."""

    def __init__(self, records: list[RequestRecord], cfg: SimConfig, current: Interval) -> None:
        self.records = records
        self.metric = cfg.latency_metric
        self.slo_s = cfg.slo_p99_s
        self.itl_slo_s = cfg.slo_itl_p99_s if cfg.slo_itl_p99_s is not None else math.inf
        self.current = current  # the interval being counted; the run swaps it at each tick
        self.gaps = GapHistogram()
        self.misses = 0
        self.gap_misses = 0

    def observe(self, value_s: float) -> None:
        self.current.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS_S, value_s)] += 1
        if value_s > self.slo_s:
            self.misses += 1

    def admitted(self, seqs: Sequence[ScheduledSeq], start_s: float) -> None:
        """Admissions: a first prefill chunk of a never-admitted request."""
        records = self.records
        for seq in seqs:
            if seq.is_prefill and seq.start_pos == 0:
                record = records[int(seq.request_id)]
                if math.isnan(record.admitted_s):
                    record.admitted_s = start_s
                    if self.metric == LatencyMetric.QUEUE_WAIT:
                        self.observe(start_s - record.arrival_s)

    def outputs(self, outputs: Sequence[RequestOutput], now_s: float) -> None:
        """Tokens emitted by the step that ended at ``now_s``."""
        records = self.records
        metric = self.metric
        buckets = ITL_BUCKETS_S
        itl_buckets = self.current.itl_buckets
        gap_counts = self.gaps.counts
        itl_slo_s = self.itl_slo_s
        for out in outputs:
            record = records[int(out.request_id)]
            last_s = record.last_token_s
            record.last_token_s = now_s
            if last_s == last_s:  # not NaN: a gap since this request's previous token (stalls included)
                gap_s = now_s - last_s
                itl_buckets[bisect.bisect_left(buckets, gap_s)] += 1
                gap_counts[min(_GAP_BINS, int(gap_s / GAP_BIN_S))] += 1
                if gap_s > itl_slo_s:
                    self.gap_misses += 1
            elif metric == LatencyMetric.TTFT:
                self.observe(now_s - record.arrival_s)
            if math.isnan(record.first_token_s):
                record.first_token_s = now_s
            if out.finish_reason is not None:
                record.finished_s = now_s
                self.current.ended_requests += 1
                if metric == LatencyMetric.E2E:
                    self.observe(now_s - record.arrival_s)


class _Ticks:
    """The controller's side of a run: one tick per ``interval_s`` observes the last rate window,
    lets the controller decide, stages its window, and starts the next interval's counters."""

    def __init__(
        self, cfg: SimConfig, controller: Controller | None, window: Window, progress: Callable[[float], None] | None
    ) -> None:
        self.cfg = cfg
        self.controller = controller
        self.window = window
        self.progress = progress
        self.intervals: list[Interval] = [Interval()]
        self.current = self.intervals[0]
        self.window_len = max(1, math.ceil(cfg.rate_window_s / cfg.interval_s - 1e-9))
        self.timeline: list[TimelinePoint] = []
        self.interval_admissions: list[tuple[float, dict[str, int]]] = []
        self.changes = 0
        self.next_tick_s = cfg.interval_s
        # The gaps of the error budget's window, per bucket: a running sum over its intervals.
        self.budget_intervals: deque[list[int]] = deque()
        self.budget_len = max(1, math.ceil(ERROR_BUDGET_WINDOW_S / cfg.interval_s - 1e-9))
        self.budget_counts = [0] * ITL_NUM_BUCKETS

    def run_due(self, now_s: float, sched: Scheduler) -> None:
        while self.next_tick_s <= now_s:
            self._tick(sched)

    def _tick(self, sched: Scheduler) -> None:
        cfg = self.cfg
        tick_s = self.next_tick_s
        current = self.current
        self._count_budget_window(current)
        recent = self.intervals[-self.window_len :]
        obs = Simulator._observations(recent, cfg, sched, tick_s, self.budget_counts)
        self.interval_admissions.append((current.arrivals / cfg.interval_s, dict(current.admissions)))
        changed = False
        if self.controller is not None:
            proposal = self.controller.on_interval(tick_s, obs, self.window)
            if proposal is not None and not proposal.fields_equal(self.window):
                # The loop numbers what it puts in force, as the operator's controller does.
                self.window = proposal.with_generation(self.window.generation + 1)
                sched.set_window(self.window)
                self.changes += 1
                changed = True
        if cfg.record_timeline:
            arrival_rate_per_s = sum(interval.arrivals for interval in recent) / (len(recent) * cfg.interval_s)
            self.timeline.append(self._point(tick_s, arrival_rate_per_s, obs, sched, changed))
        self.current = Interval()
        self.intervals.append(self.current)
        if len(self.intervals) > self.window_len + 1:
            del self.intervals[0]
        self.next_tick_s += cfg.interval_s
        if self.progress is not None:
            self.progress(self.next_tick_s)

    def _count_budget_window(self, ended: Interval) -> None:
        counts = self.budget_counts
        for i, count in enumerate(ended.itl_buckets):
            counts[i] += count
        self.budget_intervals.append(ended.itl_buckets)
        if len(self.budget_intervals) > self.budget_len:
            for i, count in enumerate(self.budget_intervals.popleft()):
                counts[i] -= count

    def _point(
        self, tick_s: float, arrival_rate_per_s: float, obs: Observations, sched: Scheduler, changed: bool
    ) -> TimelinePoint:
        window = self.window
        return TimelinePoint(
            tick_s,
            arrival_rate_per_s,
            obs.p99_s if not obs.p99_saturated else math.inf,
            obs.itl_p99_s if not obs.itl_p99_saturated else math.inf,
            sched.num_waiting,
            sched.num_running,
            sched.kv_usage_ratio,
            window.target_batch_size,
            window.hard_cap,
            window.max_wait_ms,
            window.tail_mark_ratio,
            window.max_prefill_tokens or self.cfg.scheduler.max_prefill_tokens_per_step,
            changed,
        )


def itl_budget_rule(cost: CostModel, itl_target_s: float) -> Callable[[int, int], float]:
    """Prompt tokens that fit in ``itl_target_s`` after a step's decodes (a prompt token also adds
    a KV token); the step's first chunk may still overrun it when the decodes alone fill it."""
    per_token_s = cost.per_prefill_token_s + cost.per_kv_token_s

    def rule(decode_seqs: int, decode_kv_tokens: int) -> float:
        left_s = itl_target_s - cost.step_seconds(StepComposition(0, decode_seqs, decode_kv_tokens))
        return math.inf if per_token_s <= 0 else max(0.0, left_s / per_token_s)

    return rule
