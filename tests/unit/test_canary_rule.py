"""The canary rule (tuning/canary.py): which pods, the verdict of one interval, and how a run ends."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot_operator.api.profile import SLO
from batchpilot_operator.tuning.canary import (
    MARGIN,
    MIN_SAMPLES,
    CanaryRun,
    Verdict,
    advance,
    canary_count,
    choose_pods,
    judge,
)
from batchpilot_operator.tuning.observations import NAN, Observations
from tests.support.factories import make_observations, make_window

SLO_MS = 500.0
BOTH = SLO(p99_ms=SLO_MS, inter_token_p99_ms=50.0)


def pod(p99_ms: float, *, itl_ms: float = 20.0, samples: float = 500.0, saturated: bool = False) -> Observations:
    """One pod's interval: its first-token P99 and inter-token P99 in ms (NaN: no figure)."""
    return make_observations(
        p99_ms / 1000 if math.isfinite(p99_ms) else NAN,
        itl_p99_s=itl_ms / 1000 if math.isfinite(itl_ms) else NAN,
        samples=samples,
        p99_saturated=saturated,
    )


# ---- which pods -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ready", "share", "expected"),
    [(0, 0.5, 0), (1, 0.1, 1), (1, 0.5, 1), (2, 0.5, 1), (2, 0.1, 1), (3, 0.5, 1), (4, 0.5, 2), (4, 0.25, 1),
     (10, 0.1, 1), (10, 0.25, 2), (10, 0.5, 5), (19, 0.1, 1), (20, 0.1, 2)],
)  # fmt: skip
def test_canary_count_is_the_share_rounded_down_at_least_one_never_all(ready: int, share: float, expected: int) -> None:
    assert canary_count(ready, share) == expected


@given(ready=st.integers(0, 500), share=st.floats(0.1, 0.5))
def test_canary_count_invariants(ready: int, share: float) -> None:
    count = canary_count(ready, share)
    assert (count >= 1) == (ready >= 1)
    if ready >= 2:
        assert count < ready
        assert count <= max(1, share * ready + 1e-9)


@given(pods=st.sets(st.text("abcdefgh0123", min_size=1, max_size=6), max_size=30), share=st.floats(0.1, 0.5))
def test_the_same_pods_are_chosen_whatever_their_order(pods: set[str], share: float) -> None:
    forward = choose_pods("ml/chat", sorted(pods), share)
    backward = choose_pods("ml/chat", sorted(pods, reverse=True), share)
    assert forward == backward
    assert set(forward) <= pods
    assert len(forward) == canary_count(len(pods), share)


def test_two_profiles_do_not_always_pick_the_same_pod() -> None:
    pods = [f"ml/pod-{i}" for i in range(8)]
    picks = {choose_pods(f"ml/profile-{i}", pods, 0.1) for i in range(20)}
    assert len(picks) > 1


# ---- one interval's verdict -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("canary_ms", "baseline_ms", "outcome"),
    [
        (400, 300, "pass"),  # both meet: a slower canary within the SLO passes
        (600, 300, "fail"),  # the canary breaks what the baseline meets
        (600, None, "fail"),  # no baseline figure: the canary alone breaks the SLO
        (400, None, "pass"),
        (700, 600, "pass"),  # both over, within one bucket (1.2x)
        (721, 600, "fail"),  # both over, the canary more than 1.2x worse
        (600, 700, "pass"),  # both over, the canary better
        (500, 300, "pass"),  # on the objective is meeting it
        (math.inf, 300, "fail"),  # over the top bucket
        (math.inf, math.inf, "pass"),  # both over the top bucket: not told apart
        (NAN, 300, "noData"),
        (NAN, None, "noData"),
    ],
)
def test_verdict_on_one_objective(canary_ms: float, baseline_ms: float | None, outcome: str) -> None:
    slo = SLO(p99_ms=SLO_MS)

    def obs(ms: float) -> Observations:
        return pod(1e9, saturated=True) if math.isinf(ms) else pod(ms)

    baseline = {} if baseline_ms is None else {"ml/b": obs(baseline_ms)}
    verdict = judge(slo, {"ml/c": obs(canary_ms)}, baseline)
    assert verdict.outcome == outcome, verdict.reason


