"""The tuning policy's prompt-token budget: the two tails it trades, its ceiling, sparse intervals
and gaps the budget does not explain."""

from __future__ import annotations

import math
from typing import Any

import pytest

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.tuning.budget import gap_room_factor
from batchpilot_operator.tuning.observations import NAN, Observations
from batchpilot_operator.tuning.policy import (
    PolicyState,
    decide,
)
from batchpilot_runtime.contract.window import Window
from tests.support.factories import make_observations, make_policy_spec


def itl_spec(budget: int | None = 2048, itl_ms: float = 100.0, **bounds: Any) -> tuple[BatchProfileSpec, Window]:
    window: dict[str, Any] = {"targetBatchSize": 1, "hardCap": 64, "maxWaitMs": 0}
    if budget is not None:
        window["maxPrefillTokens"] = budget
    spec = make_policy_spec(
        window=window,
        slo={"p99Ms": 1000, "interTokenP99Ms": itl_ms},
        tuning={"intervalSeconds": 15, "cooldownSeconds": 30, "maxStepFraction": 0.5, "bounds": bounds},
    )
    return spec, Window.from_fields(spec.window, generation=3)


def test_inter_token_p99_over_its_target_lowers_the_budget_and_says_so() -> None:
    spec, window = itl_spec()
    decision = decide(spec, window, make_observations(0.2, itl_p99_s=0.150, mean_batch_size=8.0), PolicyState(), 100.0)
    assert decision.direction == "down"
    # First tokens with room: aimed at 85 % of the gap target at once, 2048 x 0.85 / 1.5.
    assert decision.window.max_prefill_tokens == 1161
    assert "inter-token P99 150 ms over its 100 ms target" in decision.reason
    assert "prefill budget to 1161" in decision.reason
    # A small overshoot: 0.85 / 1.05.
    decision = decide(spec, window, make_observations(0.2, itl_p99_s=0.105), PolicyState(), 100.0)
    assert decision.window.max_prefill_tokens == 1658


def test_with_both_tails_tight_the_budget_moves_only_as_far_as_balances_them() -> None:
    spec, window = itl_spec(budget=2048)
    # Gaps 1.2x over, first tokens at 0.9x: sqrt(0.9 / 1.2) = 0.866 is a shallower cut than 0.85 / 1.2.
    decision = decide(spec, window, make_observations(0.9, itl_p99_s=0.120), PolicyState(), 100.0)
    assert decision.window.max_prefill_tokens == math.ceil(2048 * math.sqrt(0.9 / 1.2))
    # First tokens further over than the gaps: a cut would move the pain to the worse tail.
    decision = decide(spec, window, make_observations(1.3, itl_p99_s=0.110), PolicyState(), 100.0)
    assert decision.window.max_prefill_tokens == 2048
    # First tokens over, gaps within but close: raised to balance, never past 98 % of the gap target.
    decision = decide(spec, window, make_observations(1.4, itl_p99_s=0.080), PolicyState(), 100.0)
    assert decision.window.max_prefill_tokens == math.floor(2048 * 0.98 / 0.8)


def test_first_tokens_over_spend_the_gaps_room_at_the_steps_own_cost_per_prompt_token() -> None:
    spec, window = itl_spec(budget=1000)
    # First tokens 2x over, gaps at 80 of 100 ms (balance sqrt(2 / 0.8) = 1.58). A prompt token costs
    # 50 us, so the 18 ms left under 98 ms buy 360 tokens: 1360, where a gap read as proportional
    # to the budget (its decodes' part counted as prompt) allows only 1000 x 0.98 / 0.8 = 1225.
    room = make_observations(2.0, itl_p99_s=0.080, prefill_s_per_token=0.00005)
    assert gap_room_factor(spec, room, room.itl_p99_s, 1000, 1.0, 0.8) == pytest.approx(1.4)
    assert gap_room_factor(spec, room, room.itl_p99_s, 1000, 0.95, 0.8) == pytest.approx(1.3)  # a lower aim, less room
    assert decide(spec, window, room, PolicyState(), 100.0).window.max_prefill_tokens == 1360
    # Without that cost the proportional reading stands.
    unknown = make_observations(2.0, itl_p99_s=0.080)
    assert gap_room_factor(spec, unknown, unknown.itl_p99_s, 1000, 1.0, 0.8) == pytest.approx(1.0 / 0.8)
    # 1000 x 0.98 / 0.8 = 1225 in exact arithmetic; the float product floors to 1224.
    assert decide(spec, window, unknown, PolicyState(), 100.0).window.max_prefill_tokens == pytest.approx(1225, abs=1)
    # Gaps at 98 % of their target: no room, no raise however late the first tokens are.
    full = make_observations(2.0, itl_p99_s=0.098, prefill_s_per_token=0.00005)
    assert gap_room_factor(spec, full, full.itl_p99_s, 1000, 0.98, 0.98) == 1.0
    assert decide(spec, window, full, PolicyState(), 100.0).window.max_prefill_tokens == 1000


