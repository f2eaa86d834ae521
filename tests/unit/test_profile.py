from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_operator.api.profile import BatchProfileSpec, ProfileError, parse_manifest, parse_spec
from tests.support.factories import make_spec_dict

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.yaml"))


def test_defaults_fill_a_minimal_spec() -> None:
    spec = parse_spec(make_spec_dict(tuning=None))
    assert spec.mode.value == "adaptive"
    assert spec.tuning.mode is None  # unset: the engine's default applies
    assert spec.engine.value == "batchpilot"
    assert spec.tuning.interval_seconds == 15
    assert spec.window.tail_mark_ratio == 2.0
    assert spec.batch_friendliness.value == "auto"
    assert spec.slo.latency_metric.value == "ttft"
    assert spec.lanes == []


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (
            {"window": {"targetBatchSize": 16, "hardCap": 8, "maxWaitMs": 0}},
            ["spec.window", "targetBatchSize", "hardCap"],
        ),
        ({"window": {"targetBatchSize": 0, "hardCap": 8, "maxWaitMs": 0}}, ["spec.window.targetBatchSize"]),
        ({"slo": {"p99Ms": -5}}, ["spec.slo.p99Ms"]),
        ({"slo": {"p99Ms": 800, "p999Ms": 400}}, ["slo.p999Ms", "slo.p99Ms"]),
        ({"slo": {"latencyMetric": "ttft"}}, ["slo needs at least one objective", "p99Ms", "interTokenP99Ms"]),
        ({"slo": {"interTokenP99Ms": 40, "p999Ms": 900}}, ["slo.p999Ms needs slo.p99Ms"]),
        ({"slo": {"p99Ms": 800, "latencyMetric": "tpot"}}, ["spec.slo.latencyMetric"]),
        ({"batchFriendliness": "extreme"}, ["spec.batchFriendliness"]),
        ({"selector": {}}, ["spec.selector"]),
        ({"tuning": {"bounds": {"hardCap": {"min": 32, "max": 8}}}}, ["spec.tuning.bounds.hardCap", "min", "max"]),
        (
            {"tuning": {"bounds": {"targetBatchSize": {"min": 10, "max": 20}}}},
            ["window.targetBatchSize", "tuning.bounds"],
        ),
        ({"tuning": {"maxStepFraction": 0}}, ["spec.tuning.maxStepFraction"]),
        ({"tuning": {"mode": "auto"}}, ["spec.tuning.mode"]),
        (
            {"lanes": [{"name": "Critical!", "window": {"targetBatchSize": 1, "hardCap": 2, "maxWaitMs": 0}}]},
            ["spec.lanes[0].name"],
        ),
        (
            {
                "lanes": [
                    {"name": "c", "reservedSlots": 99, "window": {"targetBatchSize": 1, "hardCap": 2, "maxWaitMs": 0}}
                ]
            },
            ["reservedSlots", "window.hardCap"],
        ),
        (
            {"lanes": [{"name": "c", "window": {"targetBatchSize": 1, "hardCap": 2, "maxWaitMs": 0}}] * 2},
            ["spec: lanes[1].name 'c' repeats lanes[0].name"],
        ),
        ({"windw": {}}, ["spec.windw"]),
    ],
)
def test_bad_specs_name_the_field(overrides: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ProfileError) as caught:
        parse_spec(make_spec_dict(**overrides))
    for name in names:
        assert name in str(caught.value)


def test_partial_bounds_take_the_other_end_from_the_defaults() -> None:
    spec = parse_spec(make_spec_dict(tuning={"bounds": {"maxWaitMs": {"max": 2000}, "hardCap": {"min": 4}}}))
    assert (spec.tuning.bounds.max_wait_ms.min, spec.tuning.bounds.max_wait_ms.max) == (0, 2000)
    assert (spec.tuning.bounds.hard_cap.min, spec.tuning.bounds.hard_cap.max) == (4, 512)
    assert (spec.tuning.bounds.target_batch_size.min, spec.tuning.bounds.target_batch_size.max) == (1, 256)


def test_a_partial_range_below_its_default_end_says_which_end_was_defaulted() -> None:
    with pytest.raises(ProfileError) as caught:
        parse_spec(make_spec_dict(tuning={"bounds": {"maxPrefillTokens": {"max": 100}}}))
    assert caught.value.problems == [
        "spec.tuning.bounds.maxPrefillTokens: min (128, the default) must be less than or equal to max (100); "
        "give both ends"
    ]


