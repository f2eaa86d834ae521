"""Validate custom objects the way the API server would: defaulting, the structural
schema (OpenAPI v3.0 ~ JSON Schema draft 4), then every ``x-kubernetes-validations``
CEL rule, evaluated with cel-python on values typed by the schema."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema

_ENV = celpy.Environment()


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill absent properties that have a default, recursively."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and schema.get("type") == "array":
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def _typed(schema: dict[str, Any], value: Any) -> Any:
    """Coerce JSON numbers to the schema's type, as the API server's CEL sees them."""
    kind = schema.get("type")
    if kind == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind == "object" and isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        return {
            k: _typed(props[k], v) if k in props else (_typed(extra, v) if isinstance(extra, dict) else v)
            for k, v in value.items()
        }
    if kind == "array" and isinstance(value, list):
        return [_typed(schema["items"], item) for item in value]
    return value


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of the CEL rules this value breaks, each prefixed with its path."""
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = _ENV.program(_ENV.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(_typed(schema, value))})
        if isinstance(result, celpy.CELEvalError):
            errors.append(f"{path or '<root>'}: rule {rule['rule']!r} failed to evaluate: {result}")
        elif not bool(result):
            errors.append(f"{path or '<root>'}: {rule['message']}")
    if schema.get("type") == "object" and isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors.extend(cel_errors(sub, value[name], f"{path}.{name}" if path else name))
    elif schema.get("type") == "array" and isinstance(value, list):
        for i, item in enumerate(value):
            errors.extend(cel_errors(schema["items"], item, f"{path}[{i}]"))
    return errors


def schema_errors(schema: dict[str, Any], value: Any) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    ]


def validate_object(crd: dict[str, Any], obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Default then validate a custom object against a CRD; returns (defaulted object, errors)."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    defaulted = apply_defaults(schema, copy.deepcopy(obj))
    errors = schema_errors(schema, defaulted)
    if not errors:
        errors = cel_errors(schema, defaulted)
    return defaulted, errors