def test_an_unset_budget_counts_as_the_top_of_its_bounds_when_it_must_come_down() -> None:
    spec, window = itl_spec(budget=None)
    decision = decide(
        spec, window, make_observations(0.5, itl_p99_s=0.5, itl_p99_saturated=False), PolicyState(), 100.0
    )
    assert decision.window.max_prefill_tokens == 8192  # 16384 (the bound) halved: the overshoot is 5x


def test_first_tokens_under_pressure_raise_the_budget_towards_the_inter_token_setpoint() -> None:
    spec, window = itl_spec(budget=1000)
    # TTFT at 0.8 of its SLO (past the headroom), gaps at 40 % of theirs: room to prefill more per step.
    decision = decide(spec, window, make_observations(0.8, itl_p99_s=0.040), PolicyState(), 100.0)
    assert decision.window.max_prefill_tokens == 1500  # the step limit (x1.5) binds before the setpoint (x2.1)
    assert "raising the prefill budget to 1500" in decision.reason
    # Gaps at 60 %: the setpoint (0.85 / 0.6) binds first.
    decision = decide(spec, window, make_observations(0.8, itl_p99_s=0.060), PolicyState(), 100.0)
    assert decision.window.max_prefill_tokens == 1416
    # First tokens just past half their target ask for it; just under half, the gaps' room alone raises it
    # (issue 31: a budget kept low while first tokens have slack meets the next burst with more steps).
    pressed = decide(spec, window, make_observations(0.55, itl_p99_s=0.040), PolicyState(), 100.0)
    assert "first tokens need it" in pressed.reason
    slack = decide(spec, window, make_observations(0.45, itl_p99_s=0.040), PolicyState(), 100.0)
    assert slack.window.max_prefill_tokens == 1500
    assert "so that the next burst needs fewer steps" in slack.reason
    # Gaps past 70 % of their target: no room to raise into while first tokens have slack.
    assert not decide(spec, window, make_observations(0.45, itl_p99_s=0.075), PolicyState(), 100.0).changed


def test_the_budget_never_rises_past_a_step_that_outlasts_the_first_token_target() -> None:
    spec, window = itl_spec(budget=1000)
    # A prompt token costs 0.5 ms: 2000 tokens fill the 1 s target, so the x1.5 raise stops there.
    pressure = make_observations(1.2, itl_p99_s=0.040, prefill_s_per_token=0.0005)
    decision = decide(spec, window, pressure, PolicyState(), 100.0)
    assert decision.window.max_prefill_tokens == 1500
    raised = decide(spec, decision.window, pressure, decision.state, 200.0)
    assert raised.window.max_prefill_tokens == 2000
    # At the top the estimate wanders a little from interval to interval: no move under 5 %.
    wandered = make_observations(1.2, itl_p99_s=0.040, prefill_s_per_token=0.00049)
    assert decide(spec, raised.window, wandered, raised.state, 300.0).window.max_prefill_tokens == 2000
    # Unknown cost, or an SLO on another latency than the first token: no such top.
    unknown = decide(spec, decision.window, make_observations(1.2, itl_p99_s=0.040), decision.state, 200.0)
    assert unknown.window.max_prefill_tokens == 2250
    e2e = make_policy_spec(
        window=spec.window.model_dump(by_alias=True, exclude_none=True),
        slo={"latencyMetric": "e2e", "p99Ms": 1000, "interTokenP99Ms": 100},
        tuning=spec.tuning.model_dump(by_alias=True),
    )
    assert decide(e2e, decision.window, pressure, decision.state, 200.0).window.max_prefill_tokens == 2250


