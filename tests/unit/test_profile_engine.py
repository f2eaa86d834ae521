"""spec.engine: its default, the mode each engine defaults to, and the rule that a vLLM profile only
recommends, checked alike by the models and by the CRD's schema and CEL rules."""

from __future__ import annotations

from typing import Any

import pytest

from batchpilot_operator.api.crd import custom_resource_definition
from batchpilot_operator.api.profile import EngineKind, ProfileError, TuningMode, parse_spec
from tests.support.crd_validation import validate_object
from tests.support.factories import make_manifest, make_spec_dict

CRD = custom_resource_definition()


@pytest.mark.parametrize(
    ("engine", "mode"),
    [
        ("batchpilot", TuningMode.ADAPTIVE),
        ("sglang", TuningMode.ADAPTIVE),
        ("vllm", TuningMode.RECOMMEND),
        ("llamacpp", TuningMode.RECOMMEND),
    ],
)
def test_an_unset_mode_is_the_engines_default(engine: str, mode: TuningMode) -> None:
    spec = parse_spec(make_spec_dict(engine=engine, tuning=None))
    assert spec.engine == EngineKind(engine)
    assert spec.mode == mode
    defaulted, errors = validate_object(CRD, make_manifest(make_spec_dict(engine=engine, tuning=None)))
    assert errors == []
    assert "mode" not in defaulted["spec"]["tuning"]  # no schema default: the operator chooses by engine


def test_a_spec_without_engine_is_batchpilot_in_the_crd_too() -> None:
    defaulted, errors = validate_object(CRD, make_manifest(make_spec_dict()))
    assert errors == []
    assert defaulted["spec"]["engine"] == "batchpilot"


@pytest.mark.parametrize("mode", ["adaptive", "static"])
def test_a_vllm_profile_that_would_push_is_refused_by_both(mode: str) -> None:
    spec: dict[str, Any] = make_spec_dict(engine="vllm", tuning={"mode": mode})
    with pytest.raises(ProfileError) as refused:
        parse_spec(spec)
    assert "engine vllm supports only tuning.mode recommend" in str(refused.value)
    assert f"got tuning.mode {mode}" in str(refused.value)
    _, errors = validate_object(CRD, make_manifest(spec))
    assert errors == [
        "spec: engine vllm supports only tuning.mode recommend or restart (vLLM takes a window only at start-up)"
    ]


def test_a_vllm_profile_that_recommends_is_accepted_by_both() -> None:
    spec = make_spec_dict(engine="vllm", tuning={"mode": "recommend"})
    assert parse_spec(spec).mode == TuningMode.RECOMMEND
    assert validate_object(CRD, make_manifest(spec))[1] == []


@pytest.mark.parametrize("mode", ["adaptive", "static", "recommend", "restart"])
def test_a_llamacpp_profile_takes_every_mode_its_gate_and_restarts_allow(mode: str) -> None:
    """llamacpp's cap and wait move live through the gate in front of it; its flags by restarts."""
    restart = {"workload": {"kind": "Deployment", "name": "smol", "container": "engine"}}
    spec = make_spec_dict(
        engine="llamacpp", tuning={"mode": mode}, **({"restart": restart} if mode == "restart" else {})
    )
    parsed = parse_spec(spec)
    assert parsed.engine == EngineKind.LLAMACPP
    assert parsed.mode == TuningMode(mode)
    assert validate_object(CRD, make_manifest(spec))[1] == []


def test_an_unknown_engine_is_refused_naming_the_field() -> None:
    with pytest.raises(ProfileError) as refused:
        parse_spec(make_spec_dict(engine="tgi"))
    assert any(line.startswith("spec.engine:") for line in refused.value.problems), refused.value.problems
    assert validate_object(CRD, make_manifest(make_spec_dict(engine="tgi")))[1]


def test_a_bad_engine_and_a_bad_window_are_reported_together() -> None:
    spec = make_spec_dict(engine="vllm", tuning={"mode": "adaptive", "maxStepFraction": 0})
    with pytest.raises(ProfileError) as refused:
        parse_spec(spec)
    text = str(refused.value)
    assert "spec.tuning.maxStepFraction" in text
    assert "engine vllm supports only tuning.mode recommend" in text
