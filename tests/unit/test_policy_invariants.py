"""The tuning policy's invariants, over generated specs, windows, observations and memories
(hypothesis)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.tuning.observations import NAN, Observations
from batchpilot_operator.tuning.policy import (
    RATIO_MIN_STEP,
    SIZE_MIN_STEP,
    WAIT_MIN_STEP_MS,
    PolicyState,
    allowed_step,
    decide,
)
from batchpilot_runtime.contract.window import Window
from tests.support.factories import make_policy_spec

# ---- strategies ------------------------------------------------------------


@st.composite
def spec_and_window(draw: st.DrawFn) -> tuple[BatchProfileSpec, Window]:
    t_lo = draw(st.integers(1, 16))
    t_hi = draw(st.integers(t_lo, 256))
    c_lo = draw(st.integers(1, t_hi))
    c_hi = draw(st.integers(max(c_lo, t_lo), 512))
    w_lo = draw(st.integers(0, 50))
    w_hi = draw(st.integers(w_lo, 1000))
    r_lo = draw(st.floats(1.1, 3.0))
    r_hi = draw(st.floats(r_lo, 6.0))
    cap = draw(st.integers(max(c_lo, t_lo), c_hi))
    target = draw(st.integers(t_lo, min(t_hi, cap)))
    wait = draw(st.integers(w_lo, w_hi))
    ratio = draw(st.floats(r_lo, r_hi))
    b_lo = draw(st.integers(1, 4096))
    b_hi = draw(st.integers(b_lo, 65_536))
    budget = draw(st.one_of(st.none(), st.integers(b_lo, b_hi)))
    itl_ms = draw(st.one_of(st.none(), st.floats(5, 2000)))
    window_fields: dict[str, Any] = {
        "targetBatchSize": target,
        "hardCap": cap,
        "maxWaitMs": wait,
        "tailMarkRatio": ratio,
    }
    if budget is not None:
        window_fields["maxPrefillTokens"] = budget
    # An SLO with an inter-token target may leave out the first-token one.
    p99_ms = draw(st.floats(50, 10_000) if itl_ms is None else st.one_of(st.none(), st.floats(50, 10_000)))
    slo: dict[str, Any] = {"p99Ms": p99_ms}
    if itl_ms is not None:
        slo["interTokenP99Ms"] = itl_ms
    spec = make_policy_spec(
        batchFriendliness=draw(st.sampled_from(["high", "medium", "low", "auto"])),
        window=window_fields,
        slo=slo,
        tuning={
            "intervalSeconds": 15,
            "cooldownSeconds": draw(st.integers(0, 120)),
            "maxStepFraction": draw(st.floats(0.05, 1.0)),
            "bounds": {
                "targetBatchSize": {"min": t_lo, "max": t_hi},
                "hardCap": {"min": c_lo, "max": c_hi},
                "maxWaitMs": {"min": w_lo, "max": w_hi},
                "tailMarkRatio": {"min": r_lo, "max": r_hi},
                "maxPrefillTokens": {"min": b_lo, "max": b_hi},
            },
        },
    )
    return spec, Window.from_fields(spec.window, generation=draw(st.integers(0, 100)))


finite_or_nan = st.one_of(st.just(NAN), st.floats(0.0, 1e4))
observations = st.builds(
    Observations,
    p50_s=st.one_of(st.just(NAN), st.floats(0.0, 200.0)),
    p99_s=st.one_of(st.just(NAN), st.floats(0.0, 200.0)),
    p999_s=st.one_of(st.just(NAN), st.floats(0.0, 200.0)),
    p99_saturated=st.booleans(),
    samples=st.one_of(st.just(NAN), st.floats(0, 1e5)),
    queue_depth=finite_or_nan,
    arrival_rate_per_s=finite_or_nan,
    tokens_per_s=st.one_of(st.just(NAN), st.floats(0.0, 1e5)),
    mean_batch_size=st.one_of(st.just(NAN), st.floats(0.0, 600.0)),
    kv_usage_ratio=st.one_of(st.just(NAN), st.floats(0.0, 1.0)),
    preemptions_per_s=st.one_of(st.just(NAN), st.floats(0.0, 50.0)),
    tail_marked_share=st.one_of(st.just(NAN), st.floats(0.0, 1.0)),
    itl_p99_s=st.one_of(st.just(NAN), st.floats(0.0, 5.0)),
    itl_p99_saturated=st.booleans(),
    step_s_by_batch=st.dictionaries(
        st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]), st.floats(1e-4, 2.0), max_size=6
    ),
)
states = st.builds(
    PolicyState,
    last_change_s=st.one_of(st.none(), st.floats(0, 1000)),
    headroom_streak=st.integers(0, 5),
    calm_streak=st.integers(0, 30),
    kv_cap_ceiling=st.one_of(st.none(), st.integers(1, 512)),
)

PROPERTY_SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(spec_and_window(), observations, states, st.floats(0, 2000))
def test_never_leaves_bounds_and_target_within_cap(
    sw: tuple[BatchProfileSpec, Window], obs: Observations, state: PolicyState, now_s: float
) -> None:
    spec, window = sw
    decision = decide(spec, window, obs, state, now_s)
    assert spec.tuning.bounds.fields_outside(decision.window) == []
    assert decision.window.target_batch_size <= decision.window.hard_cap


@PROPERTY_SETTINGS
@given(spec_and_window(), observations, states, st.floats(0, 2000), st.integers(0, 1000), st.floats(1.1, 6.0))
def test_wait_and_tail_ratio_never_rise_past_the_profiles_own(
    sw: tuple[BatchProfileSpec, Window], obs: Observations, state: PolicyState, now_s: float, wait: int, ratio: float
) -> None:
    # Issue 31: raised at light load, both are in force at the next burst, and neither shortens a latency.
    spec, start = sw
    bounds = spec.tuning.bounds
    window = start.model_copy(
        update={
            "max_wait_ms": min(max(wait, bounds.max_wait_ms.min), bounds.max_wait_ms.max),
            "tail_mark_ratio": min(max(ratio, bounds.tail_mark_ratio.min), bounds.tail_mark_ratio.max),
        }
    )
    decision = decide(spec, window, obs, state, now_s)
    assert decision.window.max_wait_ms <= max(window.max_wait_ms, spec.window.max_wait_ms)
    assert decision.window.tail_mark_ratio <= max(window.tail_mark_ratio, spec.window.tail_mark_ratio) + 1e-9


@PROPERTY_SETTINGS
@given(spec_and_window(), observations, states, st.floats(0, 2000))
def test_each_field_moves_at_most_one_step(
    sw: tuple[BatchProfileSpec, Window], obs: Observations, state: PolicyState, now_s: float
) -> None:
    spec, window = sw
    fraction = spec.tuning.max_step_fraction
    new = decide(spec, window, obs, state, now_s).window
    assert (
        abs(new.target_batch_size - window.target_batch_size)
        <= allowed_step(window.target_batch_size, fraction, SIZE_MIN_STEP) + 1e-9
    )
    assert abs(new.hard_cap - window.hard_cap) <= allowed_step(window.hard_cap, fraction, SIZE_MIN_STEP) + 1e-9
    assert (
        abs(new.max_wait_ms - window.max_wait_ms) <= allowed_step(window.max_wait_ms, fraction, WAIT_MIN_STEP_MS) + 1e-9
    )
    assert (
        abs(new.tail_mark_ratio - window.tail_mark_ratio)
        <= allowed_step(window.tail_mark_ratio, fraction, RATIO_MIN_STEP) + 1e-3
    )
    if window.max_prefill_tokens is not None and new.max_prefill_tokens is not None:
        old_budget = window.max_prefill_tokens
        assert abs(new.max_prefill_tokens - old_budget) <= allowed_step(old_budget, fraction, SIZE_MIN_STEP) + 1e-9


@PROPERTY_SETTINGS
@given(spec_and_window(), observations, states, st.floats(0, 2000))
def test_the_budget_moves_only_for_an_inter_token_objective(
    sw: tuple[BatchProfileSpec, Window], obs: Observations, state: PolicyState, now_s: float
) -> None:
    spec, window = sw
    assume(spec.slo.inter_token_p99_ms is None)
    assume(spec.tuning.bounds.fields_outside(window) == [])
    assert decide(spec, window, obs, state, now_s).window.max_prefill_tokens == window.max_prefill_tokens


@PROPERTY_SETTINGS
@given(spec_and_window(), observations, states, st.floats(0, 2000), st.floats(0.0, 5.0), st.floats(0.0, 5.0))
def test_a_worse_inter_token_p99_never_gives_a_larger_budget(
    sw: tuple[BatchProfileSpec, Window], obs: Observations, state: PolicyState, now_s: float, a_s: float, b_s: float
) -> None:
    spec, window = sw
    better, worse = sorted((a_s, b_s))
    top = spec.tuning.bounds.max_prefill_tokens.max + 1
    budgets = [
        decide(spec, window, obs.with_(itl_p99_s=v, itl_p99_saturated=False), state, now_s).window.max_prefill_tokens
        for v in (better, worse)
    ]
    assert (budgets[1] or top) <= (budgets[0] or top)


@PROPERTY_SETTINGS
@given(spec_and_window(), observations, st.floats(0, 2000), st.floats(0, 1))
def test_no_change_inside_cooldown(
    sw: tuple[BatchProfileSpec, Window], obs: Observations, last_s: float, share: float
) -> None:
    spec, window = sw
    assume(spec.tuning.cooldown_seconds > 0)
    now_s = last_s + share * spec.tuning.cooldown_seconds * 0.999
    decision = decide(spec, window, obs, PolicyState(last_change_s=last_s), now_s)
    assert not decision.changed
    assert decision.window == window


@PROPERTY_SETTINGS
@given(spec_and_window(), observations, states, st.floats(0, 2000), st.floats(0, 19.99))
def test_no_action_on_nan_or_sparse_data(
    sw: tuple[BatchProfileSpec, Window], obs: Observations, state: PolicyState, now_s: float, sparse: float
) -> None:
    spec, window = sw
    # Blind on the objective that decides: the first-token P99, or the gaps when it is the only one.
    no_data = (
        obs.with_(p99_s=NAN, p99_saturated=False)
        if spec.slo.p99_ms is not None
        else obs.with_(itl_p99_s=NAN, itl_p99_saturated=False)
    )
    for blind in (no_data, obs.with_(samples=sparse), obs.with_(samples=NAN)):
        decision = decide(spec, window, blind, state, now_s)
        assert decision.window == window
        assert decision.direction == "hold"


@PROPERTY_SETTINGS
@given(spec_and_window(), observations, states, st.floats(0, 2000), st.floats(0.0, 100.0), st.floats(0.0, 100.0))
def test_worse_p99_never_gives_a_larger_cap(
    sw: tuple[BatchProfileSpec, Window], obs: Observations, state: PolicyState, now_s: float, a_s: float, b_s: float
) -> None:
    spec, window = sw
    better, worse = sorted((a_s, b_s))
    base = obs.with_(samples=1000.0, p99_saturated=False)
    cap_better = decide(spec, window, base.with_(p99_s=better), state, now_s).window.hard_cap
    cap_worse = decide(spec, window, base.with_(p99_s=worse), state, now_s).window.hard_cap
    cap_saturated = decide(spec, window, base.with_(p99_s=worse, p99_saturated=True), state, now_s).window.hard_cap
    assert cap_worse <= cap_better
    assert cap_saturated <= cap_worse
