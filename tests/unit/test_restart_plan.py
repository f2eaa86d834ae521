"""The restart path's pure decisions (control/restart_plan.py): budget, worth, stability, and the args rewrite."""

from __future__ import annotations

import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot_operator.control.restart_plan import (
    DAY_S,
    VLLM_FLAGS,
    Budget,
    Rejected,
    Verdict,
    Watch,
    decide,
    in_hours,
    judge,
    next_allowed,
    read_flags,
    rewrite_args,
    rolled_out,
    worth,
)

MIDNIGHT = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC).timestamp()
HOUR = 3600.0
CAP, TOKENS = VLLM_FLAGS


def at(hours: float) -> float:
    return MIDNIGHT + hours * HOUR


BUDGET = Budget(max_per_day=2, min_interval_s=HOUR, hours=None, min_change=0.25, stable_intervals=3)


def verdict(
    budget: Budget = BUDGET,
    history: tuple[float, ...] = (),
    *,
    wanted: dict[str, int] | None = None,
    streak: int = 2,
    trend: tuple[tuple[str, int], ...] = ((CAP, 1),),
    slo_over: bool = False,
    rejected: Rejected | None = None,
) -> Verdict:
    """The verdict at noon on a workload running --max-num-seqs 128, by default for 192 held two intervals."""
    wanted = {CAP: 192} if wanted is None else wanted
    return decide(
        budget, list(history), at(12), {CAP: 128}, wanted,
        streak=streak, trend=trend, slo_over=slo_over, rejected=rejected,
    )  # fmt: skip


# ---- budget ---------------------------------------------------------------------------------------------


def test_a_first_restart_is_allowed_at_once() -> None:
    assert next_allowed(BUDGET, [], at(12)) == at(12)


def test_min_interval_runs_from_the_last_restart() -> None:
    assert next_allowed(BUDGET, [at(11.5)], at(12)) == at(12.5)


def test_max_per_day_waits_until_the_oldest_counted_restart_is_a_day_old() -> None:
    assert next_allowed(BUDGET, [at(2), at(9)], at(12)) == at(2) + DAY_S
    # Restarts older than a day do not count.
    assert next_allowed(BUDGET, [at(-30), at(-25), at(9)], at(12)) == at(12)


@pytest.mark.parametrize(
    ("hours", "now", "expected"),
    [
        ((60, 300), at(12), at(25)),  # 01:00-05:00, asked at noon: tomorrow 01:00
        ((60, 300), at(0.5), at(1)),  # at 00:30: today 01:00
        ((60, 300), at(3), at(3)),  # inside
        ((22 * 60, 2 * 60), at(23), at(23)),  # across midnight, inside before it
        ((22 * 60, 2 * 60), at(1.5), at(1.5)),  # and after it
        ((22 * 60, 2 * 60), at(2), at(22)),  # the end minute is excluded
    ],
)
def test_allowed_hours(hours: tuple[int, int], now: float, expected: float) -> None:
    budget = Budget(max_per_day=2, min_interval_s=HOUR, hours=hours)
    assert next_allowed(budget, [], now) == expected


# ---- worth and stability --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("running", "wanted", "moves"),
    [
        ({CAP: 128}, {CAP: 160}, {CAP: 1}),  # +25 %: exactly the threshold
        ({CAP: 128}, {CAP: 150}, {}),  # +17 %
        ({CAP: 128}, {CAP: 96}, {CAP: -1}),  # -25 %
        ({CAP: 128, TOKENS: 4096}, {CAP: 130, TOKENS: 2048}, {TOKENS: -1}),
        ({CAP: 128}, {CAP: 128, TOKENS: 2048}, {TOKENS: 1}),  # a flag the args lack: the engine's default
        ({CAP: 128}, {}, {}),  # no recommendation
    ],
)
def test_worth(running: dict[str, int], wanted: dict[str, int], moves: dict[str, int]) -> None:
    assert worth(running, wanted, 0.25) == moves


def test_a_small_change_never_restarts_even_with_the_slo_broken() -> None:
    result = verdict(wanted={CAP: 140}, slo_over=True)
    assert not result.restart and result.streak == 0 and "within minChange" in result.reason


