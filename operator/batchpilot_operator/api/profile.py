"""The BatchProfile resource: spec and status models.

These pydantic models are the single source of truth for the resource. The
CRD's ``openAPIV3Schema`` (with its descriptions, defaults, bounds and CEL
rules) is generated from them by :mod:`batchpilot_operator.api.crd`, and the
operator parses every object it receives through them, so that a profile that
slipped past the API server's validation is still refused with the field named.
The ranges and ``WindowBounds`` live in :mod:`batchpilot_operator.api.bounds`
and are re-exported here (the ``X as X`` imports), so they import from either.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Literal, TypeVar

from pydantic import ConfigDict, Field, JsonValue, PrivateAttr, ValidationError, model_validator
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from batchpilot_operator import API_VERSION, KIND
from batchpilot_operator.api.bounds import FloatRange as FloatRange
from batchpilot_operator.api.bounds import IntRange as IntRange
from batchpilot_operator.api.bounds import TokenRange as TokenRange
from batchpilot_operator.api.bounds import WindowBounds as WindowBounds
from batchpilot_operator.api.bounds import cel_rules
from batchpilot_operator.api.canary import CANARY_RULE, Canary, canary_problems
from batchpilot_operator.api.metadata import metadata_problems
from batchpilot_operator.api.restart import RestartBudget
from batchpilot_operator.api.step_costs import StepCosts
from batchpilot_runtime.contract.admin_api import DEFAULT_ADMIN_PORT, DEFAULT_SERVE_PORT
from batchpilot_runtime.contract.window import (
    MAX_BATCH_SIZE,
    CamelModel,
    WindowFields,
    target_within_cap_problem,
)

_E = TypeVar("_E", bound=StrEnum)


class Friendliness(StrEnum):
    """How much a model gains from larger batches."""

    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"
    AUTO = "auto"


class LatencyMetric(StrEnum):
    TTFT = "ttft"
    QUEUE_WAIT = "queueWait"
    E2E = "e2e"


class TuningMode(StrEnum):
    ADAPTIVE = "adaptive"
    RECOMMEND = "recommend"
    STATIC = "static"
    RESTART = "restart"  # restart-only engines: patch the workload's args within spec.restart's budget


# Modes whose window in force is not the policy's: it only recommends (and in restart mode, the restart
# path applies the recommendation when the budget allows).
RECOMMENDING = (TuningMode.RECOMMEND, TuningMode.RESTART)


class EngineKind(StrEnum):
    """The serving engine of a profile's pods: whose metric names the operator reads, and how a window
    reaches the engine (live through an admin API, or only by a restart with new flags)."""

    BATCHPILOT = "batchpilot"
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"  # llama.cpp's llama-server behind batchpilot-gate


# Engines a profile only recommends for unless it asks for more: vLLM, whose knobs need a restart, and
# llama-server, whose --parallel and --batch-size need one too (its cap and wait can still move live
# through the gate in front of it, in tuning.mode adaptive or static).
RECOMMEND_BY_DEFAULT_ENGINES = frozenset({EngineKind.VLLM, EngineKind.LLAMACPP})


def default_mode(engine: EngineKind) -> TuningMode:
    """The mode of a profile that names none: recommend where applying a window costs a restart."""
    return TuningMode.RECOMMEND if engine in RECOMMEND_BY_DEFAULT_ENGINES else TuningMode.ADAPTIVE


class LabelSelectorRequirement(CamelModel):
    key: str = Field(min_length=1, max_length=317, description="Label key the requirement applies to.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the key's value is matched against values.",
    )
    values: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Values for In and NotIn; empty for Exists and DoesNotExist.",
    )


SELECTOR_MESSAGE = "selector must have matchLabels or matchExpressions (an empty selector matches every pod)"


class LabelSelector(CamelModel):
    """A Kubernetes label selector (matchLabels and matchExpressions are ANDed)."""

    model_config = cel_rules(
        (
            "(has(self.matchLabels) && size(self.matchLabels) > 0)"
            " || (has(self.matchExpressions) && size(self.matchExpressions) > 0)",
            SELECTOR_MESSAGE,
        )
    )

    match_labels: dict[str, str] = Field(
        default_factory=dict, description="Labels a pod must carry with exactly these values."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=16, description="Set-based requirements on pod labels."
    )

    @model_validator(mode="after")
    def _not_empty(self) -> LabelSelector:
        if not self.match_labels and not self.match_expressions:
            raise ValueError(SELECTOR_MESSAGE)
        return self

    def matches(self, labels: dict[str, str]) -> bool:
        """True when a pod with these labels is selected."""
        for key, value in self.match_labels.items():
            if labels.get(key) != value:
                return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator == "In" and (not present or labels[req.key] not in req.values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


class SLO(CamelModel):
    """The latency objectives the operator keeps the window under: a first-token (or queue-wait,
    or end-to-end) P99, an inter-token P99, or both at once."""

    model_config = cel_rules(
        (
            "has(self.p99Ms) || has(self.interTokenP99Ms)",
            "slo needs at least one objective: p99Ms or interTokenP99Ms",
        ),
        ("!has(self.p999Ms) || has(self.p99Ms)", "slo.p999Ms needs slo.p99Ms"),
        (
            "!has(self.p999Ms) || !has(self.p99Ms) || self.p999Ms >= self.p99Ms",
            "slo.p999Ms must be greater than or equal to slo.p99Ms",
        ),
    )

    latency_metric: LatencyMetric = Field(
        default=LatencyMetric.TTFT,
        description="Which latency p99Ms and p999Ms bound: ttft (time to first token), queueWait, or e2e (whole request).",
    )
    p99_ms: float | None = Field(
        default=None,
        gt=0,
        le=3_600_000,
        description="Target 99th-percentile latency in milliseconds (of latencyMetric).",
    )
    p999_ms: float | None = Field(
        default=None,
        gt=0,
        le=3_600_000,
        description="Optional target 99.9th-percentile latency in milliseconds; needs p99Ms.",
    )
    inter_token_p99_ms: float | None = Field(
        default=None,
        gt=0,
        le=60_000,
        description=(
            "Target 99th-percentile inter-token latency in milliseconds (the gap between two streamed "
            "tokens of one request), alone or together with p99Ms. With it the operator tunes "
            "window.maxPrefillTokens, the lever that trades first tokens against inter-token gaps."
        ),
    )

    @model_validator(mode="after")
    def _objectives(self) -> SLO:
        if self.p99_ms is None and self.inter_token_p99_ms is None:
            raise ValueError("slo needs at least one objective: p99Ms or interTokenP99Ms")
        if self.p999_ms is not None:
            if self.p99_ms is None:
                raise ValueError("slo.p999Ms needs slo.p99Ms")
            if self.p999_ms < self.p99_ms:
                raise ValueError(
                    f"slo.p999Ms ({self.p999_ms:g}) must be greater than or equal to slo.p99Ms ({self.p99_ms:g})"
                )
        return self


class Tuning(CamelModel):
    """How the operator tunes the window."""

    mode: TuningMode | None = Field(
        default=None,
        description=(
            "adaptive: retune and push; recommend: compute and report in status but never push; "
            "static: push spec.window as it is; restart (vllm, sglang, llamacpp): patch the workload's args "
            "with the recommendation and let it roll, within spec.restart's budget. Unset: adaptive, or "
            "recommend for vllm and llamacpp (their knobs are start-up flags); never restart."
        ),
    )
    interval_seconds: int = Field(
        default=15, ge=5, le=3600, description="Seconds between two observations and decisions."
    )
    bounds: WindowBounds = Field(default_factory=WindowBounds, description="Limits of each window field.")
    max_step_fraction: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="Largest relative change of any window field in one decision (0.5 = at most +/-50 %).",
    )
    cooldown_seconds: int = Field(default=30, ge=0, le=3600, description="Least time between two window changes.")
    canary: Canary = Field(
        default_factory=Canary,
        description="Canary retunes: a new window runs on a share of the pods first (docs/canary.md).",
    )


class Lane(CamelModel):
    """A named priority lane with its own small window and reserved running slots."""

    name: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="Lane name requests select (body field 'lane' or header X-Batchpilot-Lane).",
    )
    window: WindowFields = Field(description="This lane's window.")
    reserved_slots: int = Field(
        default=0, ge=0, le=MAX_BATCH_SIZE, description="Running slots held back for this lane's requests."
    )


# A Secret's name is a DNS subdomain and its keys are [-._a-zA-Z0-9]+, as the API server requires; the name
# pattern also keeps a name from being a path ("../other-namespace/secrets/x") when it goes into a URL.
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


class SecretKeyRef(CamelModel):
    """A key of a Secret in the profile's own namespace: there is no field for another namespace, and a
    ``namespace`` given anyway is refused here (the API server refuses or prunes it: it is not in the schema)."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=SECRET_NAME_PATTERN,
        description="Secret name, in the profile's namespace (a Secret of another namespace cannot be named).",
    )
    key: str = Field(
        default="token", min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN, description="Key within the Secret."
    )

    @model_validator(mode="before")
    @classmethod
    def _own_namespace_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and "namespace" in data:
            # An error at the field itself (spec.runtime.adminTokenSecret.namespace), as the API server names it.
            problem = PydanticCustomError(
                "value_error",
                "{namespace} is not allowed: a profile may name only a Secret of its own namespace; leave "
                "namespace out",
                {"namespace": repr(data["namespace"])},
            )
            raise ValidationError.from_exception_data(
                cls.__name__, [InitErrorDetails(type=problem, loc=("namespace",), input=data["namespace"])]
            )
        return data


