import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_operator.api.crd import custom_resource_definition, render_crd
from tests.support.crd_validation import cel_errors, validate_object
from tests.support.factories import make_manifest, make_spec_dict

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = [
    ROOT / "crds" / "batchpilot.dev_batchprofiles.yaml",
    ROOT / "charts" / "batchpilot" / "crds" / "batchpilot.dev_batchprofiles.yaml",
]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
CRD = custom_resource_definition()
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_crd_equals_a_fresh_generation(path: Path) -> None:
    assert path.read_text() == render_crd(), f"{path} is stale: run `make crds`"


def _walk(node: dict[str, Any], path: str) -> list[str]:
    problems = []
    for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "not", "$defs", "definitions"):
        if forbidden in node:
            problems.append(f"{path}: has {forbidden}")
    if "type" not in node and not node.get("x-kubernetes-int-or-string"):
        problems.append(f"{path}: has no type")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties and additionalProperties together")
    for name, child in node.get("properties", {}).items():
        problems.extend(_walk(child, f"{path}.{name}"))
    if node.get("type") == "array":
        if "items" not in node:
            problems.append(f"{path}: array without items")
        else:
            problems.extend(_walk(node["items"], f"{path}[]"))
    if isinstance(node.get("additionalProperties"), dict):
        problems.extend(_walk(node["additionalProperties"], f"{path}{{}}"))
    return problems


def test_schema_is_structural() -> None:
    assert _walk(SCHEMA, "") == []


def test_every_spec_field_has_a_description() -> None:
    missing = []

    def visit(node: dict[str, Any], path: str) -> None:
        for name, child in node.get("properties", {}).items():
            if not child.get("description") and path.startswith(".spec"):
                missing.append(f"{path}.{name}")
            visit(child.get("items", child), f"{path}.{name}")

    visit(SCHEMA, "")
    assert missing == []


def test_crd_shape() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "batchprofiles.batchpilot.dev"
    assert spec["names"]["shortNames"] == ["bp"]
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "Target", "Cap", "Wait", "P99", "SLO", "Synced", "Mode", "Age"]


def make_profile(**sections: Any) -> dict[str, Any]:
    """A minimal profile as a user writes it: the shared spec without a tuning section."""
    return make_manifest(make_spec_dict(**{"tuning": None, **sections}))


def test_target_above_cap_is_refused_by_cel_naming_both_fields() -> None:
    _, errors = validate_object(CRD, make_profile(window={"targetBatchSize": 16, "hardCap": 8, "maxWaitMs": 0}))
    assert len(errors) == 1
    assert "spec.window" in errors[0]
    assert "targetBatchSize" in errors[0]
    assert "hardCap" in errors[0]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"tuning": {"bounds": {"hardCap": {"min": 32, "max": 8}}}}, "spec.tuning.bounds.hardCap: min must be"),
        ({"tuning": {"bounds": {"tailMarkRatio": {"min": 3.0, "max": 2.0}}}}, "tailMarkRatio: min must be"),
        ({"tuning": {"bounds": {"targetBatchSize": {"min": 10, "max": 20}}}}, "window.targetBatchSize must lie within"),
        ({"tuning": {"bounds": {"maxWaitMs": {"min": 0, "max": 10}}}}, "window.maxWaitMs must lie within"),
        ({"slo": {"p99Ms": 800, "p999Ms": 500}}, "p999Ms must be greater"),
        ({"slo": {"latencyMetric": "ttft"}}, "slo needs at least one objective"),
        ({"slo": {"interTokenP99Ms": 50, "p999Ms": 900}}, "slo.p999Ms needs slo.p99Ms"),
        (
            {
                "lanes": [
                    {"name": "c", "reservedSlots": 20, "window": {"targetBatchSize": 1, "hardCap": 2, "maxWaitMs": 0}}
                ]
            },
            "reservedSlots must not exceed",
        ),
        (
            {"lanes": [{"name": "c", "window": {"targetBatchSize": 4, "hardCap": 2, "maxWaitMs": 0}}]},
            "spec.lanes[0].window: targetBatchSize must be less than or equal to hardCap",
        ),
    ],
)
def test_cross_field_rules_refuse(overrides: dict[str, Any], expected: str) -> None:
    _, errors = validate_object(CRD, make_profile(**overrides))
    assert any(expected in e for e in errors), errors


def test_an_slo_of_inter_token_latency_alone_is_accepted() -> None:
    _, errors = validate_object(CRD, make_profile(slo={"interTokenP99Ms": 50}))
    assert errors == []


def test_schema_bounds_refuse_before_cel() -> None:
    _, errors = validate_object(CRD, make_profile(window={"targetBatchSize": 0, "hardCap": 8, "maxWaitMs": 0}))
    assert any(e.startswith("spec.window.targetBatchSize") for e in errors), errors


def test_minimal_profile_is_defaulted_and_valid() -> None:
    defaulted, errors = validate_object(CRD, make_profile())
    assert errors == []
    assert defaulted["spec"]["tuning"]["bounds"]["hardCap"] == {"min": 1, "max": 512}
    assert defaulted["spec"]["window"]["tailMarkRatio"] == 2.0


def test_partial_bounds_are_defaulted_by_the_schema_as_by_the_models() -> None:
    from batchpilot_operator.api.profile import parse_spec

    partial = make_profile(tuning={"bounds": {"maxWaitMs": {"max": 2000}, "tailMarkRatio": {"min": 1.2}}})
    defaulted, errors = validate_object(CRD, partial)
    assert errors == []
    bounds = defaulted["spec"]["tuning"]["bounds"]
    assert bounds["maxWaitMs"] == {"min": 0, "max": 2000}
    assert bounds["tailMarkRatio"] == {"min": 1.2, "max": 4.0}
    parsed = parse_spec(partial["spec"]).tuning.bounds.model_dump(by_alias=True)
    assert parsed == bounds


def test_a_partial_range_below_its_default_end_is_refused_by_cel() -> None:
    _, errors = validate_object(CRD, make_profile(tuning={"bounds": {"maxPrefillTokens": {"max": 100}}}))
    assert errors == ["spec.tuning.bounds.maxPrefillTokens: min must be less than or equal to max"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_schema_and_cel(path: Path) -> None:
    _, errors = validate_object(CRD, yaml.safe_load(path.read_text()))
    assert errors == []


def test_every_rule_compiles_and_evaluates_on_a_valid_object() -> None:
    defaulted, _ = validate_object(
        CRD,
        make_profile(
            lanes=[
                {"name": "critical", "reservedSlots": 2, "window": {"targetBatchSize": 1, "hardCap": 2, "maxWaitMs": 0}}
            ]
        ),
    )
    status = {"window": {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 20, "tailMarkRatio": 2.0, "generation": 1}}
    obj = copy.deepcopy(defaulted)
    obj["status"] = status
    assert cel_errors(SCHEMA, obj) == []


def test_pydantic_and_cel_agree_on_the_examples_and_the_bad_cases() -> None:
    from batchpilot_operator.api.profile import ProfileError, parse_spec

    bad = make_profile(window={"targetBatchSize": 16, "hardCap": 8, "maxWaitMs": 0})
    _, errors = validate_object(CRD, bad)
    assert errors
    with pytest.raises(ProfileError):
        parse_spec(bad["spec"])
