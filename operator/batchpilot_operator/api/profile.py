"""The BatchProfile resource: its models, and parsing a spec or a whole manifest into them.

These pydantic models are the single source of truth for the resource. The
CRD's ``openAPIV3Schema`` (with its descriptions, defaults, bounds and CEL
rules) is generated from them by :mod:`batchpilot_operator.api.crd`, and the
operator parses every object it receives through them (:func:`parse_spec`,
:func:`parse_manifest`), so that a profile that slipped past the API server's
validation is still refused with the field named. The models live in modules
by subject and are re-exported here (the ``X as X`` imports), so they import
from either: the spec in :mod:`~batchpilot_operator.api.spec`, its enumerations
in :mod:`~batchpilot_operator.api.kinds`, the selector, the SLO and tuning, and
the runtime endpoint in :mod:`~batchpilot_operator.api.selector`,
:mod:`~batchpilot_operator.api.slo` and :mod:`~batchpilot_operator.api.endpoint`,
the ranges and ``WindowBounds`` in :mod:`~batchpilot_operator.api.bounds`.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from batchpilot_operator import API_VERSION, KIND
from batchpilot_operator.api.bounds import FloatRange as FloatRange
from batchpilot_operator.api.bounds import IntRange as IntRange
from batchpilot_operator.api.bounds import TokenRange as TokenRange
from batchpilot_operator.api.bounds import WindowBounds as WindowBounds
from batchpilot_operator.api.canary import Canary, canary_problems
from batchpilot_operator.api.endpoint import SECRET_KEY_PATTERN as SECRET_KEY_PATTERN
from batchpilot_operator.api.endpoint import SECRET_NAME_PATTERN as SECRET_NAME_PATTERN
from batchpilot_operator.api.endpoint import RuntimeEndpoint as RuntimeEndpoint
from batchpilot_operator.api.endpoint import SecretKeyRef as SecretKeyRef
from batchpilot_operator.api.kinds import RECOMMEND_BY_DEFAULT_ENGINES as RECOMMEND_BY_DEFAULT_ENGINES
from batchpilot_operator.api.kinds import RECOMMENDING as RECOMMENDING
from batchpilot_operator.api.kinds import EngineKind as EngineKind
from batchpilot_operator.api.kinds import Friendliness as Friendliness
from batchpilot_operator.api.kinds import LatencyMetric as LatencyMetric
from batchpilot_operator.api.kinds import TuningMode as TuningMode
from batchpilot_operator.api.kinds import default_mode as default_mode
from batchpilot_operator.api.metadata import metadata_problems
from batchpilot_operator.api.selector import SELECTOR_MESSAGE as SELECTOR_MESSAGE
from batchpilot_operator.api.selector import LabelSelector as LabelSelector
from batchpilot_operator.api.selector import LabelSelectorRequirement as LabelSelectorRequirement
from batchpilot_operator.api.slo import SLO as SLO
from batchpilot_operator.api.slo import Tuning as Tuning
from batchpilot_operator.api.spec import GATED_BUDGET_MESSAGE as GATED_BUDGET_MESSAGE
from batchpilot_operator.api.spec import RESTART_BUDGET_MESSAGE as RESTART_BUDGET_MESSAGE
from batchpilot_operator.api.spec import RESTART_ENGINE_MESSAGE as RESTART_ENGINE_MESSAGE
from batchpilot_operator.api.spec import VLLM_MODE_MESSAGE as VLLM_MODE_MESSAGE
from batchpilot_operator.api.spec import WINDOW_OR_COSTS_MESSAGE as WINDOW_OR_COSTS_MESSAGE
from batchpilot_operator.api.spec import BatchProfileSpec as BatchProfileSpec
from batchpilot_operator.api.spec import Lane as Lane
from batchpilot_operator.api.spec import cross_field_problems as cross_field_problems
from batchpilot_operator.api.spec import derived_window as derived_window
from batchpilot_operator.api.spec import engine_mode_problems as engine_mode_problems
from batchpilot_operator.api.spec import gated_budget_problems as gated_budget_problems
from batchpilot_runtime.contract.window import CamelModel, WindowFields, target_within_cap_problem

_E = TypeVar("_E", bound=StrEnum)


class ProfileError(ValueError):
    """A BatchProfile that does not validate; ``problems`` names every bad field, one line each."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