def test_a_change_restarts_once_held_for_stable_intervals() -> None:
    first = verdict(streak=0, trend=())
    assert not first.restart and first.streak == 1 and "held 1 of 3" in first.reason
    second = verdict(streak=first.streak, trend=first.trend)
    assert not second.restart and second.streak == 2
    third = verdict(streak=second.streak, trend=second.trend)
    assert third.restart and "--max-num-seqs 128 -> 192" in third.reason and third.streak == 0


def test_a_flip_of_direction_starts_the_streak_over() -> None:
    result = verdict(wanted={CAP: 64}, streak=2, trend=((CAP, 1),))
    assert not result.restart and result.streak == 1 and result.trend == ((CAP, -1),)


def test_a_broken_slo_restarts_after_one_interval() -> None:
    result = verdict(streak=0, trend=(), slo_over=True)
    assert result.restart and "SLO is broken" in result.reason


def test_the_budget_holds_a_change_worth_it() -> None:
    result = verdict(history=(at(11.5),))
    assert not result.restart and result.next_allowed_s == at(12.5) and "budget" in result.reason
    assert result.streak == 3  # still held: it restarts as soon as the budget allows
    outside = verdict(budget=Budget(2, HOUR, (60, 300)))
    assert not outside.restart and outside.next_allowed_s == at(25)


# ---- after a restart ------------------------------------------------------------------------------------

WATCH = Watch({CAP: 128}, {CAP: 192}, slo_met_before=True, intervals_left=2, trend=((CAP, 1),))


@pytest.mark.parametrize(
    ("watch", "slo_over", "outcome", "left"),
    [
        (WATCH, True, "rollback", None),  # met before, broken after
        (WATCH, False, "watch", 1),
        (WATCH, None, "watch", 1),  # no data is no verdict against it
        (Watch({CAP: 128}, {CAP: 192}, False, 2), True, "watch", 1),  # broken before too: not the restart's doing
        (Watch({CAP: 128}, {CAP: 192}, True, 1), False, "keep", None),
    ],
)
def test_judge(watch: Watch, slo_over: bool | None, outcome: str, left: int | None) -> None:
    result, after = judge(watch, slo_over)
    assert result == outcome
    assert (after.intervals_left if after is not None else None) == left


def test_a_rolled_back_change_is_not_tried_again_for_a_day() -> None:
    rejected = Rejected({CAP: 128}, ((CAP, 1),), until_s=at(36))
    held = verdict(rejected=rejected)
    assert not held.restart and "rolled back" in held.reason and held.next_allowed_s == at(36)
    assert verdict(rejected=Rejected({CAP: 128}, ((CAP, 1),), until_s=at(11))).restart  # a day has passed
    assert verdict(rejected=rejected, wanted={CAP: 64}, trend=((CAP, -1),)).restart  # the other way is allowed
    assert verdict(rejected=Rejected({CAP: 96}, ((CAP, 1),), until_s=at(36))).restart  # from other args


@pytest.mark.parametrize(
    ("status", "generation", "done"),
    [
        ({"observedGeneration": 3, "updatedReplicas": 2, "availableReplicas": 2}, 3, True),
        ({"observedGeneration": 2, "updatedReplicas": 2, "availableReplicas": 2}, 3, False),  # not seen yet
        ({"observedGeneration": 3, "updatedReplicas": 1, "availableReplicas": 2}, 3, False),  # half rolled
        ({"observedGeneration": 3, "updatedReplicas": 2, "readyReplicas": 2}, 3, True),  # a StatefulSet's
        ({}, 3, False),
    ],
)
def test_rolled_out(status: dict[str, int], generation: int, done: bool) -> None:
    workload = {"metadata": {"generation": generation}, "spec": {"replicas": 2}, "status": status}
    assert rolled_out(workload) is done


# ---- the budget holds whatever the policy recommends ----------------------------------------------------

