"""The tuning policy's cases: target, wait, cap, tail ratio and the reasons they give."""

from __future__ import annotations

import math

import pytest

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.tuning.observations import histogram_quantile, is_saturated
from batchpilot_operator.tuning.policy import (
    DEFAULT_CONFIG,
    PolicyState,
    decide,
)
from batchpilot_runtime.contract.metric_names import LATENCY_BUCKETS_S
from batchpilot_runtime.contract.window import Window
from tests.support.factories import make_observations, make_policy_spec, make_window

WINDOW = make_window(generation=3)


def starting_at(target: int, cap: int, wait: int) -> tuple[BatchProfileSpec, Window]:
    """A spec whose starting window is target/cap/wait, and that window in force."""
    spec = make_policy_spec(window={"targetBatchSize": target, "hardCap": cap, "maxWaitMs": wait})
    return spec, Window.from_fields(spec.window, generation=3)


def test_saturated_p99_counts_as_far_over_not_as_its_value() -> None:
    spec = make_policy_spec()
    top = LATENCY_BUCKETS_S[-1]
    # The value itself (150 s) would be over anyway; use a tiny SLO-relative figure to show the flag wins.
    obs = make_observations(p99_s=0.1, p99_saturated=True)
    decision = decide(spec, WINDOW, obs, PolicyState(), 100.0)
    assert decision.direction == "down"
    assert "top bucket" in decision.reason
    assert decision.window.max_wait_ms < WINDOW.max_wait_ms
    assert is_saturated(top) and not is_saturated(0.5)


def test_over_slo_steps_wait_and_target_down_and_leaves_numbering_to_the_loop() -> None:
    decision = decide(make_policy_spec(), WINDOW, make_observations(p99_s=2.5), PolicyState(), 100.0)
    assert decision.direction == "down"
    assert decision.window.target_batch_size == 4
    assert decision.window.max_wait_ms == 10
    assert decision.window.generation == WINDOW.generation  # the control loop numbers what it puts in force
    assert decision.state.last_change_s == 100.0
    assert "over SLO" in decision.reason


def test_dead_band_holds() -> None:
    decision = decide(
        make_policy_spec(),
        WINDOW,
        make_observations(p99_s=0.8, mean_batch_size=4.0, arrival_rate_per_s=300.0),
        PolicyState(),
        100.0,
    )
    assert decision.direction == "hold"
    assert "dead band" in decision.reason


def test_headroom_must_last_two_intervals_before_target_rises() -> None:
    spec = make_policy_spec(window={"hardCap": 128})
    window = make_window(cap=128)
    # Running batch 20, 300 arrivals/s: half the batch plus a third of the 6 arrivals expected in
    # 20 ms reliably fill a target of 12.
    obs = make_observations(p99_s=0.2, mean_batch_size=20.0, arrival_rate_per_s=300.0)
    first = decide(spec, window, obs, PolicyState(), 100.0)
    assert first.direction == "hold"
    second = decide(spec, window, obs, first.state, 115.0)
    assert second.direction == "up"
    assert second.window.target_batch_size == 12


def test_backlog_raises_the_cap_even_over_the_slo() -> None:
    obs = make_observations(p99_s=3.0, mean_batch_size=16.0, queue_depth=40.0)
    decision = decide(make_policy_spec(), WINDOW, obs, PolicyState(), 100.0)
    assert decision.window.hard_cap == 24
    assert "waiting" in decision.reason
    # Target and wait fall for latency while the cap rises for the backlog: over the SLO that
    # mixed move is a step down (an Event saying "up" while P99 misses would mislead).
    assert decision.window.target_batch_size < WINDOW.target_batch_size
    assert decision.direction == "down"


def test_mixed_move_within_the_slo_is_named_up() -> None:
    # P99 in the dead band, a backlog at the cap: the cap rises; a wait far above what the arrival
    # rate needs falls. Within the SLO the move is driven by throughput, so it reads "up".
    spec, window = starting_at(16, 16, 200)
    obs = make_observations(p99_s=0.8, mean_batch_size=15.0, queue_depth=40.0, arrival_rate_per_s=400.0)
    decision = decide(spec, window, obs, PolicyState(), 100.0)
    assert decision.window.hard_cap > window.hard_cap
    assert decision.window.max_wait_ms < window.max_wait_ms
    assert decision.direction == "up"


def test_preemptions_lower_the_cap_and_set_a_ceiling() -> None:
    obs = make_observations(p99_s=0.3, mean_batch_size=16.0, queue_depth=40.0, preemptions_per_s=2.0)
    decision = decide(make_policy_spec(), WINDOW, obs, PolicyState(), 100.0)
    assert decision.direction == "down"
    assert decision.window.hard_cap < WINDOW.hard_cap
    assert decision.state.kv_cap_ceiling == decision.window.hard_cap
    # Later, a backlog cannot push the cap past that ceiling.
    later = decide(make_policy_spec(), decision.window, obs.with_(preemptions_per_s=0.0), decision.state, 200.0)
    assert later.window.hard_cap <= decision.state.kv_cap_ceiling


