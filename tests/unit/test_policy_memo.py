"""The policy's memory in status and back: round trip, bounds, versions, garbage, spec changes."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.api.status import POLICY_CURVE_LIMIT, POLICY_STREAK_LIMIT
from batchpilot_operator.tuning.policy import PolicyState
from batchpilot_operator.tuning.policy_memo import SCHEMA_VERSION, carry_over, restore, to_status
from tests.support import factories

NOW_S = 1_750_000_000.0


def make_spec(**bounds: Any) -> BatchProfileSpec:
    return factories.make_spec(
        window={"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 40, "maxPrefillTokens": 1024},
        tuning={"bounds": bounds},
    )


def written(state: PolicyState, generation: int | None = 3) -> dict[str, Any]:
    """The status an operator writes for this state (JSON, as the API server stores it)."""
    memory = to_status(state, generation)
    return {} if memory is None else {"policy": memory.model_dump(by_alias=True, exclude_none=True, mode="json")}


def bounded(state: PolicyState) -> PolicyState:
    """What the schema keeps of a state (see policy_memo's invariants)."""
    return replace(
        state,
        headroom_streak=min(state.headroom_streak, POLICY_STREAK_LIMIT),
        under_streak=min(state.under_streak, POLICY_STREAK_LIMIT),
        calm_streak=min(state.calm_streak, POLICY_STREAK_LIMIT),
        itl_calm_streak=min(state.itl_calm_streak, POLICY_STREAK_LIMIT),
        step_curve=state.step_curve[:POLICY_CURVE_LIMIT],
        decisions=0,
    )


streaks = st.integers(min_value=0, max_value=3 * POLICY_STREAK_LIMIT)
states = st.builds(
    PolicyState,
    last_change_s=st.none() | st.floats(min_value=1e9, max_value=NOW_S),
    headroom_streak=streaks,
    under_streak=streaks,
    calm_streak=streaks,
    kv_cap_ceiling=st.none() | st.integers(min_value=1, max_value=4096),
    budget_ceiling=st.none() | st.integers(min_value=1, max_value=262_144),
    itl_calm_streak=streaks,
    step_curve=st.dictionaries(
        st.integers(min_value=1, max_value=4096),
        st.floats(min_value=1e-6, max_value=30.0),
        max_size=POLICY_CURVE_LIMIT + 4,
    ).map(lambda curve: tuple(sorted(curve.items()))),
    decisions=st.integers(min_value=0, max_value=10_000),
)


@given(states)
def test_a_state_read_back_is_the_state_written_within_the_schema_bounds(state: PolicyState) -> None:
    restored = restore(written(state), make_spec(), 3, NOW_S)
    assert restored.problem is None and not restored.carried_over
    expected = bounded(state)
    if state.last_change_s is None:
        assert restored.state == expected
    else:
        # Kept to the microsecond (RFC 3339 text): the cooldown moves by less than that.
        assert restored.state.last_change_s is not None
        assert abs(restored.state.last_change_s - state.last_change_s) <= 1e-6
        assert replace(restored.state, last_change_s=None) == replace(expected, last_change_s=None)


@given(states)
def test_what_is_read_back_is_written_again_unchanged(state: PolicyState) -> None:
    """A restarted operator patches nothing for the memory it just read (status written only on change)."""
    first = written(state)
    assert written(restore(first, make_spec(), 3, NOW_S).state) == first


def test_a_fresh_state_writes_no_block_and_no_block_reads_as_fresh() -> None:
    assert to_status(PolicyState(decisions=12), 1) is None
    assert restore({"window": {}}, make_spec(), 1, NOW_S).state == PolicyState()
    assert restore(None, None, None, NOW_S).problem is None


def test_a_last_change_in_the_future_counts_as_now() -> None:
    status = written(PolicyState(last_change_s=NOW_S + 3600.0))
    assert restore(status, make_spec(), 3, NOW_S).state.last_change_s == NOW_S


def test_a_state_with_values_the_schema_cannot_hold_is_still_written() -> None:
    state = PolicyState(last_change_s=math.inf, step_curve=((0, 0.1), (8, math.nan), (9000, 0.5), (16, 0.02)))
    memory = to_status(state, 1)
    assert memory is not None and [p.batch_size for p in memory.step_curve] == [16]
    assert memory.last_change_time is None


@pytest.mark.parametrize(
    ("policy", "problem"),
    [
        pytest.param({"version": 2, "calmStreak": 3}, "version is 2", id="newer-version"),
        pytest.param({"calmStreak": 3}, "version is None", id="no-version"),
        pytest.param({"version": True}, "version is True", id="bool-version"),
        pytest.param({"version": "1"}, "version is '1'", id="text-version"),
        pytest.param("calm", "is a str", id="not-an-object"),
        pytest.param([1, 2], "is a list", id="a-list"),
        pytest.param({"version": 1, "calmStreak": -1}, "status.policy.calmStreak", id="negative-streak"),
        pytest.param({"version": 1, "calmStreak": 10**9}, "status.policy.calmStreak", id="huge-streak"),
        pytest.param({"version": 1, "kvCapCeiling": "many"}, "status.policy.kvCapCeiling", id="text-ceiling"),
        pytest.param({"version": 1, "kvCapCeiling": 0}, "status.policy.kvCapCeiling", id="zero-ceiling"),
        pytest.param({"version": 1, "lastChangeTime": "yesterday"}, "lastChangeTime", id="bad-time"),
        pytest.param({"version": 1, "lastChangeTime": "2026-01-01T00:00:00"}, "no time zone", id="naive-time"),
        pytest.param({"version": 1, "stepCurve": [{"batchSize": 0, "stepSeconds": 0.1}]}, "stepCurve", id="bad-bucket"),
        pytest.param({"version": 1, "stepCurve": [{"batchSize": 4}]}, "stepCurve", id="half-a-point"),
        pytest.param({"version": 1, "stepCurve": [[4, 0.1]] * 3}, "stepCurve", id="pairs-not-points"),
        pytest.param(
            {"version": 1, "stepCurve": [{"batchSize": b, "stepSeconds": 0.1} for b in range(1, 40)]},
            "stepCurve",
            id="too-many-points",
        ),
        pytest.param({"version": 1, "surprise": 1}, "status.policy.surprise", id="unknown-field"),
    ],
)
def test_an_unknown_version_or_garbage_starts_fresh_and_says_why(policy: Any, problem: str) -> None:
    restored = restore({"policy": policy}, make_spec(), 3, NOW_S)
    assert restored.state == PolicyState()
    assert restored.problem is not None and problem in restored.problem


def test_memory_written_for_another_generation_is_carried_over() -> None:
    state = PolicyState(
        last_change_s=NOW_S - 10.0,
        headroom_streak=5,
        under_streak=6,
        calm_streak=7,
        itl_calm_streak=8,
        kv_cap_ceiling=24,
        budget_ceiling=512,
        step_curve=((1, 0.01), (8, 0.02)),
    )
    restored = restore(written(state, generation=1), make_spec(), 2, NOW_S)
    assert restored.carried_over and restored.problem is None
    assert restored.state == replace(state, headroom_streak=0, under_streak=0, itl_calm_streak=0)
    # An invalid spec has no bounds to carry over to: the memory is kept as written until a valid one comes.
    assert restore(written(state, generation=1), None, 2, NOW_S).state == state


@pytest.mark.parametrize(
    ("bounds", "kv_cap_ceiling", "budget_ceiling"),
    [
        pytest.param({}, 24, 512, id="within-the-bounds-kept"),
        pytest.param({"hardCap": {"min": 1, "max": 24}}, None, 512, id="at-the-new-cap-max-lifted"),
        pytest.param({"hardCap": {"min": 1, "max": 16}}, None, 512, id="above-the-new-cap-max-lifted"),
        pytest.param({"hardCap": {"min": 32, "max": 512}}, 32, 512, id="below-the-new-cap-min-raised"),
        pytest.param(
            {"hardCap": {"min": 16, "max": 512}, "targetBatchSize": {"min": 28, "max": 256}},
            28,
            512,
            id="below-the-target-min-raised",
        ),
        pytest.param({"maxPrefillTokens": {"min": 128, "max": 512}}, 24, None, id="budget-at-the-new-max-lifted"),
        pytest.param({"maxPrefillTokens": {"min": 1024, "max": 4096}}, 24, 1024, id="budget-below-the-new-min"),
    ],
)
def test_a_spec_change_clamps_the_ceilings_into_the_new_bounds(
    bounds: dict[str, Any], kv_cap_ceiling: int | None, budget_ceiling: int | None
) -> None:
    state = PolicyState(kv_cap_ceiling=24, budget_ceiling=512, calm_streak=9, step_curve=((4, 0.01),))
    cap_bounds = bounds.get("hardCap", {"min": 1, "max": 512})
    cap = max(cap_bounds["min"], min(32, cap_bounds["max"]))
    target = max(bounds.get("targetBatchSize", {"min": 1})["min"], min(8, cap))
    spec = factories.make_spec(
        window={"targetBatchSize": target, "hardCap": cap, "maxWaitMs": 40}, tuning={"bounds": bounds}
    )
    carried = carry_over(state, spec)
    assert (carried.kv_cap_ceiling, carried.budget_ceiling) == (kv_cap_ceiling, budget_ceiling)
    # Facts about the model's memory and step times stay.
    assert (carried.calm_streak, carried.step_curve) == (9, ((4, 0.01),))


def test_the_written_block_has_its_version_and_generation() -> None:
    block = written(PolicyState(last_change_s=1_767_225_600.25, kv_cap_ceiling=32), generation=7)["policy"]
    assert block == {
        "version": SCHEMA_VERSION,
        "observedGeneration": 7,
        "lastChangeTime": "2026-01-01T00:00:00.250000Z",
        "kvCapCeiling": 32,
        "calmStreak": 0,
        "itlCalmStreak": 0,
        "headroomStreak": 0,
        "underStreak": 0,
        "stepCurve": [],
    }
