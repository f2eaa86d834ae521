"""The simulator: exact latencies on a hand-computed scenario, determinism, closed-loop recovery."""

from __future__ import annotations

import math

import pytest

from batchpilot_operator.api.profile import LatencyMetric, parse_spec
from batchpilot_operator.sim.controllers import AdaptiveController
from batchpilot_operator.sim.intervals import Interval, interval_metrics
from batchpilot_operator.sim.metrics import exact_quantile, summarize
from batchpilot_operator.sim.simulator import (
    GAP_BIN_S,
    SimConfig,
    Simulator,
    scheduler_config_for,
)
from batchpilot_operator.tuning.model_metrics import INTER_TOKEN, to_observations
from batchpilot_operator.tuning.observations import Observations
from batchpilot_runtime.contract.metric_names import (
    INTER_TOKEN_SECONDS,
    LATENCY_BUCKETS_S,
    RUNTIME_METRICS,
    STEP_BUCKETS_S,
    TTFT_SECONDS,
)
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import A100_LLAMA2_7B, UNIT
from batchpilot_runtime.replay.trace import TraceRequest
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import SchedulerConfig


def make_config(**overrides: object) -> SimConfig:
    values: dict[str, object] = {
        "cost": UNIT,
        "scheduler": SchedulerConfig(num_kv_blocks=256, kv_block_size=16),
        "slo_p99_s": 1.0,
    }
    values.update(overrides)
    return SimConfig(**values)  # type: ignore[arg-type]


def test_hand_computed_scenario_latencies_are_exact() -> None:
    # UNIT: 10 ms per step + 1 ms per prompt token + 1 ms per decoding sequence.
    # t=0      A arrives (10-token prompt, 3 tokens out), admitted at once (wait 0).
    #          step: prefill 10 -> 20 ms; A's first token at 0.020.
    # t=0.005  B arrives (5-token prompt, 1 token out); queued until the step ends.
    # t=0.020  step: A decodes (1) + B prefills (5) -> 16 ms; B's only token at 0.036 (done).
    # t=0.036  step: A decodes -> 11 ms; A's third token at 0.047 (done).
    requests = [TraceRequest(0.0, 10, 3), TraceRequest(0.005, 5, 1)]
    window = Window(target_batch_size=1, hard_cap=4, max_wait_ms=0)
    result = Simulator(requests, window, make_config()).run()
    a, b = result.records
    assert a.admitted_s == 0.0
    assert a.ttft_s == pytest.approx(0.020)
    assert a.e2e_s == pytest.approx(0.047)
    assert b.admitted_s == pytest.approx(0.020)
    assert b.queue_wait_s == pytest.approx(0.015)
    assert b.ttft_s == pytest.approx(0.031)
    assert b.e2e_s == pytest.approx(0.031)
    assert result.steps == 3


def test_every_token_gap_is_recorded_exactly() -> None:
    # The scenario above: A's tokens at 0.020, 0.036, 0.047 give gaps of 16 and 11 ms; B's only
    # token has no gap. Per output token after the first, A took (0.047 - 0.020) / 2.
    requests = [TraceRequest(0.0, 10, 3), TraceRequest(0.005, 5, 1)]
    result = Simulator(requests, Window(target_batch_size=1, hard_cap=4, max_wait_ms=0), make_config()).run()
    assert result.gaps.total == 2
    assert result.gaps.quantile(0.5) == pytest.approx(0.011, abs=GAP_BIN_S)
    assert result.gaps.quantile(1.0) == pytest.approx(0.016, abs=GAP_BIN_S)
    a, b = result.records
    assert a.tpot_s == pytest.approx(0.0135)
    assert b.tpot_s == 0.0


def test_a_preempted_sequence_gap_includes_its_stall() -> None:
    # Two requests whose KV does not fit together: the younger is preempted and recomputed, and
    # its next token comes after a gap longer than any step of an unpreempted run.
    requests = [TraceRequest(0.0, 30, 40), TraceRequest(0.0, 30, 40)]
    config = make_config(scheduler=SchedulerConfig(num_kv_blocks=6, kv_block_size=16, kv_watermark_fraction=0.0))
    result = Simulator(requests, Window(target_batch_size=2, hard_cap=2, max_wait_ms=0), config).run()
    assert all(not math.isnan(r.finished_s) for r in result.records)
    assert result.gaps.total == 2 * 39
    longest_step_s = 0.010 + 0.002 + 0.030 + 0.040  # a generous bound on one unpreempted step
    assert result.gaps.quantile(1.0) > longest_step_s