class RuntimeEndpoint(CamelModel):
    """How the operator reaches the runtime pods' admin API."""

    admin_port: int = Field(default=DEFAULT_ADMIN_PORT, ge=1, le=65535, description="Port of the runtime's admin API.")
    serve_port: int = Field(
        default=DEFAULT_SERVE_PORT, ge=1, le=65535, description="Port of the runtime's serving API and /metrics."
    )
    admin_token_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret with the admin bearer token; the operator's own token is used when unset.",
    )


# vLLM takes max_num_seqs and max_num_batched_tokens only as start-up flags: a vLLM profile recommends, or
# restarts its workload with new flags under spec.restart's budget.
VLLM_MODE_MESSAGE = "engine vllm supports only tuning.mode recommend or restart (vLLM takes a window only at start-up)"
RESTART_ENGINE_MESSAGE = "tuning.mode restart is for engine vllm, sglang or llamacpp (batchpilot takes a window live)"
RESTART_BUDGET_MESSAGE = "tuning.mode restart needs spec.restart (the workload and its restart budget)"
WINDOW_OR_COSTS_MESSAGE = (
    "spec.window may be left out only when spec.stepCosts is given (the first window is then derived from them "
    "and the SLO)"
)
# Live, a llama-server's window goes through batchpilot-gate, which bounds running requests but not prompt
# tokens per step; the budget reaches llama-server only as --batch-size, by a restart.
GATED_BUDGET_MESSAGE = (
    "engine llamacpp in tuning.mode adaptive or static cannot take slo.interTokenP99Ms or window.maxPrefillTokens: "
    "they move the per-step prompt budget, which batchpilot-gate cannot bound; use tuning.mode recommend or "
    "restart (the budget becomes --batch-size)"
)

