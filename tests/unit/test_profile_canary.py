"""spec.tuning.canary, checked alike by the models and by the CRD's schema and CEL rules, and
status.canary as an operator restarted mid-canary reports it."""

from __future__ import annotations

from typing import Any

import pytest

from batchpilot_operator.api.crd import custom_resource_definition
from batchpilot_operator.api.profile import ProfileError, parse_spec
from batchpilot_operator.control.facts import canary_status
from batchpilot_operator.control.records import ProfileRecord, ProfileRef
from tests.support.crd_validation import validate_object
from tests.support.factories import make_manifest, make_spec_dict, make_window_dict

CRD = custom_resource_definition()


def test_canaries_are_off_by_default_with_a_quarter_share_and_three_intervals_in_both() -> None:
    canary = parse_spec(make_spec_dict()).tuning.canary
    assert (canary.enabled, canary.share, canary.intervals) == (False, 0.25, 3)
    defaulted, errors = validate_object(CRD, make_manifest(make_spec_dict()))
    assert errors == []
    assert defaulted["spec"]["tuning"]["canary"] == {"enabled": False, "share": 0.25, "intervals": 3}


def test_an_enabled_canary_on_an_adaptive_batchpilot_profile_is_accepted_by_both() -> None:
    spec = make_spec_dict(tuning={"canary": {"enabled": True, "share": 0.5, "intervals": 5}})
    assert parse_spec(spec).tuning.canary.intervals == 5
    assert validate_object(CRD, make_manifest(spec))[1] == []


@pytest.mark.parametrize(
    ("engine", "mode"), [("batchpilot", "static"), ("batchpilot", "recommend"), ("sglang", None), ("vllm", None)]
)
def test_a_canary_where_nothing_is_pushed_live_is_refused_by_both(engine: str, mode: str | None) -> None:
    tuning: dict[str, Any] = {"canary": {"enabled": True}, **({"mode": mode} if mode else {})}
    spec = make_spec_dict(engine=engine, tuning=tuning)
    with pytest.raises(ProfileError) as refused:
        parse_spec(spec)
    assert "tuning.canary.enabled needs engine batchpilot and tuning.mode adaptive" in str(refused.value)
    assert f"got engine {engine}" in str(refused.value)
    _, errors = validate_object(CRD, make_manifest(spec))
    assert errors == ["spec: tuning.canary.enabled needs engine batchpilot and tuning.mode adaptive (or unset)"]


@pytest.mark.parametrize(("field", "value"), [("share", 0.05), ("share", 0.6), ("intervals", 0), ("intervals", 21)])
def test_out_of_range_canary_fields_are_refused_naming_them(field: str, value: float) -> None:
    spec = make_spec_dict(tuning={"canary": {"enabled": True, field: value}})
    with pytest.raises(ProfileError) as refused:
        parse_spec(spec)
    assert f"spec.tuning.canary.{field}" in str(refused.value)
    assert validate_object(CRD, make_manifest(spec))[1] != []


def record_with_status(canary: dict[str, Any]) -> ProfileRecord:
    record = ProfileRecord(ref=ProfileRef("ml", "chat"), generation=1, spec=parse_spec(make_spec_dict()), error=None)
    record.status.written = {"canary": canary}
    return record


def test_a_canary_an_earlier_operator_left_running_is_reported_rolled_back() -> None:
    written = {
        "window": make_window_dict(cap=24, generation=3),
        "pods": ["chat-1"],
        "startedAt": "2026-12-01T20:00:00Z",
        "verdict": "running",
        "reason": "passed 1 of 3 intervals",
    }
    status = canary_status(record_with_status(written))
    assert status is not None and status.verdict == "rolledBack"
    assert status.reason.startswith("the operator restarted during this canary")
    finished = canary_status(record_with_status({**written, "verdict": "promoted"}))
    assert finished is not None and finished.verdict == "promoted"  # kept as it was written
    assert canary_status(record_with_status({"verdict": "running"})) is None  # not a canary status
