"""Warnings for settings of a valid profile that the tuning policy never uses (``validate``)."""

from typing import Any

import pytest

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.tuning.config import PolicyConfig
from batchpilot_operator.tuning.unused import unused_settings
from tests.support.factories import make_spec


def profile(**sections: Any) -> BatchProfileSpec:
    """The shared spec with no tuning section and a P99 of 800 ms, a tenth of which (80 ms) is the
    longest wait the policy chooses."""
    return make_spec(**{"slo": {"p99Ms": 800}, "tuning": None, **sections})


def warnings_of(**sections: Any) -> list[str]:
    return unused_settings(profile(**sections))


def test_a_plain_profile_and_the_defaults_warn_of_nothing() -> None:
    # The default bounds (hardCap up to 512, wait up to 500 ms) are wider than the policy uses
    # for many SLOs; only what the user wrote is warned about.
    assert warnings_of() == []
    assert (
        warnings_of(
            batchFriendliness="low", slo={"p99Ms": 100}, window={"targetBatchSize": 1, "hardCap": 8, "maxWaitMs": 10}
        )
        == []
    )


def test_a_wait_above_a_tenth_of_the_slo_is_named_with_the_limit() -> None:
    assert warnings_of(window={"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 81}) == [
        "window.maxWaitMs (81) is above what the policy ever chooses (0.1 x slo.p99Ms = 80 ms): "
        "it holds only until a retune lowers it"
    ]
    assert warnings_of(window={"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 80}) == []


def test_the_share_is_the_policys_own() -> None:
    spec = profile(window={"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 100})
    assert unused_settings(spec, PolicyConfig(wait_slo_fraction=0.125)) == []
    assert len(unused_settings(spec, PolicyConfig(wait_slo_fraction=0.1))) == 1


def test_a_lower_bound_above_the_share_wins_over_it() -> None:
    # The policy's wait is never below the bound: a window at the bound is not warned about.
    bounds = {"maxWaitMs": {"min": 100, "max": 100}}
    assert warnings_of(window={"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 100}, tuning={"bounds": bounds}) == []


def test_a_wait_bound_above_the_share_is_named() -> None:
    assert warnings_of(tuning={"bounds": {"maxWaitMs": {"max": 1000}}}) == [
        "tuning.bounds.maxWaitMs.max (1000) is above what the policy ever chooses (0.1 x slo.p99Ms = 80 ms)"
    ]


def test_no_wait_warning_without_a_first_token_objective() -> None:
    assert warnings_of(slo={"interTokenP99Ms": 50}, tuning={"bounds": {"maxWaitMs": {"max": 1000}}}) == []


@pytest.mark.parametrize(("friendliness", "ceiling"), [("low", 32), ("medium", 128)])
def test_a_cap_bound_above_the_class_ceiling_is_named(friendliness: str, ceiling: int) -> None:
    assert warnings_of(batchFriendliness=friendliness, tuning={"bounds": {"hardCap": {"max": 1024}}}) == [
        f"tuning.bounds.hardCap.max (1024) is above {ceiling}, the most the policy raises the cap to for "
        f"batchFriendliness {friendliness}"
    ]


def test_a_measured_class_has_no_ceiling_to_warn_of() -> None:
    assert warnings_of(batchFriendliness="auto", tuning={"bounds": {"hardCap": {"max": 1024}}}) == []


def test_a_target_bound_above_the_cap_bound_is_named() -> None:
    bounds = {"targetBatchSize": {"max": 64}, "hardCap": {"max": 32}}
    assert warnings_of(tuning={"bounds": bounds}) == [
        "tuning.bounds.targetBatchSize.max (64) is above tuning.bounds.hardCap.max (32): "
        "the target never exceeds the cap"
    ]


def test_prefill_bounds_without_an_inter_token_objective_are_named() -> None:
    bounds = {"maxPrefillTokens": {"min": 256, "max": 4096}}
    assert warnings_of(tuning={"bounds": bounds}) == [
        "tuning.bounds.maxPrefillTokens is never used without slo.interTokenP99Ms: "
        "the policy moves the prefill budget only for an inter-token objective"
    ]
    assert warnings_of(slo={"p99Ms": 800, "interTokenP99Ms": 50}, tuning={"bounds": bounds}) == []


def test_static_mode_names_its_bounds_and_nothing_else() -> None:
    tuning = {"mode": "static", "bounds": {"maxWaitMs": {"max": 1000}}}
    window = {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 300}
    assert warnings_of(window=window, tuning=tuning) == [
        "tuning.bounds is never used in static mode: the operator pushes spec.window as it is"
    ]
    assert warnings_of(window=window, tuning={"mode": "static"}) == []
