"""spec.restart and tuning.mode restart, checked alike by the models and by the CRD's schema and CEL rules."""

from __future__ import annotations

from typing import Any

import pytest

from batchpilot_operator.api.crd import custom_resource_definition
from batchpilot_operator.api.profile import ProfileError, TuningMode, parse_spec
from tests.support.crd_validation import validate_object
from tests.support.factories import make_manifest, make_spec_dict

CRD = custom_resource_definition()
WORKLOAD = {"kind": "Deployment", "name": "chat", "container": "vllm"}


def restart_spec(engine: str = "vllm", **restart: Any) -> dict[str, Any]:
    return make_spec_dict(engine=engine, tuning={"mode": "restart"}, restart={"workload": WORKLOAD, **restart})


def both_errors(spec: dict[str, Any]) -> tuple[str, list[str]]:
    with pytest.raises(ProfileError) as refused:
        parse_spec(spec)
    return str(refused.value), validate_object(CRD, make_manifest(spec))[1]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_restart_mode_with_a_budget_is_accepted_with_its_defaults(engine: str) -> None:
    spec = parse_spec(restart_spec(engine))
    assert spec.mode == TuningMode.RESTART
    assert spec.restart is not None
    assert (spec.restart.max_per_day, spec.restart.min_interval_seconds) == (2, 3600)
    assert (spec.restart.min_change, spec.restart.stable_intervals, spec.restart.allowed_hours) == (0.25, 3, None)
    defaulted, errors = validate_object(CRD, make_manifest(restart_spec(engine)))
    assert errors == []
    assert defaulted["spec"]["restart"]["maxPerDay"] == 2


def test_restart_is_never_the_default_mode() -> None:
    spec = parse_spec(make_spec_dict(engine="vllm", tuning=None, restart={"workload": WORKLOAD}))
    assert spec.mode == TuningMode.RECOMMEND  # a budget alone restarts nothing


def test_restart_mode_without_a_budget_is_refused_by_both() -> None:
    text, errors = both_errors(make_spec_dict(engine="vllm", tuning={"mode": "restart"}))
    assert "tuning.mode restart needs spec.restart" in text
    assert errors == ["spec: tuning.mode restart needs spec.restart (the workload and its restart budget)"]


def test_restart_mode_on_the_batchpilot_runtime_is_refused_by_both() -> None:
    text, errors = both_errors(restart_spec("batchpilot"))
    assert "tuning.mode restart is for engine vllm, sglang or llamacpp" in text
    assert errors == [
        "spec: tuning.mode restart is for engine vllm, sglang or llamacpp (batchpilot takes a window live)"
    ]


def test_allowed_hours_must_be_a_window() -> None:
    spec = parse_spec(restart_spec(allowedHours={"start": "22:00", "end": "04:30"}))
    assert spec.restart is not None and spec.restart.allowed_hours is not None
    assert spec.restart.allowed_hours.minutes() == (1320, 270)
    text, errors = both_errors(restart_spec(allowedHours={"start": "03:00", "end": "03:00"}))
    assert "start and end must differ" in text
    assert errors == ["spec.restart.allowedHours: restart.allowedHours: start and end must differ"]
    text, errors = both_errors(restart_spec(allowedHours={"start": "24:00", "end": "03:00"}))
    assert "spec.restart.allowedHours.start" in text and errors


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("maxPerDay", 0, "spec.restart.maxPerDay"),
        ("maxPerDay", 25, "spec.restart.maxPerDay"),
        ("minIntervalSeconds", 60, "spec.restart.minIntervalSeconds"),
        ("minChange", 0.01, "spec.restart.minChange"),
        ("workload", {"kind": "DaemonSet", "name": "chat", "container": "vllm"}, "spec.restart.workload.kind"),
        ("workload", {"kind": "Deployment", "name": "Chat!", "container": "vllm"}, "spec.restart.workload.name"),
    ],
)
def test_bad_budget_fields_are_named_by_both(field: str, value: Any, where: str) -> None:
    text, errors = both_errors(restart_spec(**{field: value}))
    assert where in text
    assert errors


GATED_BUDGET = (
    "engine llamacpp in tuning.mode adaptive or static cannot take slo.interTokenP99Ms or window.maxPrefillTokens: "
    "they move the per-step prompt budget, which batchpilot-gate cannot bound; use tuning.mode recommend or "
    "restart (the budget becomes --batch-size)"
)
BUDGET_ASKS: dict[str, dict[str, Any]] = {
    "inter-token objective": {"slo": {"p99Ms": 500, "interTokenP99Ms": 50}},
    "prompt budget": {"window": {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 40, "maxPrefillTokens": 256}},
}


@pytest.mark.parametrize("mode", ["adaptive", "static"])
@pytest.mark.parametrize("asks", sorted(BUDGET_ASKS))
def test_a_llamacpp_profile_tuned_through_the_gate_cannot_ask_for_a_prompt_budget(mode: str, asks: str) -> None:
    # The gate refuses a window with maxPrefillTokens (422): such a profile would never be in sync.
    text, errors = both_errors(make_spec_dict(engine="llamacpp", tuning={"mode": mode}, **BUDGET_ASKS[asks]))
    assert GATED_BUDGET in text
    assert errors == [f"spec: {GATED_BUDGET}"]


@pytest.mark.parametrize("asks", sorted(BUDGET_ASKS))
def test_a_llamacpp_profile_that_restarts_or_recommends_may_ask_for_a_prompt_budget(asks: str) -> None:
    recommending = make_spec_dict(engine="llamacpp", tuning=None, **BUDGET_ASKS[asks])
    restarting = make_spec_dict(
        engine="llamacpp", tuning={"mode": "restart"}, restart={"workload": WORKLOAD}, **BUDGET_ASKS[asks]
    )
    for spec in (recommending, restarting):
        parse_spec(spec)
        assert validate_object(CRD, make_manifest(spec))[1] == []