_BATCH_PROFILE_RULES: list[JsonValue] = [
    {"rule": "has(self.window) || has(self.stepCosts)", "message": WINDOW_OR_COSTS_MESSAGE},
    {
        "rule": "!has(self.window) || (self.window.targetBatchSize >= self.tuning.bounds.targetBatchSize.min && "
        "self.window.targetBatchSize <= self.tuning.bounds.targetBatchSize.max)",
        "message": "window.targetBatchSize must lie within tuning.bounds.targetBatchSize",
    },
    {
        "rule": "!has(self.window) || (self.window.hardCap >= self.tuning.bounds.hardCap.min && "
        "self.window.hardCap <= self.tuning.bounds.hardCap.max)",
        "message": "window.hardCap must lie within tuning.bounds.hardCap",
    },
    {
        "rule": "!has(self.window) || (self.window.maxWaitMs >= self.tuning.bounds.maxWaitMs.min && "
        "self.window.maxWaitMs <= self.tuning.bounds.maxWaitMs.max)",
        "message": "window.maxWaitMs must lie within tuning.bounds.maxWaitMs",
    },
    {
        "rule": "!has(self.window) || (self.window.tailMarkRatio >= self.tuning.bounds.tailMarkRatio.min && "
        "self.window.tailMarkRatio <= self.tuning.bounds.tailMarkRatio.max)",
        "message": "window.tailMarkRatio must lie within tuning.bounds.tailMarkRatio",
    },
    {
        "rule": "!has(self.window) || !has(self.window.maxPrefillTokens) || "
        "(self.window.maxPrefillTokens >= self.tuning.bounds.maxPrefillTokens.min && "
        "self.window.maxPrefillTokens <= self.tuning.bounds.maxPrefillTokens.max)",
        "message": "window.maxPrefillTokens must lie within tuning.bounds.maxPrefillTokens",
    },
    {
        "rule": "!has(self.window) || !has(self.lanes) || self.lanes.all(l, l.reservedSlots <= self.window.hardCap)",
        "message": "lanes[].reservedSlots must not exceed window.hardCap",
    },
    {
        "rule": "!has(self.engine) || self.engine != 'vllm' || !has(self.tuning) || !has(self.tuning.mode) || "
        "self.tuning.mode == 'recommend' || self.tuning.mode == 'restart'",
        "message": VLLM_MODE_MESSAGE,
    },
    {
        "rule": "!has(self.tuning) || !has(self.tuning.mode) || self.tuning.mode != 'restart' || "
        "(has(self.engine) && self.engine != 'batchpilot')",
        "message": RESTART_ENGINE_MESSAGE,
    },
    {
        "rule": "!has(self.tuning) || !has(self.tuning.mode) || self.tuning.mode != 'restart' || has(self.restart)",
        "message": RESTART_BUDGET_MESSAGE,
    },
    {
        "rule": "!has(self.engine) || self.engine != 'llamacpp' || !has(self.tuning) || !has(self.tuning.mode) || "
        "self.tuning.mode == 'recommend' || self.tuning.mode == 'restart' || "
        "(!has(self.slo.interTokenP99Ms) && (!has(self.window) || !has(self.window.maxPrefillTokens)))",
        "message": GATED_BUDGET_MESSAGE,
    },
    CANARY_RULE,
]