def test_a_cut_sets_a_ceiling_that_raises_respect_until_the_gaps_have_been_calm() -> None:
    spec, window = itl_spec(budget=2000)
    cut = decide(spec, window, make_observations(0.2, itl_p99_s=0.17), PolicyState(), 100.0)
    assert cut.window.max_prefill_tokens == 1000  # the step limit (x0.5) binds before 0.85 / 1.7
    assert cut.state.budget_ceiling == 1000
    # Later, first tokens under pressure and gaps with room: no raise past the ceiling.
    pressure = make_observations(0.8, itl_p99_s=0.040)
    held = decide(spec, cut.window, pressure, cut.state, 200.0)
    assert held.window.max_prefill_tokens == 1000
    # After 20 calm intervals the ceiling lifts by one step (x1.5) and the raise may follow it.
    state = held.state
    for i in range(19):
        state = decide(spec, cut.window, make_observations(0.3, itl_p99_s=0.040), state, 300.0 + 15 * i).state
    lifted = decide(spec, cut.window, pressure, state, 1000.0)
    assert lifted.state.budget_ceiling == 1500
    assert lifted.window.max_prefill_tokens == 1500


def test_the_budget_holds_when_the_gaps_have_no_room() -> None:
    spec, window = itl_spec(budget=1000)
    assert (
        decide(spec, window, make_observations(0.3, itl_p99_s=0.075), PolicyState(), 100.0).window.max_prefill_tokens
        == 1000
    )
    assert (
        decide(spec, window, make_observations(0.8, itl_p99_s=0.080), PolicyState(), 100.0).window.max_prefill_tokens
        == 1000
    )


def gaps_only_spec(budget: int = 2048, itl_ms: float = 100.0) -> tuple[BatchProfileSpec, Window]:
    spec = make_policy_spec(
        window={"targetBatchSize": 1, "hardCap": 64, "maxWaitMs": 0, "maxPrefillTokens": budget},
        slo={"p99Ms": None, "interTokenP99Ms": itl_ms},
    )
    return spec, Window.from_fields(spec.window, generation=3)


def test_an_slo_of_gaps_alone_cuts_the_budget_with_nothing_holding_it_back() -> None:
    spec, window = gaps_only_spec()
    assert spec.slo.p99_ms is None
    # First tokens at 5 s would stop (balance) a cut with a 1 s first-token target; with none, the gap decides.
    decision = decide(spec, window, make_observations(5.0, itl_p99_s=0.150), PolicyState(), 100.0)
    assert decision.direction == "down"
    assert decision.window.max_prefill_tokens == math.ceil(2048 * 0.85 / 1.5)
    assert decision.reason.startswith("inter-token P99 150 ms over its 100 ms target: lowering the prefill budget")
    # Nothing is over for first tokens: target and wait are not cut for them.
    assert (decision.window.target_batch_size, decision.window.max_wait_ms) == (1, 0)


def test_an_slo_of_gaps_alone_raises_the_budget_only_while_prompts_wait() -> None:
    spec, window = gaps_only_spec(budget=1000)
    waiting = decide(spec, window, make_observations(5.0, itl_p99_s=0.040, queue_depth=6.0), PolicyState(), 100.0)
    assert waiting.window.max_prefill_tokens == 1500
    assert "6 prompts wait" in waiting.reason
    idle = decide(spec, window, make_observations(5.0, itl_p99_s=0.040, queue_depth=0.0), PolicyState(), 100.0)
    assert idle.window.max_prefill_tokens == 1000


def test_an_slo_of_gaps_alone_holds_without_gap_data() -> None:
    spec, window = gaps_only_spec()
    decision = decide(spec, window, make_observations(0.2, itl_p99_s=NAN), PolicyState(), 100.0)
    assert decision.direction == "hold"
    assert decision.reason.startswith("No inter-token data")


def test_with_the_budget_at_its_floor_the_cap_comes_down_for_gaps() -> None:
    spec, window = itl_spec(budget=128, maxPrefillTokens={"min": 128, "max": 4096})
    obs = make_observations(0.5, itl_p99_s=0.3, mean_batch_size=60.0, queue_depth=0.0)
    decision = decide(spec, window, obs, PolicyState(), 100.0)
    assert decision.window.max_prefill_tokens == 128
    assert decision.window.hard_cap == 32
    assert "with the prefill budget at its floor" in decision.reason


# ---- sparse intervals and gaps no budget explains ---------------------------------------------


def sparse(itl_p99_s: float, gaps: float = 600.0, p99_s: float = 0.4, **others: Any) -> Observations:
    """An interval with 3 requests (too few for a first-token P99) that decoded ``gaps`` tokens in 30 s."""
    fields: dict[str, Any] = {
        "samples": 3.0,
        "itl_p99_s": itl_p99_s,
        "tokens_per_s": gaps / 30.0,
        "window_s": 30.0,
        "prefill_s_per_token": 61e-6,
    }
    return make_observations(p99_s, **{**fields, **others})