def test_high_kv_usage_blocks_cap_raises() -> None:
    obs = make_observations(p99_s=3.0, mean_batch_size=16.0, queue_depth=40.0, kv_usage_ratio=0.95)
    decision = decide(make_policy_spec(), WINDOW, obs, PolicyState(), 100.0)
    assert decision.window.hard_cap <= WINDOW.hard_cap


def test_long_steps_over_slo_lower_the_cap() -> None:
    obs = make_observations(p99_s=1.5, mean_batch_size=16.0, queue_depth=0.0, step_s_by_batch={16: 0.4})
    decision = decide(make_policy_spec(), WINDOW, obs, PolicyState(), 100.0)
    assert decision.window.hard_cap < WINDOW.hard_cap
    assert "too long" in decision.reason


def test_friendliness_class_limits_the_cap() -> None:
    window = make_window(cap=32)
    obs = make_observations(p99_s=0.2, mean_batch_size=32.0, queue_depth=40.0)
    low = decide(make_policy_spec(batchFriendliness="low", window={"hardCap": 32}), window, obs, PolicyState(), 100.0)
    high = decide(make_policy_spec(window={"hardCap": 32}), window, obs, PolicyState(), 100.0)
    assert low.window.hard_cap == 32
    assert high.window.hard_cap == 48


def test_auto_mode_stops_the_target_at_the_knee() -> None:
    # Throughput stops growing past 8: 8/0.01 = 16/0.02 = 32/0.04 = 800 tokens/s.
    curve = {1: 0.01, 2: 0.01, 4: 0.01, 8: 0.01, 16: 0.02, 32: 0.04}
    spec = make_policy_spec(batchFriendliness="auto", window={"targetBatchSize": 8, "hardCap": 32})
    window = make_window(cap=32)
    obs = make_observations(p99_s=0.1, mean_batch_size=20.0, arrival_rate_per_s=1000.0, step_s_by_batch=curve)
    state = PolicyState(headroom_streak=5)
    decision = decide(spec, window, obs, state, 100.0)
    assert decision.friendliness is not None and decision.friendliness.knee_batch_size == 8
    assert decision.window.target_batch_size == 8


def test_wait_follows_the_arrival_rate_up_to_the_profiles_own_wait() -> None:
    spec = make_policy_spec(window={"maxWaitMs": 60}, tuning={"maxStepFraction": 1.0, "cooldownSeconds": 0})
    window = make_window(wait_ms=40)
    state = PolicyState(headroom_streak=5)
    fast = decide(
        spec, window, make_observations(p99_s=0.1, mean_batch_size=2.0, arrival_rate_per_s=1000.0), state, 100.0
    )
    slow = decide(spec, window, make_observations(p99_s=0.1, mean_batch_size=2.0, arrival_rate_per_s=5.0), state, 100.0)
    assert fast.window.max_wait_ms < window.max_wait_ms
    # 1.5 x 6 missing sequences / 5 per s would be 1.8 s; a tenth of the 1 s SLO is 100 ms; the profile's is 60.
    assert slow.window.max_wait_ms == 60


def test_a_wait_at_the_profiles_own_does_not_rise_at_light_load() -> None:
    # Issue 31: a wait raised while the engine idles is still in force when the next burst comes.
    spec = make_policy_spec(tuning={"maxStepFraction": 1.0, "cooldownSeconds": 0})
    window = Window.from_fields(spec.window, generation=3)
    obs = make_observations(p99_s=0.1, mean_batch_size=2.0, arrival_rate_per_s=5.0, tokens_per_s=5.0)
    state = PolicyState()
    for i in range(10):
        decision = decide(spec, window, obs, state, 100.0 + 15 * i)
        state, window = decision.state, decision.window
    assert window.max_wait_ms <= spec.window.max_wait_ms


def test_window_outside_bounds_is_clamped_at_once() -> None:
    spec = make_policy_spec(tuning={"bounds": {"hardCap": {"min": 1, "max": 64}}})
    window = make_window(cap=200)
    decision = decide(spec, window, make_observations(), PolicyState(last_change_s=99.0), 100.0)
    assert decision.direction == "reset"
    assert decision.window.hard_cap == 64