def test_the_simulator_counts_on_the_exporters_buckets() -> None:
    """Latencies and gaps fall into the buckets the runtime exports them on, so a quantile read in the
    simulator carries the same interpolation error as one read from Prometheus."""
    exported = {spec.name: spec.buckets for spec in RUNTIME_METRICS}
    interval = Interval()
    assert exported[TTFT_SECONDS] == LATENCY_BUCKETS_S and len(interval.latency_buckets) == len(LATENCY_BUCKETS_S) + 1
    assert exported[INTER_TOKEN_SECONDS] == STEP_BUCKETS_S and len(interval.itl_buckets) == len(STEP_BUCKETS_S) + 1
    sched = Scheduler(SchedulerConfig(num_kv_blocks=64), Window(target_batch_size=1, hard_cap=4, max_wait_ms=0))
    metrics = interval_metrics([interval], 10.0, LatencyMetric.TTFT, sched)
    assert metrics.latency[INTER_TOKEN].upper_bounds == (*STEP_BUCKETS_S, math.inf)
    assert metrics.latency["ttft"].upper_bounds == (*LATENCY_BUCKETS_S, math.inf)


def test_the_simulators_counters_become_the_policys_figures() -> None:
    """Hand-made counters of two intervals through the one builder (the parity with the live path on one
    request stream is tests/unit/test_observation_parity.py)."""
    interval = Interval()
    interval.latency_buckets[10] = 30
    interval.latency_buckets[40] = 2
    interval.itl_buckets[5] = 900
    interval.itl_buckets[60] = 12
    interval.arrivals = 50  # not a figure of the policy's: the runtime counts requests when they end
    interval.ended_requests = 32
    interval.admissions = {"target": 5, "cap": 3, "wait": 2}
    interval.tail_marked = 4
    interval.step_s_by_bucket = {8: [2.0, 100.0]}
    interval.prefill_step_s_by_bucket = {8: [3.0, 20.0]}
    interval.prefill_tokens = 20_000
    sched = Scheduler(SchedulerConfig(num_kv_blocks=64), Window(target_batch_size=1, hard_cap=4, max_wait_ms=0))
    obs = to_observations(interval_metrics([interval, Interval()], 10.0, LatencyMetric.TTFT, sched), "ttft", 7.0)
    assert obs.arrival_rate_per_s == pytest.approx(32 / 20.0) and obs.window_s == 20.0
    assert obs.batch_hit_ratio == pytest.approx(0.8)  # (target + cap) / all groups
    assert obs.tail_marked_share == pytest.approx(4 / 32)
    # 20 prefill steps took 3 s where 20 decode steps of their batch take 0.4 s: 2.6 s for 20,000 tokens.
    assert obs.prefill_s_per_token == pytest.approx(2.6 / 20_000)
    # 12 of 912 gaps (1.3 %) lie in bucket 60, so the inter-token P99 does too.
    assert STEP_BUCKETS_S[59] < obs.itl_p99_s <= STEP_BUCKETS_S[60]


def test_target_and_wait_hold_requests_back_exactly() -> None:
    # Target 2 with a 50 ms wait: A (t=0) waits for B (t=0.030), then both prefill together.
    # Step at 0.030: prefill 4 + 4 tokens -> 18 ms; both first tokens at 0.048.
    # C arrives alone at 1.0 and is admitted when its wait expires at 1.05: 10 + 4 = 14 ms -> 1.064.
    requests = [TraceRequest(0.0, 4, 1), TraceRequest(0.030, 4, 1), TraceRequest(1.0, 4, 1)]
    window = Window(target_batch_size=2, hard_cap=4, max_wait_ms=50)
    result = Simulator(requests, window, make_config()).run()
    a, b, c = result.records
    assert a.ttft_s == pytest.approx(0.048)
    assert b.ttft_s == pytest.approx(0.018)
    assert c.admitted_s == pytest.approx(1.05)
    assert c.ttft_s == pytest.approx(0.064)