class BatchProfileSpec(CamelModel):
    """Desired batching behaviour of one model."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _BATCH_PROFILE_RULES})

    model: str = Field(
        min_length=1,
        max_length=253,
        description=(
            "Model name, as the engine reports it in its metrics: the 'model' label of batchpilot's, "
            "the 'model_name' label (the served model name) of vLLM's and SGLang's; for llamacpp the gate's "
            "--model-name (llama-server's own metrics carry no label: the scrape gives them this one)."
        ),
    )
    engine: EngineKind = Field(
        default=EngineKind.BATCHPILOT,
        description=(
            "The serving engine of the selected pods: batchpilot (this project's runtime; windows applied "
            "live through its admin API), vllm (metrics read as vllm:*; windows recommended, or applied by "
            "restarting the workload in tuning.mode restart, since vLLM takes them only at start-up), sglang "
            "(metrics read as sglang:*; the cap and the prefill budget applied live through POST "
            "/set_internal_state where the server accepts them) or llamacpp (llama.cpp's llama-server behind "
            "batchpilot-gate: llamacpp:* and the gate's latency read; recommended by default, the cap and wait "
            "pushed to the gate's admin API in adaptive or static mode, --parallel and --batch-size written "
            "into the workload's args in tuning.mode restart)."
        ),
    )
    selector: LabelSelector = Field(
        description="Label selector of the runtime pods serving this model (same namespace)."
    )
    batch_friendliness: Friendliness = Field(
        default=Friendliness.AUTO,
        description=(
            "How much the model gains from larger batches: high, medium, low, or auto (measured from "
            "the runtime's step time per batch size). Sets how far the operator may raise the cap."
        ),
    )
    given_window: WindowFields | None = Field(
        default=None,
        alias="window",
        description=(
            "The starting window, and the only one in static mode. May be left out when stepCosts is given: "
            "the first window is then derived from the step costs and the SLO (docs/policy.md)."
        ),
    )
    step_costs: StepCosts | None = Field(
        default=None,
        description=(
            "What one engine step costs on this profile's device, as batchpilot-runtime calibrate measures it. "
            "Used only to derive the first window of a profile that gives no window."
        ),
    )
    slo: SLO = Field(description="Latency objective.")
    tuning: Tuning = Field(default_factory=Tuning, description="How the operator tunes the window.")
    lanes: list[Lane] = Field(
        default_factory=list, max_length=8, description="Named priority lanes beside the default (bulk) lane."
    )
    runtime: RuntimeEndpoint = Field(
        default_factory=RuntimeEndpoint, description="How the operator reaches the runtime pods."
    )
    restart: RestartBudget | None = Field(
        default=None,
        description=(
            "tuning.mode restart: the workload whose container args carry the engine's flags, and how often "
            "the operator may restart it (docs/engines.md)."
        ),
    )

    _window: WindowFields = PrivateAttr()

    @model_validator(mode="after")
    def _cross_field(self) -> BatchProfileSpec:
        if self.given_window is not None:
            self._window = self.given_window
        elif self.step_costs is not None:
            self._window = derived_window(self)
        else:
            raise ValueError(WINDOW_OR_COSTS_MESSAGE)
        problems = cross_field_problems(self.window, self.tuning.bounds, self.lanes)
        problems.extend(engine_mode_problems(self.engine, self.tuning.mode, has_restart=self.restart is not None))
        moves_budget = self.slo.inter_token_p99_ms is not None or self.window.max_prefill_tokens is not None
        problems.extend(gated_budget_problems(self.engine, self.tuning.mode, moves_budget=moves_budget))
        problems.extend(canary_problems(self.tuning.canary, self.engine.value, self.mode.value))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def window(self) -> WindowFields:
        """The starting window: spec.window, or the one derived from spec.stepCosts and the SLO."""
        return self._window

    @property
    def window_source(self) -> str:
        """Where the starting window comes from, in words (validate and status.startingWindow say it)."""
        if self.given_window is not None:
            return "spec.window"
        costs = self.step_costs
        assert costs is not None  # a profile with neither does not validate
        source = f", {costs.source}" if costs.source else ""
        return (
            f"derived from spec.stepCosts (fixed {costs.fixed_ms:g} ms, {costs.prefill_us_per_token:g} us per prompt "
            f"token{source}) and the SLO"
        )

    @property
    def mode(self) -> TuningMode:
        """The tuning mode in force: tuning.mode, or the engine's default when it is unset."""
        return self.tuning.mode or default_mode(self.engine)