def test_every_combination_of_two_objectives_and_two_groups() -> None:
    """Exhaustive over meet / break / within-margin / no data for both objectives of both groups."""
    levels = {"meet": 0.5, "break": 1.5, "close": 1.7, "none": NAN}  # x the objective; close is 1.5 * 1.13
    for c_ttft, c_itl, b_ttft, b_itl in itertools.product(levels, repeat=4):
        canary = {"ml/c": pod(SLO_MS * levels[c_ttft], itl_ms=50.0 * levels[c_itl])}
        baseline = {"ml/b": pod(SLO_MS * levels[b_ttft], itl_ms=50.0 * levels[b_itl])}
        verdict = judge(BOTH, canary, baseline)

        def fails(c: str, b: str) -> bool:
            if c in ("meet", "none"):
                return False
            if b in ("meet", "none"):
                return True
            return levels[c] > levels[b] * MARGIN

        expected = (
            "fail"
            if fails(c_ttft, b_ttft) or fails(c_itl, b_itl)
            else "noData"
            if "none" in (c_ttft, c_itl)
            else "pass"
        )
        assert verdict.outcome == expected, (c_ttft, c_itl, b_ttft, b_itl, verdict.reason)


def test_the_worst_canary_pod_counts_and_sparse_pods_are_left_out() -> None:
    slo = SLO(p99_ms=SLO_MS)
    baseline = {"ml/b": pod(300)}
    assert judge(slo, {"ml/c1": pod(300), "ml/c2": pod(900)}, baseline).outcome == "fail"
    sparse = {"ml/c1": pod(300), "ml/c2": pod(900, samples=MIN_SAMPLES - 1)}
    assert judge(slo, sparse, baseline).outcome == "pass"
    only_sparse = {"ml/c2": pod(300, samples=MIN_SAMPLES - 1)}
    assert judge(slo, only_sparse, baseline).outcome == "noData"
    # A sparse baseline pod is no baseline: the canary is judged against the SLO alone.
    verdict = judge(slo, {"ml/c": pod(600)}, {"ml/b": pod(300, samples=1)})
    assert verdict.outcome == "fail" and "no other pod" in verdict.reason


def test_the_reason_names_the_objective_and_both_figures() -> None:
    verdict = judge(SLO(p99_ms=SLO_MS), {"ml/c": pod(800)}, {"ml/b": pod(300)})
    assert verdict.reason == "canary ttft P99 800 ms breaks the SLO's 500 ms, which the other pods meet (300 ms)"


finite_ms = st.floats(1.0, 5000.0)


@given(canary=st.lists(finite_ms, min_size=1, max_size=5), baseline=st.lists(finite_ms, max_size=5))
def test_a_canary_within_the_slo_never_fails_and_one_over_it_never_passes_against_a_baseline_within(
    canary: list[float], baseline: list[float]
) -> None:
    slo = SLO(p99_ms=SLO_MS)
    verdict = judge(
        slo,
        {f"ml/c{i}": pod(ms) for i, ms in enumerate(canary)},
        {f"ml/b{i}": pod(ms) for i, ms in enumerate(baseline)},
    )
    assert verdict.outcome != "noData"
    if max(canary) <= SLO_MS:
        assert verdict.outcome == "pass"
    elif not baseline or max(baseline) <= SLO_MS:
        assert verdict.outcome == "fail"
    else:
        assert verdict.outcome == ("fail" if max(canary) > max(baseline) * MARGIN else "pass")