def _bursty_trace(n: int = 600) -> list[TraceRequest]:
    out = []
    t = 0.0
    for i in range(n):
        t += 0.01 if (i // 50) % 2 else 0.2
        out.append(TraceRequest(t, 20 + (i * 37) % 200, 1 + (i * 13) % 40))
    return out


def test_same_inputs_give_the_same_admissions_and_latencies() -> None:
    requests = _bursty_trace()
    window = Window(target_batch_size=4, hard_cap=8, max_wait_ms=20)
    config = make_config(cost=A100_LLAMA2_7B, scheduler=scheduler_config_for(A100_LLAMA2_7B), interval_s=5.0)
    first = Simulator(requests, window, config).run()
    second = Simulator(requests, window, config).run()
    assert [(r.admitted_s, r.first_token_s, r.finished_s) for r in first.records] == [
        (r.admitted_s, r.first_token_s, r.finished_s) for r in second.records
    ]
    assert first.interval_admissions == second.interval_admissions
    assert first.steps == second.steps
    assert sum(sum(a.values()) for _, a in first.interval_admissions) > 0


def test_queue_overflow_counts_as_a_miss_not_a_crash() -> None:
    requests = [TraceRequest(0.0, 50, 50) for _ in range(10)]
    config = make_config(scheduler=SchedulerConfig(num_kv_blocks=256, kv_block_size=16, max_queue=3))
    result = Simulator(requests, Window(target_batch_size=1, hard_cap=1, max_wait_ms=0), config).run()
    summary = summarize(result, 1.0, LatencyMetric.TTFT)
    assert summary["rejected"] == 7  # all ten arrive before the first step: three fit the queue
    assert math.isinf(summary["p99_s"])


def test_exact_quantile_is_nearest_rank() -> None:
    assert exact_quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert exact_quantile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0


@pytest.mark.slow
def test_p99_back_under_slo_within_three_intervals_after_a_3x_step() -> None:
    """Steady load, then three times the arrival rate: the adaptive window recovers in <= 3 intervals."""
    interval_s = 15.0
    step_at_s = 300.0
    requests = []
    t = 0.0
    i = 0
    while t < 600.0:
        rate = 8.0 if t < step_at_s else 24.0
        t += 1.0 / rate
        requests.append(TraceRequest(t, 200 + (i * 53) % 200, 20 + (i * 7) % 20))
        i += 1
    spec = parse_spec(
        {
            "model": "m",
            "selector": {"matchLabels": {"app": "m"}},
            "batchFriendliness": "high",
            "window": {"targetBatchSize": 2, "hardCap": 4, "maxWaitMs": 10},
            "slo": {"p99Ms": 500},
            "tuning": {"intervalSeconds": 15, "cooldownSeconds": 15},
        }
    )
    config = SimConfig(
        cost=A100_LLAMA2_7B,
        scheduler=scheduler_config_for(A100_LLAMA2_7B),
        slo_p99_s=0.5,
        interval_s=interval_s,
        rate_window_s=interval_s,
    )
    controller = AdaptiveController(spec)
    result = Simulator(requests, Window.from_fields(spec.window, 0), config, controller).run()
    # Exact P99 TTFT of the requests arriving in each interval after the step.
    per_interval: list[float] = []
    for k in range(int((600.0 - step_at_s) / interval_s)):
        lo, hi = step_at_s + k * interval_s, step_at_s + (k + 1) * interval_s
        ttfts = sorted(r.ttft_s for r in result.records if lo <= r.arrival_s < hi)
        per_interval.append(exact_quantile(ttfts, 0.99))
    before = sorted(r.ttft_s for r in result.records if 150.0 <= r.arrival_s < step_at_s)
    assert exact_quantile(before, 0.99) <= 0.5, "the policy should have settled under the SLO before the step"
    assert all(p99 <= 0.5 for p99 in per_interval[3:]), per_interval
    assert result.window_changes > 0


def test_the_error_budgets_hour_of_gaps_slides_with_the_intervals() -> None:
    # Intervals of half an hour: the budget's hour spans the last two. One request an interval, each
    # with 3 tokens (2 gaps), so an hour holds at most 4 gaps, whatever came before it.
    seen: list[Observations] = []

    class Recorder:
        def on_interval(self, now_s: float, observations: Observations, window: Window) -> Window | None:
            seen.append(observations)
            return None

    requests = [TraceRequest(1800.0 * k + 1.0, 10, 3) for k in range(5)]
    config = make_config(interval_s=1800.0, rate_window_s=1800.0)
    Simulator(requests, Window(target_batch_size=1, hard_cap=4, max_wait_ms=0), config, Recorder()).run()
    totals = [obs.itl_window_buckets[-1][1] for obs in seen]
    assert totals[:4] == [2.0, 4.0, 4.0, 4.0]
    # The same buckets as the gaps' histogram (the exporter's), +Inf last.
    assert [bound for bound, _ in seen[0].itl_window_buckets] == [*STEP_BUCKETS_S, math.inf]
