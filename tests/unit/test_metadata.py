"""A BatchProfile's metadata is refused as kube-apiserver refuses it, with its messages, every problem at once."""

from __future__ import annotations

from typing import Any

import pytest

from batchpilot_operator.api.manifests import profile_manifest
from batchpilot_operator.api.metadata import ANNOTATIONS_MAX_BYTES, metadata_problems
from batchpilot_operator.api.profile import ProfileError, parse_manifest
from tests.support.factories import make_spec_dict

SUBDOMAIN = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    r"'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
LABEL = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
    "end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
QUALIFIED = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
    "character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
LABEL_VALUE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for "
    "validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


def manifest_with(metadata: Any) -> dict[str, Any]:
    manifest = profile_manifest("ml", "chat", make_spec_dict())
    manifest["metadata"] = metadata
    return manifest


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param({"name": "chat"}, id="name-only"),
        pytest.param({"name": "a" * 253, "namespace": "b" * 63}, id="longest-name-and-namespace"),
        pytest.param({"name": "chat.v2-1", "namespace": ""}, id="dotted-name-empty-namespace"),
        pytest.param(
            {
                "name": "chat",
                "labels": {"app.kubernetes.io/name": "chat", "Tier_1.x": "", "k": "My_Value.2"},
                "annotations": {"Example.COM/Owner": "anything at all: spaces, / and UPPER", "note": ""},
            },
            id="labels-and-annotations",
        ),
        pytest.param({"name": "chat", "labels": None, "annotations": None}, id="null-maps"),
    ],
)
def test_metadata_the_api_server_accepts_passes(metadata: dict[str, Any]) -> None:
    assert metadata_problems(metadata) == []
    namespace, name, _ = parse_manifest(manifest_with(metadata))
    assert (namespace, name) == (metadata.get("namespace") or "default", metadata["name"])


@pytest.mark.parametrize(
    ("metadata", "problems"),
    [
        pytest.param({"name": "Bad_Name!"}, [f'metadata.name: Invalid value: "Bad_Name!": {SUBDOMAIN}'], id="bad-name"),
        pytest.param(
            {"name": "a" * 1_000_000},
            [
                f'metadata.name: Invalid value: "{"a" * 64}..." (1000000 characters): must be no more than 253 characters'
            ],
            id="1mb-name",
        ),
        pytest.param(
            {"name": "-" * 254},
            [
                f'metadata.name: Invalid value: "{"-" * 64}..." (254 characters): must be no more than 253 characters',
                f'metadata.name: Invalid value: "{"-" * 64}..." (254 characters): {SUBDOMAIN}',
            ],
            id="long-and-bad-name",
        ),
        pytest.param({}, ["metadata.name: Required value: name is required"], id="no-name"),
        pytest.param(None, ["metadata.name: Required value: name is required"], id="null-metadata"),
        pytest.param({"name": 42}, ["metadata.name: must be a string, got a number"], id="number-name"),
        pytest.param(["name", "chat"], ["metadata: must be a mapping, got a list"], id="list-metadata"),
        pytest.param(
            {"name": "chat", "namespace": "Not A Namespace"},
            [f'metadata.namespace: Invalid value: "Not A Namespace": {LABEL}'],
            id="bad-namespace",
        ),
        pytest.param(
            {"name": "chat", "namespace": "n" * 64},
            [f'metadata.namespace: Invalid value: "{"n" * 64}": must be no more than 63 characters'],
            id="long-namespace",
        ),
        pytest.param(
            {"name": "chat", "labels": ["app=chat"]},
            ["metadata.labels: must be a map of string keys to string values, got a list"],
            id="labels-as-list",
        ),
        pytest.param(
            {"name": "chat", "labels": {"replicas": 3}},
            ['metadata.labels["replicas"]: must be a string, got a number'],
            id="label-value-not-a-string",
        ),
        pytest.param(
            {"name": "chat", "labels": {"Bad Key": "-bad-", "x/": "v", "/y": "v", "a/b/c": "v", "UP.com/k": "v"}},
            [
                f'metadata.labels: Invalid value: "Bad Key": name part {QUALIFIED}',
                f'metadata.labels: Invalid value: "-bad-": {LABEL_VALUE}',
                'metadata.labels: Invalid value: "x/": name part must be non-empty',
                'metadata.labels: Invalid value: "/y": prefix part must be non-empty',
                f'metadata.labels: Invalid value: "a/b/c": a qualified name {QUALIFIED} with an optional DNS '
                "subdomain prefix and '/' (e.g. 'example.com/MyName')",
                f'metadata.labels: Invalid value: "UP.com/k": prefix part {SUBDOMAIN}',
            ],
            id="bad-label-keys-and-value",
        ),
        pytest.param(
            {"name": "chat", "labels": {"k" * 64: "v" * 64}},
            [
                f'metadata.labels: Invalid value: "{"k" * 64}": name part must be no more than 63 characters',
                f'metadata.labels: Invalid value: "{"v" * 64}": must be no more than 63 characters',
            ],
            id="long-label-key-and-value",
        ),
        pytest.param(
            {"name": "chat", "annotations": {"big": "x" * (ANNOTATIONS_MAX_BYTES - 2)}},
            ["metadata.annotations: Too long: must have at most 262144 bytes"],
            id="annotations-over-256KiB",
        ),
        pytest.param(
            {"name": "chat", "annotations": {"-note": "v"}},
            [f'metadata.annotations: Invalid value: "-note": name part {QUALIFIED}'],
            id="bad-annotation-key",
        ),
        pytest.param(
            {"name": "Bad", "namespace": "Bad", "labels": {"-": "v"}, "annotations": "text"},
            [
                f'metadata.name: Invalid value: "Bad": {SUBDOMAIN}',
                f'metadata.namespace: Invalid value: "Bad": {LABEL}',
                f'metadata.labels: Invalid value: "-": name part {QUALIFIED}',
                "metadata.annotations: must be a map of string keys to string values, got a string",
            ],
            id="every-field-at-once",
        ),
    ],
)
def test_metadata_the_api_server_refuses_is_refused_naming_each_problem(metadata: Any, problems: list[str]) -> None:
    assert metadata_problems(metadata) == problems
    with pytest.raises(ProfileError) as caught:
        parse_manifest(manifest_with(metadata))
    assert caught.value.problems == problems


def test_annotations_count_keys_and_values_in_utf8_bytes_up_to_256_kib() -> None:
    too_long = ["metadata.annotations: Too long: must have at most 262144 bytes"]
    exact = {"big": "x" * (ANNOTATIONS_MAX_BYTES - 3)}  # the key's 3 bytes count too
    one_more = {"big": "x" * (ANNOTATIONS_MAX_BYTES - 2)}
    wide = {"big": "é" * ((ANNOTATIONS_MAX_BYTES - 3) // 2 + 1)}  # 131,071 characters, 262,142 bytes
    assert metadata_problems({"name": "chat", "annotations": exact}) == []
    assert metadata_problems({"name": "chat", "annotations": one_more}) == too_long
    assert metadata_problems({"name": "chat", "annotations": wide}) == too_long


def test_metadata_and_spec_problems_are_reported_together() -> None:
    manifest = profile_manifest("Not A Namespace", "Bad_Name!", make_spec_dict(slo={"p99Ms": -1}))
    with pytest.raises(ProfileError) as caught:
        parse_manifest(manifest)
    assert caught.value.problems == [
        f'metadata.name: Invalid value: "Bad_Name!": {SUBDOMAIN}',
        f'metadata.namespace: Invalid value: "Not A Namespace": {LABEL}',
        "spec.slo.p99Ms: Input should be greater than 0",
    ]