def test_a_sparse_interval_with_enough_gaps_raises_the_budget_into_the_room_they_leave() -> None:
    spec, window = itl_spec(budget=512)
    # The engine decodes alone between bursts: 14 ms gaps. The whole budget must fit in 85 ms - 14 ms at
    # 61 us a token (1163 tokens), read as if no gap had shared its step with a prompt chunk; the step
    # limit (x1.5) binds first.
    decision = decide(spec, window, sparse(0.014), PolicyState(), 100.0)
    assert decision.direction == "up"
    assert decision.window.max_prefill_tokens == 768
    assert "Too sparse for the first-token P99 (3 requests, < 20), but 600 gaps" in decision.reason
    again = decide(spec, decision.window, sparse(0.014), decision.state, 200.0)
    assert again.window.max_prefill_tokens == 1152
    # 1163 fit: a move under 5 % is not made.
    assert decide(spec, again.window, sparse(0.014), again.state, 300.0).direction == "hold"
    # Only the budget moves: the rest of the window waits for enough requests.
    assert again.window.model_dump(exclude={"max_prefill_tokens"}) == window.model_dump(exclude={"max_prefill_tokens"})


@pytest.mark.parametrize(
    ("observations", "why"),
    [
        (sparse(0.014, gaps=400.0), "too few gaps to read their P99"),
        (sparse(0.075), "gaps past 70 % of their target: no room"),
        (sparse(0.150), "gaps over their target: a cut waits for enough requests"),
        (sparse(0.014, prefill_s_per_token=float("nan")), "a prompt token's cost unknown"),
        (sparse(0.014, itl_p99_saturated=True), "a saturated gap P99 is only a lower bound"),
    ],
)
def test_a_sparse_interval_holds_otherwise(observations: Observations, why: str) -> None:
    spec, window = itl_spec(budget=512)
    decision = decide(spec, window, observations, PolicyState(), 100.0)
    assert decision.direction == "hold", why
    assert decision.reason.startswith("Too sparse"), why


def test_a_sparse_raise_respects_the_cooldown_and_needs_both_objectives() -> None:
    spec, window = itl_spec(budget=512)
    assert decide(spec, window, sparse(0.014), PolicyState(last_change_s=90.0), 100.0).direction == "hold"
    gaps_only, gaps_window = gaps_only_spec(budget=512)
    assert decide(gaps_only, gaps_window, sparse(0.014, p99_s=float("nan")), PolicyState(), 100.0).direction != "up"


def test_gaps_the_budget_explains_cut_it() -> None:
    spec, window = itl_spec(budget=2048, itl_ms=40.0)
    # 88 ms gaps at 2048 tokens of 35 us: 72 ms of prompt, 16 ms of decode; a cut brings them under.
    decision = decide(
        spec, window, make_observations(0.2, itl_p99_s=0.088, prefill_s_per_token=35e-6), PolicyState(), 100.0
    )
    assert decision.direction == "down"
    assert decision.window.max_prefill_tokens is not None and decision.window.max_prefill_tokens < 2048


def test_gaps_no_budget_explains_hold_it_and_say_why() -> None:
    spec, window = itl_spec(budget=355, itl_ms=40.0)
    # 212 ms gaps at 355 tokens of 35 us (12 ms of prompt): even no prompt part leaves 200 ms, over the
    # 34 ms setpoint. A cut would only make first tokens wait (a demo run beside a busy CPU).
    busy = make_observations(0.2, itl_p99_s=0.212, prefill_s_per_token=35e-6, mean_batch_size=6.0)
    decision = decide(spec, window, busy, PolicyState(), 100.0)
    assert decision.direction == "hold"
    assert decision.window.max_prefill_tokens == 355
    assert "more than the prompt part of a step explains (35.0 us a prompt token)" in decision.reason
    # Unknown cost per prompt token: the old reading (the whole gap is the budget's) cuts.
    unknown = make_observations(0.2, itl_p99_s=0.212, mean_batch_size=6.0)
    assert decide(spec, window, unknown, PolicyState(), 100.0).window.max_prefill_tokens < 355


def test_gaps_no_budget_explains_bring_the_cap_down_when_the_batch_fills_it() -> None:
    spec, window = itl_spec(budget=1024, itl_ms=100.0)
    # A full batch of long contexts: 120 ms gaps of which 1024 x 20 us = 20 ms are prompt.
    full = make_observations(0.2, itl_p99_s=0.120, prefill_s_per_token=20e-6, mean_batch_size=60.0)
    decision = decide(spec, window, full, PolicyState(), 100.0)
    assert decision.window.max_prefill_tokens == 1024
    assert decision.window.hard_cap < 64
    assert "beyond what it explains" in decision.reason


