"""The inter-token SLO's error budget: a gap P99 a little over its target is not cut while the last
hour's share of gaps over the target leaves room (moves.excused_gap_share)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot_operator.tuning.moves import DEFAULT_CONFIG, excused_gap_share
from batchpilot_operator.tuning.observations import share_above
from batchpilot_operator.tuning.policy import PolicyState, decide
from tests.support.factories import make_observations
from tests.unit.test_policy import itl_spec

INF = math.inf


def hour(share_over_100ms: float, gaps: float = 100_000.0) -> tuple[tuple[float, float], ...]:
    """An hour's cumulative gap buckets with ``share_over_100ms`` of ``gaps`` above 100 ms (a bucket
    edge, so no interpolation is involved)."""
    over = gaps * share_over_100ms
    return ((0.05, (gaps - over) / 2), (0.1, gaps - over), (0.2, gaps - over / 4), (INF, gaps))


def test_share_above_counts_whole_buckets_and_interpolates_inside_one() -> None:
    cumulative = ((0.1, 50.0), (0.2, 90.0), (INF, 100.0))
    assert share_above(0.2, cumulative) == pytest.approx(0.10)
    assert share_above(0.1, cumulative) == pytest.approx(0.50)
    assert share_above(0.15, cumulative) == pytest.approx(0.30)  # half of the (0.1, 0.2] bucket's 40
    assert share_above(0.05, cumulative) == pytest.approx(0.75)  # the first bucket starts at 0
    assert share_above(5.0, cumulative) == pytest.approx(0.10)  # +Inf counts as above
    assert math.isnan(share_above(0.1, ()))
    assert math.isnan(share_above(0.1, ((0.1, 0.0), (INF, 0.0))))


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=8), st.floats(0, 10))
def test_share_above_is_a_share_and_falls_as_the_threshold_rises(counts: list[float], threshold: float) -> None:
    bounds = [0.05 * 2**i for i in range(len(counts) - 1)] + [INF]
    running, cumulative = 0.0, []
    for bound, count in zip(bounds, counts, strict=True):
        running += count
        cumulative.append((bound, running))
    share = share_above(threshold, cumulative)
    if running == 0:
        assert math.isnan(share)
        return
    assert 0.0 <= share <= 1.0
    assert share_above(threshold * 2 + 0.01, cumulative) <= share + 1e-12


def test_gaps_a_little_over_with_the_hours_budget_unspent_are_not_cut() -> None:
    spec, window = itl_spec(budget=2048)
    obs = make_observations(0.2, itl_p99_s=0.105, itl_window_buckets=hour(0.002))
    decision = decide(spec, window, obs, PolicyState(), 100.0)
    assert decision.window.max_prefill_tokens == 2048
    assert decision.state.budget_ceiling is None  # nor does it cap later raises
    assert "Inter-token P99 105 ms is over its 100 ms target this interval, within the error budget" in decision.reason
    assert "0.20% of the last hour's gaps over it (1% allowed)" in decision.reason


def test_the_excuse_narrows_as_the_hour_spends_its_budget() -> None:
    spec, _ = itl_spec()
    # Up to 1 / 0.9 of the target with nothing spent; nothing left once 80 % of the budget is.
    assert (
        excused_gap_share(spec, make_observations(0.2, itl_p99_s=0.111, itl_window_buckets=hour(0.0)), DEFAULT_CONFIG)
        == 0.0
    )
    assert (
        excused_gap_share(spec, make_observations(0.2, itl_p99_s=0.112, itl_window_buckets=hour(0.0)), DEFAULT_CONFIG)
        is None
    )
    half_spent = hour(0.004)  # 0.4 % over: half of the 0.8 % aim, tolerance 0.95
    assert excused_gap_share(
        spec, make_observations(0.2, itl_p99_s=0.105, itl_window_buckets=half_spent), DEFAULT_CONFIG
    ) == pytest.approx(0.004)
    assert (
        excused_gap_share(spec, make_observations(0.2, itl_p99_s=0.106, itl_window_buckets=half_spent), DEFAULT_CONFIG)
        is None
    )
    spent = hour(0.008)
    assert (
        excused_gap_share(spec, make_observations(0.2, itl_p99_s=0.101, itl_window_buckets=spent), DEFAULT_CONFIG)
        is None
    )


@pytest.mark.parametrize(
    "obs",
    [
        make_observations(0.2, itl_p99_s=0.105),  # no hour's histogram (a scrape, another engine)
        make_observations(0.2, itl_p99_s=0.105, itl_window_buckets=hour(0.0, gaps=500.0)),  # too few gaps
        make_observations(0.2, itl_p99_s=0.105, itl_window_buckets=hour(0.009)),  # budget spent
        make_observations(0.2, itl_p99_s=0.150, itl_window_buckets=hour(0.0)),  # far over
        make_observations(0.2, itl_p99_s=0.105, itl_p99_saturated=True, itl_window_buckets=hour(0.0)),
    ],
    ids=["no-hour", "few-gaps", "spent", "far-over", "saturated"],
)
def test_without_an_excuse_gaps_over_their_target_are_cut_as_before(obs: object) -> None:
    spec, window = itl_spec(budget=2048)
    decision = decide(spec, window, obs, PolicyState(), 100.0)  # type: ignore[arg-type]
    assert decision.direction == "down"
    assert decision.window.max_prefill_tokens is not None and decision.window.max_prefill_tokens < 2048
    assert "error budget" not in decision.reason


def test_gaps_within_their_target_are_never_excused_and_raises_read_the_interval_as_it_is() -> None:
    spec, window = itl_spec(budget=1000)
    calm = make_observations(1.4, itl_p99_s=0.080, itl_window_buckets=hour(0.0))
    assert excused_gap_share(spec, calm, DEFAULT_CONFIG) is None
    # First tokens over: the raise stops at 98 % of the gap target, as without the hour's figures.
    with_hour = decide(spec, window, calm, PolicyState(), 100.0)
    without = decide(spec, window, make_observations(1.4, itl_p99_s=0.080), PolicyState(), 100.0)
    assert with_hour.window == without.window
    # An excused interval never raises the budget either: it is read at the target, with no room left.
    excused = decide(
        spec, window, make_observations(1.4, itl_p99_s=0.105, itl_window_buckets=hour(0.0)), PolicyState(), 100.0
    )
    assert excused.window.max_prefill_tokens == 1000


def test_without_an_inter_token_objective_nothing_is_excused() -> None:
    from tests.support.factories import make_policy_spec

    spec = make_policy_spec(slo={"p99Ms": 1000})
    assert (
        excused_gap_share(spec, make_observations(0.2, itl_p99_s=0.5, itl_window_buckets=hour(0.0)), DEFAULT_CONFIG)
        is None
    )
