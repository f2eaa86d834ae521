"""The BatchProfile field reference in Markdown, generated from the CRD schema.

docs/reference.md embeds this output between markers (`make docs` rewrites it), and a test
fails when it drifts, so the reference cannot disagree with the models.
"""

from __future__ import annotations

from typing import Any

from batchpilot_operator.api.crd import openapi_schema

BEGIN_MARKER = "<!-- BEGIN GENERATED: batchprofile-reference -->"
END_MARKER = "<!-- END GENERATED: batchprofile-reference -->"


def _type_of(node: dict[str, Any]) -> str:
    kind = str(node.get("type", "object"))
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if kind == "array":
        return f"list of {_type_of(node['items'])}"
    if kind == "object" and "additionalProperties" in node:
        return f"map of {_type_of(node['additionalProperties'])}"
    return kind


def _bounds_of(node: dict[str, Any]) -> str:
    parts = []
    if "minimum" in node:
        parts.append((">" if node.get("exclusiveMinimum") else ">=") + f" {node['minimum']:g}")
    if "maximum" in node:
        parts.append((">" if node.get("exclusiveMaximum") is True else "<=") + f" {node['maximum']:g}")
    if "maxItems" in node:
        parts.append(f"at most {node['maxItems']} items")
    if "pattern" in node:
        parts.append(f"pattern `{_cell(node['pattern'])}`")
    return ", ".join(parts)


def _default_of(node: dict[str, Any]) -> str:
    if "default" not in node:
        return ""
    value = node["default"]
    if not value and isinstance(value, dict | list):
        return ""
    if isinstance(value, dict) and not any(isinstance(v, dict | list) for v in value.values()):
        # A flat object (a min..max range) fits in the cell; a nested one gives each field's default below.
        return "`{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}`"
    if isinstance(value, dict | list):
        return "each field's default below"
    return f"`{value}`"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def _rows(node: dict[str, Any], path: str, required: bool, out: list[str]) -> None:
    description = _cell(" ".join(str(node.get("description", "")).split()))
    out.append(
        f"| `{path}` | {_type_of(node)} | {'yes' if required else ''} | {_default_of(node)} | "
        f"{_bounds_of(node)} | {description} |"
    )
    for rule in node.get("x-kubernetes-validations", []):
        out.append(f"| | | | | rule | {_cell(rule['message'])} |")
    target = node["items"] if node.get("type") == "array" else node
    child_required = set(target.get("required", []))
    suffix = "[]" if node.get("type") == "array" else ""
    for name, child in target.get("properties", {}).items():
        _rows(child, f"{path}{suffix}.{name}", name in child_required, out)


def render_reference() -> str:
    schema = openapi_schema()
    lines = [
        "| field | type | required | default | bounds | description |",
        "|---|---|---|---|---|---|",
    ]
    for section in ("spec", "status"):
        node = schema["properties"][section]
        _rows(node, section, section in schema.get("required", []), lines)
    return "\n".join(lines) + "\n"
