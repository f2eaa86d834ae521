"""The BatchProfile's spec: its fields, the rules between them (as CEL rules for the API server
and as checks here), and the starting window it implies.

Part of the BatchProfile models (``batchpilot_operator.api.profile`` re-exports them, and parses
specs into :class:`BatchProfileSpec`).
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, JsonValue, PrivateAttr, model_validator

from batchpilot_operator.api.bounds import WindowBounds
from batchpilot_operator.api.canary import CANARY_RULE, canary_problems
from batchpilot_operator.api.endpoint import RuntimeEndpoint
from batchpilot_operator.api.first_window import first_window
from batchpilot_operator.api.kinds import (
    CLASS_CAP_CEILING,
    EngineKind,
    Friendliness,
    LatencyMetric,
    TuningMode,
    default_mode,
)
from batchpilot_operator.api.restart import RestartBudget
from batchpilot_operator.api.selector import LabelSelector
from batchpilot_operator.api.slo import SLO, Tuning
from batchpilot_operator.api.step_costs import StepCosts
from batchpilot_runtime.contract.window import MAX_BATCH_SIZE, CamelModel, WindowFields


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
    """The first window of a profile without one (:mod:`batchpilot_operator.api.first_window`)."""
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