def test_gaps_read_across_a_cut_are_the_larger_budgets_so_the_cut_goes_on() -> None:
    spec, window = itl_spec(budget=256, itl_ms=60.0)
    # 357 ms gaps at 256 tokens of 0.3 ms: 280 ms are left without the prompt part, over the 51 ms setpoint.
    # Read 35 s after a cut in a 60 s rate window, they are partly the steps of the budget before it.
    obs = make_observations(0.3, itl_p99_s=0.357, prefill_s_per_token=0.0003, window_s=60.0, mean_batch_size=6.0)
    fresh = decide(spec, window, obs, PolicyState(last_change_s=65.0), 100.0)
    assert fresh.window.max_prefill_tokens is not None and fresh.window.max_prefill_tokens < 256
    settled = decide(spec, window, obs, PolicyState(last_change_s=30.0), 100.0)
    assert settled.window.max_prefill_tokens == 256
    assert "more than the prompt part of a step explains" in settled.reason
    # A prompt part of half the gap or more explains it (the P99 is read off histogram buckets).
    half = make_observations(0.3, itl_p99_s=0.357, prefill_s_per_token=0.001, window_s=60.0, mean_batch_size=6.0)
    assert decide(spec, window, half, PolicyState(last_change_s=30.0), 100.0).window.max_prefill_tokens < 256


def test_a_cut_that_leaves_a_prompt_chunk_over_the_gap_target_holds_while_first_tokens_need_it() -> None:
    spec, window = itl_spec(budget=8000, itl_ms=200.0)
    # 280 ms gaps at 8000 tokens of 61 us: a full chunk alone is 488 ms. A cut by the balance (first
    # tokens at 0.9 of their target) stops near 6400 tokens, whose chunk is still 390 ms: each long
    # prompt would stall every decode in more steps over the target, and first tokens need the steps.
    tight = make_observations(0.9, itl_p99_s=0.280, prefill_s_per_token=61e-6, mean_batch_size=20.0)
    decision = decide(spec, window, tight, PolicyState(), 100.0)
    assert decision.direction == "hold"
    assert decision.window.max_prefill_tokens == 8000
    assert "a cut would split each long prompt into more steps over it" in decision.reason
    # First tokens with room: the cut is made (nothing asks for the steps it adds).
    roomy = make_observations(0.3, itl_p99_s=0.280, prefill_s_per_token=61e-6, mean_batch_size=20.0)
    cut = decide(spec, window, roomy, PolicyState(), 100.0).window.max_prefill_tokens
    assert cut is not None and cut < 8000
    # A cut that brings the chunk under the gap target is made however tight first tokens are.
    small = make_observations(0.9, itl_p99_s=0.280, prefill_s_per_token=20e-6, mean_batch_size=20.0)
    cut = decide(spec, window, small, PolicyState(), 100.0).window.max_prefill_tokens
    assert cut is not None and cut * 20e-6 < 0.200
    # Unknown cost per prompt token: the old reading cuts.
    unknown = make_observations(0.9, itl_p99_s=0.280, mean_batch_size=20.0)
    cut = decide(spec, window, unknown, PolicyState(), 100.0).window.max_prefill_tokens
    assert cut is not None and cut < 8000


def test_a_raise_for_room_alone_stops_where_a_full_prompt_chunk_reaches_the_gap_setpoint() -> None:
    spec, window = itl_spec(budget=1024, itl_ms=100.0)
    # Quiet gaps of 30 ms, first tokens with slack: the room reads as 1.5x, but a full chunk of 61 us
    # tokens reaches 85 ms (the setpoint) at 1393 tokens.
    quiet = make_observations(0.2, itl_p99_s=0.030, prefill_s_per_token=61e-6, mean_batch_size=4.0)
    decision = decide(spec, window, quiet, PolicyState(), 100.0)
    assert decision.direction == "up"
    assert decision.window.max_prefill_tokens == 1393
    # Already past that budget: nothing to raise (and room is no reason to cut).
    spec, window = itl_spec(budget=2048, itl_ms=100.0)
    assert decide(spec, window, quiet, PolicyState(), 100.0).window.max_prefill_tokens == 2048
    # First tokens that wait ask for more than the room's budget: the raise goes past it.
    waiting = make_observations(0.7, itl_p99_s=0.030, prefill_s_per_token=61e-6, mean_batch_size=4.0)
    raised = decide(spec, window, waiting, PolicyState(), 100.0).window.max_prefill_tokens
    assert raised is not None and raised > 2048
