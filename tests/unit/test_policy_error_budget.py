"""The inter-token SLO's error budget: a gap P99 a little over its target is not cut while the last
hour's share of gaps over the target leaves room (error_budget.excused_gap_share), and an hour over that
budget is paid back by reading the gaps longer (error_budget.gap_payback)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot_operator.tuning.config import DEFAULT_CONFIG
from batchpilot_operator.tuning.error_budget import GapReading, excused_gap_share, gap_payback, read_gaps
from batchpilot_operator.tuning.observations import share_above
from batchpilot_operator.tuning.policy import PolicyState, decide
from tests.support.factories import make_observations
from tests.unit.test_policy_budget import itl_spec

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


def test_an_hour_over_budget_reads_the_gaps_longer_by_its_overspend_up_to_five_percent() -> None:
    spec, _ = itl_spec()

    def payback(share: float, **fields: object) -> tuple[float, float] | None:
        obs = make_observations(0.2, itl_p99_s=fields.pop("itl_p99_s", 0.097), itl_window_buckets=hour(share), **fields)
        return gap_payback(spec, obs, DEFAULT_CONFIG)

    assert payback(0.0) is None
    assert payback(0.01) is None  # exactly the budget: nothing to pay back
    share, factor = payback(0.0102) or (0.0, 0.0)
    assert share == pytest.approx(0.0102) and factor == pytest.approx(1.02)
    assert payback(0.03) == (pytest.approx(0.03), 1.05)
    assert payback(0.03, itl_p99_saturated=True) is None  # nothing to read longer
    assert (
        gap_payback(
            spec, make_observations(0.2, itl_p99_s=0.097, itl_window_buckets=hour(0.03, gaps=500.0)), DEFAULT_CONFIG
        )
        is None
    )


@given(st.floats(0.0, 0.2), st.floats(0.0, 0.2))
def test_the_payback_factor_grows_with_the_overspend_and_stays_within_its_bound(low: float, high: float) -> None:
    spec, _ = itl_spec()
    low, high = sorted((low, high))
    factors = [
        (
            gap_payback(spec, make_observations(0.2, itl_p99_s=0.09, itl_window_buckets=hour(s)), DEFAULT_CONFIG)
            or (0, 1.0)
        )[1]
        for s in (low, high)
    ]
    assert 1.0 <= factors[0] <= factors[1] <= DEFAULT_CONFIG.gap_payback_max


def test_gaps_just_under_target_are_cut_while_the_hour_is_over_budget_and_the_reason_says_why() -> None:
    spec, window = itl_spec(budget=2048)
    calm = decide(
        spec, window, make_observations(0.2, itl_p99_s=0.097, itl_window_buckets=hour(0.009)), PolicyState(), 100.0
    )
    assert calm.direction == "hold"  # within budget: 97 ms under a 100 ms target is left alone
    over = decide(
        spec, window, make_observations(0.2, itl_p99_s=0.097, itl_window_buckets=hour(0.02)), PolicyState(), 100.0
    )
    assert over.direction == "down"
    # Read as 97 x 1.05 = 101.85 ms and aimed at 85 % of the target: 2048 x 0.85 / 1.0185 = 1709.2,
    # a cut rounding up to a whole token.
    assert over.window.max_prefill_tokens == 1710
    assert over.state.budget_ceiling == 1710
    # The reason names the gaps as read, and the note what was measured and why it was read longer.
    assert "(inter-token P99 102 ms over its 100 ms target)" in over.reason
    assert (
        "The interval's inter-token P99 of 97 ms is read 5% longer (102 ms) until the error budget is paid"
        " back: 2.00% of the last hour's gaps were over the 100 ms target (1% allowed)." in over.reason
    )


def test_an_hour_over_budget_stops_a_raise_for_first_tokens_lower() -> None:
    spec, window = itl_spec(budget=1000)
    waiting = {"itl_p99_s": 0.080, "prefill_s_per_token": 2e-5}
    without = decide(spec, window, make_observations(1.4, **waiting), PolicyState(), 100.0)
    paying = decide(
        spec, window, make_observations(1.4, itl_window_buckets=hour(0.0103), **waiting), PolicyState(), 100.0
    )
    assert without.direction == paying.direction == "up"
    assert 1000 < (paying.window.max_prefill_tokens or 0) < (without.window.max_prefill_tokens or 0)
    assert "read 3% longer" in paying.reason


def test_the_gap_reading_says_what_the_moves_read_beside_the_intervals_own_figure() -> None:
    spec, _ = itl_spec()

    def gaps(itl_p99_s: float, share: float) -> GapReading:
        obs = make_observations(0.2, itl_p99_s=itl_p99_s, itl_window_buckets=hour(share))
        return read_gaps(spec, obs, DEFAULT_CONFIG)

    excused = gaps(0.105, 0.002)
    assert (excused.why, excused.p99_s, excused.own_p99_s) == ("excused", 0.1, 0.105)
    assert excused.named_p99_s == 0.105 and excused.hour_share == pytest.approx(0.002)
    paid = gaps(0.097, 0.03)
    assert (paid.why, paid.own_p99_s, paid.factor) == ("payback", 0.097, 1.05)
    assert paid.p99_s == paid.named_p99_s == pytest.approx(0.097 * 1.05)
    as_is = gaps(0.097, 0.0)
    assert (as_is.why, as_is.p99_s, as_is.own_p99_s, as_is.factor) == ("as_is", 0.097, 0.097, 1.0)