def test_tail_ratio_rises_when_marking_catches_everyone_up_to_the_profiles_own() -> None:
    obs = make_observations(p99_s=2.0, tail_marked_share=0.5)
    decision = decide(make_policy_spec(window={"tailMarkRatio": 3.0}), WINDOW, obs, PolicyState(), 100.0)
    assert decision.window.tail_mark_ratio == pytest.approx(2.25)
    # At the profile's own ratio it stays: a higher one only holds requests for the rest of the wait.
    at_own = decide(make_policy_spec(), WINDOW, obs, PolicyState(), 100.0)
    assert at_own.window.tail_mark_ratio == WINDOW.tail_mark_ratio


def test_tail_ratio_stays_when_the_new_window_has_no_wait() -> None:
    # Over the SLO on a busy engine the 5 ms wait falls to 0: every queued request is then admitted
    # at the next step with room, oldest first, so a high marked share says nothing about the ratio.
    spec, window = starting_at(8, 16, 5)
    obs = make_observations(p99_s=2.0, tail_marked_share=0.5, tokens_per_s=400.0, step_s_by_batch={8: 0.02})
    decision = decide(spec, window, obs, PolicyState(), 100.0)
    assert decision.window.max_wait_ms == 0
    assert decision.window.tail_mark_ratio == window.tail_mark_ratio


def test_histogram_quantile_matches_prometheus() -> None:
    bounds = (0.1, 0.2, 0.4)
    assert math.isnan(histogram_quantile(0.99, bounds, [0, 0, 0, 0]))
    assert histogram_quantile(0.5, bounds, [0, 10, 0, 0]) == pytest.approx(0.15)
    assert histogram_quantile(0.99, bounds, [0, 0, 0, 5]) == 0.4  # +Inf bucket -> top finite bound
    with pytest.raises(ValueError, match="counts"):
        histogram_quantile(0.5, bounds, [1, 2])


def test_a_busy_engine_gets_no_wait_and_a_target_its_batch_fills() -> None:
    # 400 tokens/s from a running batch of 10: 40 decode steps/s of 20 ms, busy 80 % of the time.
    # A held request would join a step that runs anyway: the wait goes, and the target comes down
    # to what the running batch fills (else every admission would be a timer admission).
    spec, window = starting_at(16, 64, 5)
    obs = make_observations(
        p99_s=0.2, mean_batch_size=10.0, arrival_rate_per_s=2.0, tokens_per_s=400.0, step_s_by_batch={16: 0.02}
    )
    # No confirmation needed: dropping a wait only shortens latency.
    decision = decide(spec, window, obs, PolicyState(), 100.0)
    assert decision.window.max_wait_ms == 0
    assert decision.window.target_batch_size == 8  # half-way to 5 (half the batch), the step limit
    assert decision.direction == "down"
    assert "decodes 80% of the time" in decision.reason


def test_an_idle_engine_still_waits_for_sparse_arrivals() -> None:
    # The same load shape at 20 tokens/s: the engine decodes 4 % of the time, so a wait lets
    # arrivals share a prefill step; it follows the arrival rate up as before.
    spec = make_policy_spec(window={"targetBatchSize": 4, "hardCap": 64, "maxWaitMs": 20})
    window = Window.from_fields(spec.window.model_copy(update={"max_wait_ms": 5}), generation=3)
    obs = make_observations(
        p99_s=0.2, mean_batch_size=2.0, arrival_rate_per_s=20.0, tokens_per_s=20.0, step_s_by_batch={2: 0.004}
    )
    # A raise (up to the profile's own 20 ms) waits for its confirmation (noise must not flip it), then comes.
    state = PolicyState()
    for i in range(DEFAULT_CONFIG.dead_band_confirm_intervals):
        decision = decide(spec, window, obs, state, 100.0 + 15 * i)
        state = decision.state
        if decision.changed:
            break
    assert 0 < i < DEFAULT_CONFIG.dead_band_confirm_intervals
    assert window.max_wait_ms < decision.window.max_wait_ms <= 20
    assert decision.direction == "up"
    assert "raising the wait" in decision.reason and "as far as arrivals fill them" in decision.reason


def test_the_reason_names_what_moved_and_which_way() -> None:
    # Confirmed headroom: the target rises to 12 (the step limit; half the batch of 10 plus a third
    # of the 30 arrivals in 100 ms would fill 15), and at 300 arrivals/s the gap of 2 over the batch
    # fills in 10 ms, so the wait falls: the reason must say both, each with its direction.
    spec, window = starting_at(8, 128, 100)
    obs = make_observations(p99_s=0.2, mean_batch_size=10.0, arrival_rate_per_s=300.0)
    first = decide(spec, window, obs, PolicyState(), 100.0)
    decision = decide(spec, window, obs, first.state, 115.0)
    assert decision.window.target_batch_size > window.target_batch_size
    assert decision.window.max_wait_ms < window.max_wait_ms
    assert f"raising the target to {decision.window.target_batch_size}" in decision.reason
    assert f"lowering the wait to {decision.window.max_wait_ms} ms" in decision.reason