steps = st.lists(
    st.tuples(
        st.floats(min_value=1.0, max_value=4 * HOUR),  # time to the next evaluation
        st.sampled_from([64, 96, 128, 192, 256]),  # the recommended cap
        st.booleans(),  # SLO over
    ),
    min_size=1,
    max_size=300,
)
budgets = st.builds(
    Budget,
    max_per_day=st.integers(1, 24),
    min_interval_s=st.floats(min_value=300, max_value=DAY_S),
    hours=st.none() | st.tuples(st.integers(0, 1439), st.integers(0, 1439)).filter(lambda h: h[0] != h[1]),
    min_change=st.sampled_from([0.05, 0.25, 1.0]),
    stable_intervals=st.integers(1, 5),
)


@settings(max_examples=300, deadline=None)
@given(budget=budgets, plan=steps, start=st.floats(min_value=0, max_value=DAY_S))
def test_never_more_restarts_than_the_budget(budget: Budget, plan: list[tuple[float, int, bool]], start: float) -> None:
    now, running, history = MIDNIGHT + start, {CAP: 128}, list[float]()
    streak, trend = 0, tuple[tuple[str, int], ...]()
    for gap, cap, over in plan:
        now += gap
        result = decide(budget, history, now, running, {CAP: cap}, streak=streak, trend=trend, slo_over=over)
        streak, trend = result.streak, result.trend
        if result.restart:
            history.append(now)
            running = {CAP: cap}
    for index, moment in enumerate(history):
        assert in_hours(budget.hours, moment)
        if index:
            assert moment >= history[index - 1] + budget.min_interval_s  # as decided: not past the earliest time
        assert sum(1 for t in history if moment - DAY_S < t <= moment) <= budget.max_per_day


# ---- container args -------------------------------------------------------------------------------------


def test_rewrite_replaces_both_forms_in_place_and_leaves_the_rest() -> None:
    args = ["--model", "m", "--max-num-seqs", "128", "--port=8000", "--max-num-batched-tokens=4096", "--enforce-eager"]
    assert rewrite_args(args, {CAP: 192, TOKENS: 2048}) == [
        "--model", "m", "--max-num-seqs", "192", "--port=8000", "--max-num-batched-tokens=2048", "--enforce-eager",
    ]  # fmt: skip


def test_rewrite_appends_absent_flags_and_drops_repeats() -> None:
    assert rewrite_args(["--model", "m"], {CAP: 64, TOKENS: 1024}) == [
        "--model", "m", "--max-num-seqs", "64", "--max-num-batched-tokens", "1024",
    ]  # fmt: skip
    assert rewrite_args(["--max-num-seqs=8", "--x", "--max-num-seqs", "9"], {CAP: 64}) == ["--max-num-seqs=64", "--x"]


def test_rewrite_takes_the_underscore_spelling_as_the_same_flag() -> None:
    assert rewrite_args(["--max_num_seqs", "8"], {CAP: 64}) == ["--max_num_seqs", "64"]
    assert read_flags(["--max_num_seqs=8"], VLLM_FLAGS) == {CAP: 8}


def test_read_flags_last_wins_and_bad_values_are_named() -> None:
    assert read_flags(["--max-num-seqs", "8", "--max-num-seqs=16", "--other", "1"], VLLM_FLAGS) == {CAP: 16}
    with pytest.raises(ValueError, match="--max-num-seqs 'many'"):
        read_flags(["--max-num-seqs", "many"], VLLM_FLAGS)
    with pytest.raises(ValueError, match="--max-num-batched-tokens has no value"):
        read_flags(["--max-num-batched-tokens"], VLLM_FLAGS)


@given(
    other=st.lists(st.sampled_from(["--model", "m", "--port=1", "-tp", "2", "--enforce-eager"]), max_size=8),
    cap=st.integers(1, 4096),
    form=st.sampled_from(["split", "joined", "absent"]),
)
def test_rewrite_then_read_gives_the_settings(other: list[str], cap: int, form: str) -> None:
    flag = {"split": [CAP, "7"], "joined": [f"{CAP}=7"], "absent": []}[form]
    args = other + flag
    rewritten = rewrite_args(args, {CAP: cap})
    assert read_flags(rewritten, VLLM_FLAGS) == {CAP: cap}
    assert [a for a in rewritten if not a.startswith(CAP) and a != str(cap)] == [a for a in other if a != str(cap)]
