"""The first window of a profile that gives none: derived from spec.stepCosts and the SLO (issue 31)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot_operator.api.bounds import WindowBounds
from batchpilot_operator.api.crd import custom_resource_definition
from batchpilot_operator.api.first_window import DECODE_SHARE, GAP_SHARE, first_window
from batchpilot_operator.api.profile import ProfileError, parse_spec
from batchpilot_operator.api.step_costs import StepCosts
from batchpilot_runtime.contract.window import MAX_PREFILL_TOKENS_LIMIT
from tests.support.crd_validation import validate_object
from tests.support.factories import make_manifest, make_spec_dict

A100 = {"fixedMs": 11.3, "prefillUsPerToken": 61.0, "decodeUsPerSequence": 24.0, "source": "a100-llama2-7b"}
CRD = custom_resource_definition()

costs_st = st.builds(
    lambda fixed_ms, prefill_us_per_token, decode_us_per_sequence: StepCosts(
        fixed_ms=fixed_ms, prefill_us_per_token=prefill_us_per_token, decode_us_per_sequence=decode_us_per_sequence
    ),
    fixed_ms=st.floats(0.0, 200.0),
    prefill_us_per_token=st.floats(0.01, 5000.0),
    decode_us_per_sequence=st.floats(0.0, 5000.0),
)
bounds_st = st.builds(
    lambda cap, target, budget_lo, budget_span, wait_lo: WindowBounds.model_validate(
        {
            "hardCap": {"min": 1, "max": cap},
            "targetBatchSize": {"min": min(target, cap), "max": cap},
            "maxPrefillTokens": {"min": budget_lo, "max": min(MAX_PREFILL_TOKENS_LIMIT, budget_lo + budget_span)},
            "maxWaitMs": {"min": wait_lo, "max": wait_lo + 100},
        }
    ),
    st.integers(1, 4096),
    st.integers(1, 64),
    st.integers(1, 4096),
    st.integers(0, 65536),
    st.integers(0, 50),
)
targets_st = st.one_of(st.none(), st.floats(1.0, 2000.0))


@given(costs_st, bounds_st, st.integers(1, 4096), targets_st, targets_st)
def test_the_derived_window_lies_within_the_bounds(
    costs: StepCosts, bounds: WindowBounds, ceiling: int, inter_token: float | None, first_token: float | None
) -> None:
    window = first_window(costs, bounds, ceiling, inter_token_ms=inter_token, first_token_ms=first_token)
    assert bounds.fields_outside(window) == []
    assert window.target_batch_size <= window.hard_cap
    assert window.target_batch_size == max(1, min(bounds.target_batch_size.min, window.hard_cap))
    assert window.max_wait_ms == bounds.max_wait_ms.min  # a held request only joins a later step
    assert (window.max_prefill_tokens is None) == (inter_token is None)


@given(costs_st, st.floats(1.0, 1000.0), st.floats(1.0, 1000.0))
def test_a_looser_inter_token_target_never_gives_a_smaller_budget_or_cap(
    costs: StepCosts, tight: float, extra: float
) -> None:
    bounds = WindowBounds.model_validate({"maxPrefillTokens": {"min": 1, "max": MAX_PREFILL_TOKENS_LIMIT}})
    low = first_window(costs, bounds, 4096, inter_token_ms=tight, first_token_ms=None)
    high = first_window(costs, bounds, 4096, inter_token_ms=tight + extra, first_token_ms=None)
    assert low.max_prefill_tokens is not None and high.max_prefill_tokens is not None
    assert high.max_prefill_tokens >= low.max_prefill_tokens
    assert high.hard_cap >= low.hard_cap


@given(costs_st, st.floats(20.0, 1000.0))
def test_the_budgets_step_fills_its_share_of_the_inter_token_target(costs: StepCosts, inter_token: float) -> None:
    bounds = WindowBounds.model_validate({"maxPrefillTokens": {"min": 1, "max": MAX_PREFILL_TOKENS_LIMIT}})
    window = first_window(costs, bounds, 4096, inter_token_ms=inter_token, first_token_ms=None)
    assert window.max_prefill_tokens is not None
    step_s = costs.fixed_s + window.max_prefill_tokens * costs.prefill_s_per_token
    share_s = GAP_SHARE * inter_token / 1000.0
    # The floor of one token may overrun a target the fixed part fills; the top of the bounds stops short.
    if 1 < window.max_prefill_tokens < MAX_PREFILL_TOKENS_LIMIT:
        assert step_s <= share_s + 1e-9
        assert step_s + costs.prefill_s_per_token > share_s  # the largest such budget


def test_the_a100_windows_of_the_suites_slo_pairs() -> None:
    """Worked numbers: 0.6 x 100 ms = 60 ms, less 11.3 ms fixed, at 61 us a token: 798 tokens."""
    costs = StepCosts.model_validate(A100)
    bounds = WindowBounds.model_validate({"hardCap": {"max": 256}, "maxPrefillTokens": {"min": 128, "max": 16384}})
    budgets = {
        itl: first_window(costs, bounds, 128, inter_token_ms=itl, first_token_ms=1000.0).max_prefill_tokens
        for itl in (50.0, 100.0, 200.0)
    }
    assert budgets == {50.0: 306, 100.0: 798, 200.0: 1781}


def test_the_cap_keeps_a_full_batch_of_decodes_within_half_the_inter_token_target() -> None:
    costs = StepCosts(fixed_ms=10.0, prefill_us_per_token=50.0, decode_us_per_sequence=1000.0)
    window = first_window(costs, WindowBounds(), 4096, inter_token_ms=50.0, first_token_ms=None)
    assert window.hard_cap == 15  # (0.5 x 50 ms - 10 ms) / 1 ms
    assert costs.fixed_s + window.hard_cap * costs.decode_s_per_sequence <= DECODE_SHARE * 0.050 + 1e-12


def test_one_step_stays_within_the_first_token_target() -> None:
    costs = StepCosts(fixed_ms=1.0, prefill_us_per_token=100.0)
    bounds = WindowBounds.model_validate({"maxPrefillTokens": {"min": 1, "max": 100_000}})
    window = first_window(costs, bounds, 128, inter_token_ms=2000.0, first_token_ms=300.0)
    assert window.max_prefill_tokens == 3000  # 300 ms / 100 us, under the 11 990 the gaps allow


def spec_without_window(**sections: Any) -> dict[str, Any]:
    return make_spec_dict(window=None, stepCosts=A100, **sections)


def test_a_profile_with_step_costs_and_no_window_starts_from_the_derived_one() -> None:
    spec = parse_spec(spec_without_window(slo={"p99Ms": 1000, "interTokenP99Ms": 100}))
    assert spec.given_window is None
    assert (spec.window.target_batch_size, spec.window.max_wait_ms, spec.window.max_prefill_tokens) == (1, 0, 798)
    assert spec.window.hard_cap == 128  # batchFriendliness auto: medium's ceiling until measured
    assert spec.window_source.startswith("derived from spec.stepCosts (fixed 11.3 ms, 61 us per prompt token")


def test_a_given_window_wins_over_step_costs() -> None:
    spec = parse_spec(make_spec_dict(stepCosts=A100))
    assert spec.window_source == "spec.window"
    assert spec.window.target_batch_size == 8


def test_neither_window_nor_step_costs_is_refused_by_the_models_and_the_crd_alike() -> None:
    bare = make_spec_dict(window=None)
    with pytest.raises(ProfileError, match=r"spec\.window may be left out only when spec\.stepCosts is given"):
        parse_spec(bare)
    _, errors = validate_object(CRD, make_manifest(bare))
    assert any("spec.window may be left out only when spec.stepCosts is given" in e for e in errors), errors


def test_the_crd_accepts_a_profile_without_a_window_when_it_gives_step_costs() -> None:
    manifest = make_manifest(spec_without_window(slo={"p99Ms": 1000, "interTokenP99Ms": 100}))
    _, errors = validate_object(CRD, manifest)
    assert errors == []


def test_a_derived_cap_under_a_lanes_reserved_slots_is_refused_naming_both() -> None:
    lanes = [{"name": "c", "reservedSlots": 40, "window": {"targetBatchSize": 1, "hardCap": 2, "maxWaitMs": 0}}]
    with pytest.raises(ProfileError, match=r"lanes\[c\].reservedSlots \(40\) must not exceed window.hardCap \(32\)"):
        parse_spec(spec_without_window(batchFriendliness="low", lanes=lanes))
