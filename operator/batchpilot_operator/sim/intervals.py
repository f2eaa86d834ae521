"""The simulator's scrape: counters of one controller interval, and the rates of the last few.

The simulator counts what the runtime's exporter counts (latency and inter-token histogram
buckets, admissions, step times by phase and batch-size bucket, prompt tokens prefilled) and
turns the last intervals into the :class:`~batchpilot_operator.tuning.model_metrics.ModelMetrics`
a Prometheus ``rate()`` over the same window would give, so that the policy's observations come
through the live sources' one builder.

Requests are counted as the runtime's ``batchpilot_requests_total`` counts them: when they end
(the last token, or a rejection on arrival), not when they arrive. The policy's arrival rate and
the denominator of the tail-marked share are that rate, live and simulated alike; counting
arrivals here instead would give the simulated policy a figure no live source has (it leads the
live one by a request's latency after a change, and exceeds it in overload). Of the two ways to
one meaning, counting what the runtime counts rather than renaming the field was chosen: it keeps
the ``bench_slo`` capacities and at-capacity figures identical to the digit, so the bench still
measures the policy the operator runs. Arrivals are still counted (:attr:`Interval.arrivals`) for
the simulator's own timeline and per-interval admissions, which say so in their names.

A first-token or queue-wait latency is bucketed when it happens, as the runtime and the gate observe
them (at the first token, at the first admission), and vLLM its TTFT; an end-to-end latency when the
request ends (tests/unit/test_observation_parity.py checks every field).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from batchpilot_operator.api.profile import LatencyMetric
from batchpilot_operator.tuning.model_metrics import INTER_TOKEN, LATENCY_BUCKETS, HistogramWindow, ModelMetrics
from batchpilot_runtime.contract.metric_names import batch_bucket
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import StepStats

# The exporter's buckets: every SLO latency shares the first-token histogram's, gaps have their own.
LATENCY_BUCKETS_S = LATENCY_BUCKETS["ttft"]
ITL_BUCKETS_S = LATENCY_BUCKETS[INTER_TOKEN]
NUM_BUCKETS = len(LATENCY_BUCKETS_S) + 1
ITL_NUM_BUCKETS = len(ITL_BUCKETS_S) + 1
_CUMULATIVE_BOUNDS = (*LATENCY_BUCKETS_S, math.inf)
_ITL_CUMULATIVE_BOUNDS = (*ITL_BUCKETS_S, math.inf)


@dataclass
class Interval:
    """Counters of one controller interval (the simulator's scrape)."""

    latency_buckets: list[int] = field(default_factory=lambda: [0] * NUM_BUCKETS)
    itl_buckets: list[int] = field(default_factory=lambda: [0] * ITL_NUM_BUCKETS)
    arrivals: int = 0
    ended_requests: int = 0  # finished, or rejected on arrival: batchpilot_requests_total's count
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seqs: int = 0
    admissions: dict[str, int] = field(default_factory=dict)
    tail_marked: int = 0
    preempted: int = 0
    step_s_by_bucket: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [sum_s, count]
    prefill_step_s_by_bucket: dict[int, list[float]] = field(default_factory=dict)  # the same, prefill steps
    prefill_tokens: int = 0

    def add_step(self, stats: StepStats, step_s: float) -> None:
        """Counts one engine step's plan statistics and its duration, by phase as the runtime's
        exporter does (a step that prefills anything is a prefill step)."""
        for reason, count in stats.admissions.items():
            self.admissions[reason] = self.admissions.get(reason, 0) + count
        self.tail_marked += stats.tail_marked
        self.preempted += stats.preempted
        if stats.num_decode_seqs:
            self.decode_steps += 1
            self.decode_seqs += stats.num_decode_seqs
        if stats.num_prefill_seqs:
            self.prefill_tokens += stats.num_prefill_tokens
            _add_step_time(self.prefill_step_s_by_bucket, stats.batch_size, step_s)
        elif stats.num_decode_seqs:
            _add_step_time(self.step_s_by_bucket, stats.batch_size, step_s)


def _add_step_time(by_bucket: dict[int, list[float]], batch_size: int, step_s: float) -> None:
    bucket = int(batch_bucket(batch_size))
    acc = by_bucket.get(bucket)
    if acc is None:
        by_bucket[bucket] = [step_s, 1.0]
    else:
        acc[0] += step_s
        acc[1] += 1.0


def interval_metrics(
    recent: Sequence[Interval],
    interval_s: float,
    latency_metric: LatencyMetric,
    sched: Scheduler,
    itl_window_counts: Sequence[int] = (),
) -> ModelMetrics:
    """The counters of the last intervals as rates per second, as Prometheus' ``rate()`` gives them;
    ``itl_window_counts`` (per gap bucket, over the error budget's window) as counts, as its
    ``increase()`` gives them."""
    window_s = len(recent) * interval_s
    latency = [0] * NUM_BUCKETS
    itl = [0] * ITL_NUM_BUCKETS
    ended = tokens = decode_steps = decode_seqs = marked = preempted = 0
    admissions: dict[str, int] = {}
    step_acc: dict[int, list[float]] = {}
    prefill_acc: dict[int, list[float]] = {}
    prefill_tokens = 0
    for interval in recent:
        for i, c in enumerate(interval.latency_buckets):
            if c:
                latency[i] += c
        for i, c in enumerate(interval.itl_buckets):
            if c:
                itl[i] += c
        ended += interval.ended_requests
        tokens += interval.generated_tokens
        decode_steps += interval.decode_steps
        decode_seqs += interval.decode_seqs
        marked += interval.tail_marked
        preempted += interval.preempted
        for reason, count in interval.admissions.items():
            admissions[reason] = admissions.get(reason, 0) + count
        prefill_tokens += interval.prefill_tokens
        for into, by_bucket in (
            (step_acc, interval.step_s_by_bucket),
            (prefill_acc, interval.prefill_step_s_by_bucket),
        ):
            for bucket, (sum_s, count_f) in by_bucket.items():
                acc = into.setdefault(bucket, [0.0, 0.0])
                acc[0] += sum_s
                acc[1] += count_f

    def histogram(counts: Sequence[int], bounds: tuple[float, ...], per_s: float = window_s) -> HistogramWindow:
        cumulative: list[float] = []
        running = 0
        for count in counts:
            running += count
            cumulative.append(running / per_s)
        return HistogramWindow(bounds, tuple(cumulative))

    return ModelMetrics(
        window_s=window_s,
        latency={
            str(latency_metric): histogram(latency, _CUMULATIVE_BOUNDS),
            INTER_TOKEN: histogram(itl, _ITL_CUMULATIVE_BOUNDS),
        },
        requests_per_s=ended / window_s,
        generated_tokens_per_s=tokens / window_s,
        admissions_per_s={reason: count / window_s for reason, count in admissions.items()},
        tail_marked_per_s=marked / window_s,
        preemptions_per_s=preempted / window_s,
        decode_batch_sum_per_s=decode_seqs / window_s,
        decode_batch_count_per_s=decode_steps / window_s,
        step_seconds_by_bucket={b: (s / window_s, c / window_s) for b, (s, c) in step_acc.items()},
        prefill_step_seconds_by_bucket={b: (s / window_s, c / window_s) for b, (s, c) in prefill_acc.items()},
        prefill_tokens_per_s=prefill_tokens / window_s,
        queue_depth=float(sched.num_waiting),
        running=float(sched.num_running),
        kv_usage_max=sched.kv_usage_ratio,
        itl_window=histogram(itl_window_counts, _ITL_CUMULATIVE_BOUNDS, 1.0) if itl_window_counts else None,
        pods_reporting=1,
    )