def test_field_and_cross_field_errors_come_together() -> None:
    lane = {"name": "c", "reservedSlots": 32, "window": {"targetBatchSize": 1, "hardCap": 2, "maxWaitMs": 0}}
    with pytest.raises(ProfileError) as caught:
        parse_spec(
            make_spec_dict(
                window={"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 20},
                tuning={"bounds": {"hardCap": {"max": 8}}, "cooldownSeconds": -1},
                lanes=[lane, lane],
            )
        )
    assert caught.value.problems == [
        "spec.tuning.cooldownSeconds: Input should be greater than or equal to 0",
        "spec: window.hardCap must lie within tuning.bounds (hardCap bounds are 1..8)",
        "spec: lanes[1].name 'c' repeats lanes[0].name; lane names must be unique",
        "spec: lanes[c].reservedSlots (32) must not exceed window.hardCap (16)",
    ]


def test_a_windows_rule_is_checked_beside_its_field_errors_as_the_api_server_does() -> None:
    # pydantic skips WindowFields' rule once a field of it fails; kube-apiserver evaluates the CEL rule anyway.
    window = {"targetBatchSize": 16, "hardCap": 8, "maxWaitMs": -5, "tailMarkRatio": 0.5}
    lane = {"name": "c", "window": {"targetBatchSize": 4, "hardCap": 2, "maxWaitMs": -1}}
    with pytest.raises(ProfileError) as caught:
        parse_spec(make_spec_dict(window=window, lanes=[lane]))
    assert caught.value.problems == [
        "spec.window.maxWaitMs: Input should be greater than or equal to 0",
        "spec.window.tailMarkRatio: Input should be greater than 1",
        "spec.lanes[0].window.maxWaitMs: Input should be greater than or equal to 0",
        "spec.window: targetBatchSize (16) must be less than or equal to hardCap (8)",
        "spec.lanes[0].window: targetBatchSize (4) must be less than or equal to hardCap (2)",
        "spec: window.maxWaitMs, window.tailMarkRatio must lie within tuning.bounds (maxWaitMs bounds are 0..500; "
        "tailMarkRatio bounds are 1.5..4)",
    ]


def test_missing_required_fields_are_named() -> None:
    with pytest.raises(ProfileError) as caught:
        parse_spec({"model": "m"})
    message = str(caught.value)
    for name in ("spec.selector", "spec.window", "spec.slo"):
        assert name in message


def test_spec_that_is_not_a_mapping_is_refused_cleanly() -> None:
    with pytest.raises(ProfileError, match="spec"):
        parse_spec("just a string")


def test_manifest_needs_kind_and_name() -> None:
    with pytest.raises(ProfileError, match="apiVersion/kind"):
        parse_manifest({"apiVersion": "v1", "kind": "Pod"})
    with pytest.raises(ProfileError, match=r"metadata\.name"):
        parse_manifest({"apiVersion": "batchpilot.dev/v1alpha1", "kind": "BatchProfile", "spec": make_spec_dict()})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path: Path) -> None:
    namespace, name, spec = parse_manifest(yaml.safe_load(path.read_text()))
    assert isinstance(spec, BatchProfileSpec)
    assert name and namespace


def test_there_are_the_three_required_examples() -> None:
    specs = [parse_manifest(yaml.safe_load(p.read_text()))[2] for p in EXAMPLES]
    chat = [s for s in specs if s.slo.latency_metric.value == "ttft" and s.slo.p99_ms == 800]
    assert chat and 16 <= chat[0].window.target_batch_size <= chat[0].window.hard_cap <= 32
    offline = [s for s in specs if s.window.target_batch_size >= 128]
    assert offline and offline[0].window.hard_cap <= 256
    assert any(lane.name == "critical" for s in specs for lane in s.lanes)


def test_label_selector_matching() -> None:
    spec = parse_spec(
        make_spec_dict(
            selector={
                "matchLabels": {"app": "m"},
                "matchExpressions": [
                    {"key": "tier", "operator": "In", "values": ["gpu", "cpu"]},
                    {"key": "canary", "operator": "DoesNotExist"},
                ],
            }
        )
    )
    assert spec.selector.matches({"app": "m", "tier": "gpu"})
    assert not spec.selector.matches({"app": "m", "tier": "tpu"})
    assert not spec.selector.matches({"app": "m", "tier": "gpu", "canary": "yes"})
    assert not spec.selector.matches({"tier": "gpu"})