def derived_window(spec: BatchProfileSpec) -> WindowFields:
    """The first window of a profile without one (:mod:`batchpilot_operator.tuning.first_window`)."""
    # Imported here: the tuning package reads these models, so it cannot be imported at load time.
    from batchpilot_operator.tuning.first_window import first_window
    from batchpilot_operator.tuning.friendliness import CLASS_CAP_CEILING

    assert spec.step_costs is not None
    friendliness = Friendliness.MEDIUM if spec.batch_friendliness == Friendliness.AUTO else spec.batch_friendliness
    first_token = spec.slo.p99_ms if spec.slo.latency_metric == LatencyMetric.TTFT else None
    return first_window(
        spec.step_costs,
        spec.tuning.bounds,
        CLASS_CAP_CEILING[friendliness],
        inter_token_ms=spec.slo.inter_token_p99_ms,
        first_token_ms=first_token,
    )


def engine_mode_problems(engine: EngineKind | None, mode: TuningMode | None, *, has_restart: bool) -> list[str]:
    """The rules between spec.engine, spec.tuning.mode and spec.restart, as the CRD's CEL rules state them."""
    problems = []
    if engine == EngineKind.VLLM and mode not in (None, TuningMode.RECOMMEND, TuningMode.RESTART):
        problems.append(f"{VLLM_MODE_MESSAGE}; got tuning.mode {mode.value if mode else mode}")
    if mode == TuningMode.RESTART and engine == EngineKind.BATCHPILOT:
        problems.append(RESTART_ENGINE_MESSAGE)
    if mode == TuningMode.RESTART and not has_restart:
        problems.append(RESTART_BUDGET_MESSAGE)
    return problems


def gated_budget_problems(engine: EngineKind | None, mode: TuningMode | None, *, moves_budget: bool) -> list[str]:
    """A llama-server profile tuned live (through the gate) that asks for a per-step prompt budget."""
    live = mode in (TuningMode.ADAPTIVE, TuningMode.STATIC)
    return [GATED_BUDGET_MESSAGE] if engine == EngineKind.LLAMACPP and live and moves_budget else []


def cross_field_problems(window: WindowFields | None, bounds: WindowBounds | None, lanes: list[Lane]) -> list[str]:
    """Every rule between the window, the bounds and the lanes that these parts break, one line each.

    A part that did not validate on its own is None (or left out of ``lanes``), and the rules
    that need it are skipped, so that a profile's field errors and cross-field errors are all
    reported at once rather than one pass at a time.
    """
    problems = []
    if window is not None and bounds is not None:
        outside = bounds.fields_outside(window)
        if outside:
            names = ", ".join(f"window.{name}" for name in outside)
            problems.append(f"{names} must lie within tuning.bounds ({'; '.join(bounds.ranges_text(outside))})")
    first_index: dict[str, int] = {}
    for index, lane in enumerate(lanes):
        if lane.name in first_index:
            problems.append(
                f"lanes[{index}].name {lane.name!r} repeats lanes[{first_index[lane.name]}].name; lane names must be unique"
            )
        first_index.setdefault(lane.name, index)
    if window is not None:
        problems.extend(
            f"lanes[{lane.name}].reservedSlots ({lane.reserved_slots}) must not exceed window.hardCap ({window.hard_cap})"
            for lane in lanes
            if lane.reserved_slots > window.hard_cap
        )
    return list(dict.fromkeys(problems))  # two lanes of one name may break a rule alike


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
