"""The pure half of ``tests/bench/bench_live.py``: its arguments, the SLO rule, judging a probe, the probes'
arrivals and the searches (on stand-in probes with known capacities)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot_operator.sim.slo import DualSLO
from batchpilot_runtime.replay.cost_model import UNIT, StepComposition
from batchpilot_runtime.replay.trace import TraceRequest
from tests.bench.bench_live import parse_args
from tests.bench.live_probe import (
    Grid,
    LightRun,
    ProbeTally,
    allowed_misses,
    best_window_search,
    gallop_capacity,
    judge_probe,
    probe_arrivals,
    search,
    slo_for,
)
from tests.bench.live_report import error_summary, relative_error, sim_error, step_costs

SLO = DualSLO(1.0, 0.05)
TRACE = [TraceRequest(i * 0.5, 10 + i % 7, 5 + i % 3) for i in range(400)]


def test_arguments_default_to_both_engines_and_traces_and_name_a_bad_choice() -> None:
    args = parse_args([])
    assert (args.engines, args.traces, args.preset) == (["llamacpp", "batchpilot"], ["azure", "servegen"], "full")
    assert parse_args(["--quick"]).preset == "quick"
    tiny = parse_args(["--tiny", "--traces", "azure"])
    assert (tiny.engines, tiny.traces, tiny.preset) == (["batchpilot"], ["azure"], "tiny")
    with pytest.raises(SystemExit, match="--engines: expected some of llamacpp, batchpilot, got 'vllm'"):
        parse_args(["--engines", "vllm"])
    with pytest.raises(SystemExit, match="--policies"):
        parse_args(["--policies", "adaptive,oracle"])
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--tiny"])
    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--engines", "llamacpp"])


def test_the_slo_is_a_multiple_of_the_engines_own_latencies_alone_and_says_so() -> None:
    slo, reason = slo_for(LightRun(ttft_p50_s=0.05, itl_p50_s=0.012))
    assert (slo.ttft_p99_s, slo.itl_p99_s) == (0.4, 0.048)
    assert "first token P99 400 ms = 8 x" in reason and "(50.0 ms)" in reason
    assert "inter-token P99 48.0 ms = 4 x a decode step served alone (12.0 ms)" in reason
    with pytest.raises(ValueError, match="must be > 0"):
        slo_for(LightRun(0.0, 0.01))


def test_without_a_live_prompt_budget_a_gap_may_hold_a_whole_prompts_prefill() -> None:
    slo, reason = slo_for(LightRun(ttft_p50_s=1.25, itl_p50_s=0.02), live_budget=False)
    assert (slo.ttft_p99_s, slo.itl_p99_s) == (10.0, 2.5)
    assert "inter-token P99 2500.0 ms = 2 x that first token: no live prompt budget" in reason
    assert "would be 80.0 ms" in reason
    fast_prefill, _ = slo_for(LightRun(ttft_p50_s=0.01, itl_p50_s=0.02), live_budget=False)
    assert fast_prefill.itl_p99_s == 0.08  # the decode bound, when it is the larger


def test_a_probe_meets_only_when_every_request_completed_within_both_p99s() -> None:
    tally = ProbeTally(SLO, planned=3, planned_gaps=6)
    for ttft in (0.2, 0.3, 0.9):
        tally.add("completed", ttft, [0.01, 0.02])
    result = judge_probe(tally, 0.5, stopped_early=False, wall_s=1.0)
    assert result.meets and result.ttft_p99_s == 0.9 and result.itl_p99_s == 0.02 and result.ttft_p50_s == 0.3
    short = ProbeTally(SLO, planned=4, planned_gaps=8)
    for ttft in (0.2, 0.3, 0.9):
        short.add("completed", ttft, [0.01])
    unfinished = judge_probe(short, 0.5, stopped_early=False, wall_s=1.0)
    assert not unfinished.meets and unfinished.ttft_p99_s == math.inf
    assert unfinished.to_json()["ttft_p99_s"] is None  # JSON has no infinity


def test_a_probe_is_lost_at_one_miss_more_than_p99_allows_and_a_refusal_is_a_miss() -> None:
    assert [allowed_misses(n) for n in (0, 99, 100, 101, 250)] == [0, 0, 1, 1, 2]
    tally = ProbeTally(SLO, planned=200, planned_gaps=10_000)
    tally.add("completed", 1.5, [])
    tally.add("rejected_429", None, [])
    assert tally.ttft_misses == 2 and not tally.lost
    tally.add("completed", 2.0, [])
    assert tally.lost and tally.failed == {"rejected_429": 1}
    gaps = ProbeTally(SLO, planned=10, planned_gaps=200)
    gaps.add("completed", 0.1, [0.06, 0.07])
    assert not gaps.lost
    gaps.add("completed", 0.1, [0.08])
    assert gaps.lost


@given(st.floats(0.05, 1.0), st.floats(0.05, 1.0), st.integers(0, 5))
def test_a_heavier_probe_sends_a_superset_of_a_lighter_ones_requests_in_the_same_time(
    a: float, b: float, seed: int
) -> None:
    light, heavy = sorted((a, b))
    lighter = probe_arrivals(TRACE, base_rate_per_s=2.0, multiplier=light, duration_s=100.0, seed=seed)
    heavier = probe_arrivals(TRACE, base_rate_per_s=2.0, multiplier=heavy, duration_s=100.0, seed=seed)
    assert set(lighter) <= set(heavier)
    assert all(0.0 <= r.arrival_s <= 100.0 for r in heavier)
    assert [r.arrival_s for r in heavier] == sorted(r.arrival_s for r in heavier)


def test_a_probe_keeps_its_share_of_the_trace_and_refuses_a_load_the_trace_cannot_give() -> None:
    arrivals = probe_arrivals(TRACE, base_rate_per_s=1.0, multiplier=1.0, duration_s=200.0)
    assert abs(len(arrivals) - 200) < 40  # a binomial draw of 400 at one half
    assert arrivals[-1].arrival_s > 180.0  # spread over the whole probe, not its start
    with pytest.raises(ValueError, match="needs 800 requests; the trace has 400"):
        probe_arrivals(TRACE, base_rate_per_s=2.0, multiplier=2.0, duration_s=200.0)


class StandIn:
    """Probes of windows whose true capacities are known: meets at or below them."""

    def __init__(self, capacities: dict[str, float]) -> None:
        self.capacities = capacities
        self.probes: list[tuple[str, float]] = []

    def __call__(self, window: str, multiplier: float) -> bool:
        self.probes.append((window, multiplier))
        return multiplier <= self.capacities[window] + 1e-9


def test_one_search_finds_the_capacity_on_the_grid() -> None:
    stand_in = StandIn({"w": 0.7})
    assert search(lambda m: stand_in("w", m), Grid(0.1, 2.0, 0.1)) == 0.7
    assert search(lambda m: stand_in("w", m), Grid(0.8, 2.0, 0.1)) == 0.0


@given(
    capacity=st.integers(0, 25).map(lambda i: round(i * 0.1, 6)),
    guess=st.floats(0.0, 3.0),
    lo=st.integers(1, 10).map(lambda i: round(i * 0.1, 6)),
)
def test_galloping_from_any_guess_finds_what_bisecting_the_grid_finds(capacity: float, guess: float, lo: float) -> None:
    grid = Grid(lo, 2.0, 0.1)
    bisected = search(lambda m: m <= capacity + 1e-9, grid)
    probes: list[float] = []

    def meets(m: float) -> bool:
        probes.append(m)
        return m <= capacity + 1e-9

    assert gallop_capacity(meets, grid, guess) == bisected
    assert len(probes) == len(set(probes))  # no load probed twice
    assert all(lo - 1e-9 <= m <= 2.0 + 1e-9 for m in probes)


def test_a_guess_at_the_capacity_costs_two_probes() -> None:
    stand_in = StandIn({"w": 0.7})
    assert search(lambda m: stand_in("w", m), Grid(0.1, 2.0, 0.1), guess=0.7) == 0.7
    assert stand_in.probes == [("w", 0.7), ("w", 0.8)]
    stand_in = StandIn({"w": 0.0})
    assert search(lambda m: stand_in("w", m), Grid(0.1, 2.0, 0.1), guess=0.1) == 0.0
    assert stand_in.probes == [("w", 0.1)]


def test_the_best_window_costs_one_probe_per_window_that_cannot_beat_the_best_so_far() -> None:
    stand_in = StandIn({"a": 0.5, "b": 0.3, "c": 1.2, "d": 0.6})
    best, window, each = best_window_search(stand_in, ["a", "b", "c", "d"], Grid(0.1, 2.0, 0.1))
    assert (best, window) == (1.2, "c")
    assert each == {"a": 0.5, "b": None, "c": 1.2, "d": None}
    assert [p for p in stand_in.probes if p[0] in ("b", "d")] == [("b", 0.6), ("d", 1.3)]
    assert len(stand_in.probes) == len(set(stand_in.probes))  # no load probed twice


def test_logged_steps_are_set_against_the_cost_model_on_the_same_compositions() -> None:
    # UNIT: 10 ms a step + 1 ms a prompt token + 1 ms a decoding sequence.
    steps = [
        (StepComposition(0, 10, 500), 0.02),
        (StepComposition(0, 10, 900), 0.03),
        (StepComposition(30, 0, 30), 0.06),
    ]
    figures = step_costs(steps, UNIT)
    assert figures == {"count": 3, "live_s": 0.11, "ratio": round(0.11 / 0.08, 4), "prefill_ratio": 1.5,
                       "decode_ratio": 1.25}  # fmt: skip
    summary = error_summary([{"steps": figures}, {"steps": step_costs(steps[:1], UNIT)}])
    assert summary["step_cost_ratio"] == {"min": 1.0, "max": round(0.11 / 0.08, 4)}


def test_the_simulators_error_is_relative_to_the_live_figure_and_skips_stopped_probes() -> None:
    assert relative_error(0.12, 0.1) == 0.2 and relative_error(None, 0.1) is None
    assert relative_error(math.inf, 0.1) is None and relative_error(0.1, 0.0) is None
    tally = ProbeTally(SLO, planned=1, planned_gaps=2)
    tally.add("completed", 0.5, [0.02, 0.04])
    live = judge_probe(tally, 1.0, stopped_early=False, wall_s=1.0)
    simulated = {"ttft_p50_s": 0.4, "ttft_p99_s": 0.4, "itl_p50_s": 0.02, "itl_p99_s": 0.05, "meets": True}
    error = sim_error(live, simulated)
    assert error == {"compared": True, "meets_agree": True, "ttft_p50_s": -0.2, "ttft_p99_s": -0.2,
                     "itl_p50_s": 0.0, "itl_p99_s": 0.25}  # fmt: skip
    stopped = judge_probe(tally, 1.0, stopped_early=True, wall_s=1.0)
    assert sim_error(stopped, simulated) == {"compared": False, "meets_agree": False}
    summary = error_summary([{"error": error}, {"error": sim_error(stopped, simulated)}])
    assert summary["compared_probes"] == 1 and summary["itl_p99_s"] == {"max_abs": 0.25, "over_limit": 1}
    assert (summary["verdicts_agree"], summary["probes"]) == (1, 2)


@pytest.mark.parametrize("engine", ["batchpilot", "llamacpp"])
def test_the_adaptive_profile_is_one_the_operator_accepts_for_each_engine(engine: str) -> None:
    from batchpilot_operator.api.profile import parse_spec
    from batchpilot_runtime.contract.window import Window
    from tests.bench.live_servers import EngineSetup, Served, profile

    start = Window(
        target_batch_size=1, hard_cap=4, max_wait_ms=0, max_prefill_tokens=205 if engine == "batchpilot" else None
    )
    spec = parse_spec(
        profile(EngineSetup(engine), Served("adaptive", start, adaptive=True), (3000.0, 200.0), 5)["spec"]
    )
    assert spec.slo.p99_ms == 3000.0
    # Through the gate only the first-token target can be tuned for (the budget is llama-server's start-up flag).
    assert spec.slo.inter_token_p99_ms == (200.0 if engine == "batchpilot" else None)
    assert (spec.tuning.interval_seconds, spec.tuning.cooldown_seconds) == (5, 10)