@given(canary=finite_ms, baseline=finite_ms, better=st.floats(0.0, 1.0))
def test_a_better_canary_never_fails_where_a_worse_one_passes(canary: float, baseline: float, better: float) -> None:
    """Monotone: lowering the canary's P99 never turns a pass into a fail."""
    slo = SLO(p99_ms=SLO_MS)
    worse = judge(slo, {"ml/c": pod(canary)}, {"ml/b": pod(baseline)})
    improved = judge(slo, {"ml/c": pod(canary * better + 1e-3)}, {"ml/b": pod(baseline)})
    if worse.outcome == "pass":
        assert improved.outcome == "pass"


# ---- how a run ends -------------------------------------------------------------------------------------


def run(**fields: object) -> CanaryRun:
    base: dict[str, object] = {
        "window": make_window(cap=24, generation=2),
        "previous": make_window(generation=1),
        "pods": ("ml/a",),
        "started_s": 100.0,
    }
    base.update(fields)
    return CanaryRun(**base)  # type: ignore[arg-type]


PASS, FAIL, NO_DATA = Verdict("pass", "ok"), Verdict("fail", "bad"), Verdict("noData", "none")


def test_a_fail_rolls_back_at_once_even_before_the_rate_window_clears() -> None:
    step = advance(run(), FAIL, intervals=3, now_s=101.0, rate_window_s=60.0)
    assert (step.state, step.reason) == ("rolledBack", "bad")


def test_passes_count_only_once_the_rate_window_lies_after_the_start() -> None:
    early = advance(run(), PASS, intervals=3, now_s=130.0, rate_window_s=60.0)
    assert early.state == "running" and early.run.passes == 0 and "not counted" in early.reason
    counted = advance(run(), PASS, intervals=3, now_s=160.0, rate_window_s=60.0)
    assert counted.state == "running" and counted.run.passes == 1


def test_intervals_passes_promote() -> None:
    state = run()
    states = []
    for now in (200.0, 215.0, 230.0):
        step = advance(state, PASS, intervals=3, now_s=now, rate_window_s=60.0)
        state = step.run
        states.append(step.state)
    assert states == ["running", "running", "promoted"]


def test_no_data_is_not_a_pass_and_rolls_back_after_intervals_in_a_row() -> None:
    state = run(passes=2)
    first = advance(state, NO_DATA, intervals=3, now_s=200.0, rate_window_s=60.0)
    assert first.state == "running" and first.run.passes == 2
    second = advance(first.run, NO_DATA, intervals=3, now_s=215.0, rate_window_s=60.0)
    third = advance(second.run, NO_DATA, intervals=3, now_s=230.0, rate_window_s=60.0)
    assert third.state == "rolledBack" and "no data is not a pass" in third.reason
    # Data in between resets the streak.
    revived = advance(advance(first.run, PASS, intervals=9, now_s=215.0, rate_window_s=60.0).run, NO_DATA,
                      intervals=3, now_s=230.0, rate_window_s=60.0)  # fmt: skip
    assert revived.state == "running" and revived.run.dry == 1


@given(
    verdicts=st.lists(st.sampled_from([PASS, FAIL, NO_DATA]), max_size=30),
    intervals=st.integers(1, 20),
)
def test_a_run_ends_by_its_rule(verdicts: list[Verdict], intervals: int) -> None:
    """Promoted only after ``intervals`` passes and no fail; rolled back at the first fail or at
    ``intervals`` no-data verdicts in a row; otherwise still running."""
    state, passes, dry = run(), 0, 0
    for i, verdict in enumerate(verdicts):
        step = advance(state, verdict, intervals=intervals, now_s=1000.0 + i, rate_window_s=60.0)
        if verdict.outcome == "fail":
            assert step.state == "rolledBack"
            return
        passes, dry = (passes + 1, 0) if verdict.outcome == "pass" else (passes, dry + 1)
        if passes >= intervals and verdict.outcome == "pass":
            assert step.state == "promoted"
            return
        if dry >= intervals:
            assert step.state == "rolledBack"
            return
        assert step.state == "running"
        state = step.run
