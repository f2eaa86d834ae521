"""Dual-SLO judging of a replay and the capacity bisection."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot_operator.sim.slo import DualSLO, bisect_capacity, dual_slo_spec, evaluate, scale_arrivals, scaled_cost
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import UNIT
from batchpilot_runtime.replay.trace import TraceRequest

WHOLE_PROMPTS = Window(target_batch_size=1, hard_cap=8, max_wait_ms=0)


@given(st.floats(0.02, 1.5), st.sampled_from([0.01, 0.02, 0.05]))
def test_bisection_finds_the_edge_of_a_monotone_answer(edge: float, tolerance: float) -> None:
    calls: list[float] = []

    def meets(m: float) -> bool:
        calls.append(m)
        return m <= edge

    found = bisect_capacity(meets, tolerance=tolerance)
    assert found <= edge + 1e-9
    assert edge - found <= 2 * tolerance
    assert len(calls) <= 2 + math.ceil(math.log2(1.48 / tolerance))
    # Every load tried is on the grid, and the answer is one that was tried and met.
    assert all(abs(m / tolerance - round(m / tolerance)) < 1e-6 for m in calls)
    assert found == 0.0 or found in calls
    # The lightest load (the slowest to simulate) is run only when nothing above it met.
    lightest = round(math.ceil(0.02 / tolerance - 1e-9) * tolerance, 6)
    assert (lightest in calls) == (found <= lightest)


def test_bisection_says_zero_when_even_the_lightest_load_fails_and_the_top_when_all_pass() -> None:
    assert bisect_capacity(lambda m: False) == 0.0
    assert bisect_capacity(lambda m: True, hi=1.5) == 1.5


def test_both_targets_must_be_positive() -> None:
    with pytest.raises(ValueError, match="both SLO targets"):
        DualSLO(1.0, 0.0)


def test_arrivals_scale_and_tokens_do_not() -> None:
    scaled = scale_arrivals([TraceRequest(2.0, 10, 3)], 0.5)
    assert scaled == [TraceRequest(4.0, 10, 3)]
    with pytest.raises(ValueError, match="multiplier"):
        scale_arrivals([], 0.0)


def test_a_long_prompt_among_decodes_breaks_the_inter_token_target_and_a_budget_keeps_it() -> None:
    # UNIT: 10 ms a step + 1 ms a prompt token + 1 ms a decoding sequence. A decodes while B's
    # 200-token prompt arrives: whole, that step lasts 211 ms; in chunks of 20 tokens, 31 ms.
    requests = [TraceRequest(0.0, 10, 40), TraceRequest(0.05, 200, 2)]
    slo = DualSLO(ttft_p99_s=1.0, itl_p99_s=0.05)
    whole, _ = evaluate(requests, 1.0, slo, UNIT, WHOLE_PROMPTS, stop_early=False)
    assert whole.itl_p99_s == pytest.approx(0.211, abs=2e-4)
    assert not whole.meets
    chunked, _ = evaluate(requests, 1.0, slo, UNIT, WHOLE_PROMPTS.model_copy(update={"max_prefill_tokens": 20}))
    assert chunked.itl_p99_s <= 0.05
    assert chunked.meets
    assert chunked.slo_attainment == 1.0


def test_a_replay_that_cannot_meet_the_gap_target_stops_early() -> None:
    requests = [TraceRequest(0.0, 10, 400)] + [TraceRequest(0.05 + i, 500, 2) for i in range(20)]
    slo = DualSLO(ttft_p99_s=10.0, itl_p99_s=0.05)
    outcome, result = evaluate(requests, 1.0, slo, UNIT, WHOLE_PROMPTS)
    assert outcome.aborted and not outcome.meets
    assert result.sim_end_s < 20.0


def test_the_adaptive_policy_brings_the_gap_under_its_target() -> None:
    # Steady arrivals of long prompts among decodes: whole prompts break a 60 ms gap target,
    # the policy's budget brings it back (from the top of its bounds, halving at most once per
    # 30 s cooldown: 4096 -> 33 takes seven decisions).
    requests = [TraceRequest(i * 0.5, 300, 60) for i in range(600)]
    slo = DualSLO(ttft_p99_s=2.0, itl_p99_s=0.06)
    static, _ = evaluate(requests, 1.0, slo, UNIT, WHOLE_PROMPTS, stop_early=False)
    assert static.itl_p99_s > 0.3
    spec = dual_slo_spec(slo, WHOLE_PROMPTS, budget_bounds=(16, 4096))
    adaptive, result = evaluate(requests, 1.0, slo, UNIT, WHOLE_PROMPTS, spec, stop_early=False)
    assert adaptive.decisions >= 1
    assert adaptive.final_window.max_prefill_tokens is not None
    late = [p.itl_p99_s for p in result.timeline if p.t_s > 250.0]
    assert late and max(late) <= 0.06


def test_a_heavier_model_scales_every_coefficient() -> None:
    heavier = scaled_cost(UNIT, 1.5)
    assert (heavier.fixed_s, heavier.per_prefill_token_s, heavier.per_decode_seq_s) == pytest.approx(
        (UNIT.fixed_s * 1.5, UNIT.per_prefill_token_s * 1.5, UNIT.per_decode_seq_s * 1.5)
    )
