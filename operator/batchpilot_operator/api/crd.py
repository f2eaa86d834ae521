"""Generate the BatchProfile CustomResourceDefinition from the pydantic models.

The output is a structural schema (every node typed; no ``$ref``, ``anyOf``,
``oneOf`` or ``allOf``), with the models' descriptions, defaults, bounds and
``x-kubernetes-validations`` CEL rules, a status subresource and printer
columns. ``crds/`` and the chart's ``crds/`` hold this output verbatim; a test
fails when they drift.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from batchpilot_operator import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.api.status import BatchProfileStatus

CRD_NAME = f"{PLURAL}.{GROUP}"

# Lists whose items are identified by a key, so that server-side apply merges them.
_LIST_MAP_KEYS = {"lanes": "name", "conditions": "type"}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
    {
        "name": "Target",
        "type": "integer",
        "jsonPath": ".status.window.targetBatchSize",
        "description": "targetBatchSize in force",
    },
    {"name": "Cap", "type": "integer", "jsonPath": ".status.window.hardCap", "description": "hardCap in force"},
    {"name": "Wait", "type": "integer", "jsonPath": ".status.window.maxWaitMs", "description": "maxWaitMs in force"},
    {"name": "P99", "type": "number", "jsonPath": ".status.observed.p99Ms", "description": "observed P99, ms"},
    {"name": "SLO", "type": "number", "jsonPath": ".spec.slo.p99Ms", "description": "P99 target, ms"},
    {"name": "Synced", "type": "string", "jsonPath": ".status.pods.summary", "description": "synced/ready pods"},
    {"name": "Mode", "type": "string", "jsonPath": ".status.mode", "description": "tuning mode in force"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


class SchemaError(RuntimeError):
    """The models produced a schema construct that a structural CRD schema cannot hold."""


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a model, as Kubernetes wants it."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs, model, field_name=None)


def _structural(
    node: dict[str, Any], defs: dict[str, Any], model: type[BaseModel] | None, field_name: str | None
) -> dict[str, Any]:
    node = copy.deepcopy(node)
    if "$ref" in node:
        ref_name = node.pop("$ref").rsplit("/", 1)[-1]
        merged = {**copy.deepcopy(defs[ref_name]), **node}
        return _structural(merged, defs, None, field_name)
    for combinator in ("anyOf", "oneOf"):
        if combinator in node:
            options = [opt for opt in node.pop(combinator) if opt.get("type") != "null"]
            if len(options) != 1:
                raise SchemaError(f"{field_name}: a union of {len(options)} types is not structural")
            merged = {**options[0], **node}
            return _structural(merged, defs, None, field_name)
    if "allOf" in node:
        parts = node.pop("allOf")
        if len(parts) != 1:
            raise SchemaError(f"{field_name}: allOf of {len(parts)} schemas is not structural")
        return _structural({**parts[0], **node}, defs, None, field_name)

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "additionalProperties", "$defs"):
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020 writes the bound itself; OpenAPI v3.0 wants minimum + a flag.
            bound_key = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound_key] = value
            out[key] = True
            continue
        out[key] = value

    if node.get("type") == "object" or "properties" in node:
        out["type"] = "object"
        props = node.get("properties")
        if props:
            out["properties"] = {name: _structural(sub, defs, None, name) for name, sub in props.items()}
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and not props:
            out["additionalProperties"] = _structural(extra, defs, None, field_name)
    if node.get("type") == "array":
        out["items"] = _structural(node["items"], defs, None, field_name)
        if field_name in _LIST_MAP_KEYS:
            out["x-kubernetes-list-type"] = "map"
            out["x-kubernetes-list-map-keys"] = [_LIST_MAP_KEYS[field_name]]
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "default" in out and out["default"] is None:
        del out["default"]
    if "type" not in out:
        raise SchemaError(f"{field_name}: schema node has no type: {node}")
    return out


def _fill_factory_defaults(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Give fields built by ``default_factory`` their default in the schema.

    pydantic leaves those out; without them, the API server would not default
    nested objects such as ``tuning.bounds``, and the CEL rules that read them
    would see absent fields.
    """
    props = schema.get("properties", {})
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in props:
            continue
        annotation = field.annotation
        if field.default_factory is not None:
            value = field.default_factory()  # type: ignore[call-arg]
            if isinstance(value, BaseModel):
                props[key]["default"] = value.model_dump(by_alias=True, mode="json", exclude_none=True)
            else:
                props[key]["default"] = value
        sub_model = _model_of(annotation)
        if sub_model is not None:
            target = props[key]
            if target.get("type") == "array":
                target = target["items"]
            _fill_factory_defaults(target, sub_model)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _with_defaults(model: type[BaseModel]) -> dict[str, Any]:
    schema = model_schema(model)
    _fill_factory_defaults(schema, model)
    return schema


def openapi_schema() -> dict[str, Any]:
    """The whole object schema of a BatchProfile (apiVersion, kind, metadata, spec, status)."""
    spec = _with_defaults(BatchProfileSpec)
    spec["description"] = "Desired batching behaviour of one model."
    status = _with_defaults(BatchProfileStatus)
    status["description"] = "What the operator observed, decided and pushed."
    return {
        "type": "object",
        "description": (
            "BatchProfile keeps one model's batching window (target batch size, hard cap, maximum "
            "wait, tail-marking ratio) tuned to its live load and latency SLO."
        ),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def custom_resource_definition() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "batchpilot", "app.kubernetes.io/part-of": "batchpilot"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["batchpilot"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


HEADER = "# Generated by `batchpilot-operator crd` from batchpilot_operator.api.profile. Do not edit.\n"


def render_crd() -> str:
    return HEADER + yaml.safe_dump(custom_resource_definition(), sort_keys=False, width=100)