def validation_problems(error: ValidationError, prefix: str = "") -> list[str]:
    """One line per problem, each naming the field by its path as written in YAML."""
    return _problem_lines(error.errors(), prefix)


def field_path(prefix: str, loc: Sequence[int | str]) -> str:
    """A field's path as kube-apiserver and kubectl write it: ``spec.lanes[0].window.hardCap``."""
    path = prefix
    for part in loc:
        path = f"{path}[{part}]" if isinstance(part, int) else ".".join(p for p in (path, part) if p)
    return path


def _problem_lines(errors: list[ErrorDetails], prefix: str) -> list[str]:
    lines = []
    for problem in errors:
        where = field_path(prefix, problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {message}" if where else message)
    return lines


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """:func:`validation_problems` on one line."""
    return "; ".join(validation_problems(error, prefix))


def _part(model: type[CamelModel], value: Any) -> Any:
    """``value`` validated as ``model``, or None when it does not validate (its errors are reported anyway)."""
    try:
        return model.model_validate(value)
    except ValidationError:
        return None


def _parts_cross_field_problems(spec: dict[str, Any]) -> list[str]:
    """The cross-field rules checked on the parts of a spec that validate on their own."""
    window = _part(WindowFields, spec["window"]) if "window" in spec else None
    tuning = spec.get("tuning", {})
    # The bounds alone: a bad tuning field beside them does not hide what they refuse.
    bounds = _part(WindowBounds, tuning.get("bounds", {})) if isinstance(tuning, dict) else None
    raw_lanes = spec.get("lanes", [])
    parsed_lanes = [_part(Lane, raw) for raw in raw_lanes] if isinstance(raw_lanes, list) else []
    problems = cross_field_problems(window, bounds, [lane for lane in parsed_lanes if lane is not None])
    if "window" not in spec and spec.get("stepCosts") is None:
        problems.append(WINDOW_OR_COSTS_MESSAGE)
    if window is None or bounds is None:
        raw_bounds = tuning.get("bounds", {}) if isinstance(tuning, dict) else None
        problems = _raw_window_bounds_problems(spec.get("window"), raw_bounds) + problems
    engine = _enum_part(EngineKind, spec.get("engine", EngineKind.BATCHPILOT.value))
    mode = _enum_part(TuningMode, tuning.get("mode")) if isinstance(tuning, dict) else None
    slo = spec.get("slo")
    moves_budget = (isinstance(slo, dict) and slo.get("interTokenP99Ms") is not None) or (
        isinstance(spec.get("window"), dict) and spec["window"].get("maxPrefillTokens") is not None
    )
    return (
        problems
        + engine_mode_problems(engine, mode, has_restart=isinstance(spec.get("restart"), dict))
        + gated_budget_problems(engine, mode, moves_budget=moves_budget)
    )


def _raw_window_bounds_problems(window: Any, bounds: Any) -> list[str]:
    """window.X outside tuning.bounds.X, read from the raw values (an end left out takes its default), for
    a window or bounds that did not validate: kube-apiserver evaluates its CEL rule on them anyway, so a
    negative maxWaitMs or a reversed range is reported there beside the field error, and here too."""
    if not isinstance(window, dict) or not isinstance(bounds, dict):
        return []
    outside, ranges = [], []
    window_defaults = {str(f.alias): f.default for f in WindowFields.model_fields.values()}
    for field in WindowBounds.model_fields.values():
        alias = str(field.alias)
        value, given, range_model = (
            window.get(alias, window_defaults.get(alias)),
            bounds.get(alias, {}),
            field.annotation,
        )
        if not _is_number(value) or not isinstance(given, dict) or not isinstance(range_model, type):
            continue
        low = given.get("min", range_model.model_fields["min"].default)
        high = given.get("max", range_model.model_fields["max"].default)
        if _is_number(low) and _is_number(high) and not low <= value <= high:
            outside.append(alias)
            ranges.append(f"{alias} bounds are {low:g}..{high:g}")
    if not outside:
        return []
    names = ", ".join(f"window.{name}" for name in outside)
    return [f"{names} must lie within tuning.bounds ({'; '.join(ranges)})"]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _enum_part(enum: type[_E], value: Any) -> _E | None:
    """``value`` as a member of ``enum``, or None when it is not one (its field error is reported anyway)."""
    try:
        return enum(value)
    except ValueError:
        return None


def parse_spec(spec: Any) -> BatchProfileSpec:
    """Validate a spec mapping; raise :class:`ProfileError` naming every field that is wrong.

    pydantic checks the rules between fields only once every field is valid; here they are
    checked on the parts that are, so one run reports field and cross-field errors together.
    """
    try:
        return BatchProfileSpec.model_validate(spec)
    except ValidationError as error:
        if not isinstance(spec, dict):
            raise ProfileError(validation_problems(error, "spec")) from None
        # The spec-level rule errors (at the spec itself) are replaced by the per-part check.
        field_errors = [e for e in error.errors() if e["loc"] or e["type"] != "value_error"]
        lines = _problem_lines(field_errors, "spec")
        lines.extend(_unchecked_window_rules(spec))
        lines.extend(f"spec: {problem}" for problem in _parts_cross_field_problems(spec))
        lines.extend(f"spec: {problem}" for problem in _parts_canary_problems(spec))
        # A rule the parts cannot check alone (the lanes against a derived window's cap) says it itself.
        raise ProfileError(list(dict.fromkeys(lines)) or _problem_lines(error.errors(), "spec")) from None


def _unchecked_window_rules(spec: dict[str, Any]) -> list[str]:
    """The window's rule between fields, for each window (spec.window, spec.lanes[i].window) whose own field
    errors kept pydantic from checking it; kube-apiserver checks the CEL rule beside those errors."""
    windows: list[tuple[str, Any]] = [("spec.window", spec.get("window"))]
    lanes = spec.get("lanes")
    if isinstance(lanes, list):
        windows += [
            (f"spec.lanes[{i}].window", lane.get("window")) for i, lane in enumerate(lanes) if isinstance(lane, dict)
        ]
    problems = []
    for where, raw in windows:
        if not isinstance(raw, dict):
            continue
        target, cap = raw.get("targetBatchSize"), raw.get("hardCap")
        if type(target) is int and type(cap) is int:
            problem = target_within_cap_problem(target, cap)
            if problem:
                problems.append(f"{where}: {problem}")
    return problems


def _parts_canary_problems(spec: dict[str, Any]) -> list[str]:
    """The canary's rule on the parts that validate: tuning.canary, spec.engine and the mode in force."""
    tuning = spec.get("tuning", {})
    canary = _part(Canary, tuning.get("canary", {})) if isinstance(tuning, dict) else None
    engine = _enum_part(EngineKind, spec.get("engine", EngineKind.BATCHPILOT.value))
    if canary is None or engine is None:
        return []
    mode = _enum_part(TuningMode, tuning.get("mode")) if "mode" in tuning else default_mode(engine)
    return canary_problems(canary, engine.value, mode.value) if mode is not None else []


def parse_manifest(manifest: Any) -> tuple[str, str, BatchProfileSpec]:
    """Validate a whole BatchProfile manifest; return (namespace, name, spec).

    The metadata is checked as kube-apiserver checks it, and its problems and the spec's are
    raised together in one :class:`ProfileError`.
    """
    if not isinstance(manifest, dict):
        raise ProfileError("a BatchProfile must be a mapping")
    if manifest.get("apiVersion") != API_VERSION or manifest.get("kind") != KIND:
        raise ProfileError(
            f"apiVersion/kind must be {API_VERSION}/{KIND}, got {manifest.get('apiVersion')}/{manifest.get('kind')}"
        )
    metadata: Any = manifest.get("metadata")
    problems = metadata_problems(metadata)
    try:
        spec = parse_spec(manifest.get("spec"))
    except ProfileError as error:
        problems.extend(error.problems)
    if problems:
        raise ProfileError(problems)
    # metadata_problems passed: a mapping with a valid name, and a namespace that is a label or empty.
    return metadata.get("namespace") or "default", metadata["name"], spec
