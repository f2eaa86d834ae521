"""The demo's results: the models of the report JSON, and the static-vs-adaptive comparison.

The JSON written beside the HTML report is :class:`DemoReport` dumped as it is, and the
HTML is rendered from a :class:`DemoReport` read back, so that every number in the page is
one of the JSON's. Figures are rounded to a few significant digits when they are made
(:func:`round_figure`), so the page can print them exactly as stored.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Mode = Literal["static", "adaptive"]
MODES: tuple[Mode, Mode] = ("static", "adaptive")
SIGNIFICANT_DIGITS = 4


def round_figure(value: float | None, digits: int = SIGNIFICANT_DIGITS) -> float | None:
    """``value`` to ``digits`` significant digits; None for unknown (None, NaN, infinite)."""
    if value is None or not math.isfinite(value):
        return None
    if value == 0:
        return 0.0
    return float(f"{value:.{digits}g}")


def format_figure(value: float | int | None) -> str:
    """How the report prints a figure: exactly the stored number (already rounded), or '—' when unknown."""
    if value is None:
        return "—"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:g}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WindowSnapshot(_Model):
    """The window's fields as the runtime reported them (gauges)."""

    target_batch_size: int
    hard_cap: int
    max_wait_ms: float
    generation: int
    max_prefill_tokens: int | None = None  # the prompt-token budget per step; None: whole prompts

    def describe(self) -> str:
        text = f"target {self.target_batch_size}, cap {self.hard_cap}, wait {format_figure(self.max_wait_ms)} ms"
        return text if self.max_prefill_tokens is None else f"{text}, budget {self.max_prefill_tokens} tokens"


class Histogram(_Model):
    """Per-bucket counts over one phase: ``counts[i]`` observations in (bound[i-1], bound[i]],
    and one last count above the top bound."""

    upper_bounds: list[float]
    counts: list[float]

    @property
    def total(self) -> float:
        return float(sum(self.counts))


class TimeSeries(_Model):
    """One model's figures over one phase, one point per scrape; ``t_s`` counts from the phase start.

    Latency quantiles are those of the SLO's latency metric over a trailing window
    (``DemoRunInfo.series_window_s``); None where that window saw no request. ``itl_p99_ms`` is
    the inter-token P99 over the same window (None where it saw no gap), ``max_prefill_tokens``
    the window's prompt-token budget per step (None: whole prompts).
    """

    t_s: list[float] = Field(default_factory=list)
    p50_ms: list[float | None] = Field(default_factory=list)
    p99_ms: list[float | None] = Field(default_factory=list)
    p999_ms: list[float | None] = Field(default_factory=list)
    queue_depth: list[float | None] = Field(default_factory=list)
    running: list[float | None] = Field(default_factory=list)
    kv_usage: list[float | None] = Field(default_factory=list)
    tokens_per_s: list[float | None] = Field(default_factory=list)
    target_batch_size: list[float | None] = Field(default_factory=list)
    hard_cap: list[float | None] = Field(default_factory=list)
    max_wait_ms: list[float | None] = Field(default_factory=list)
    itl_p99_ms: list[float | None] = Field(default_factory=list)
    max_prefill_tokens: list[float | None] = Field(default_factory=list)


class LoadCounts(_Model):
    """What the load generator saw for one model in one phase.

    ``accepted`` = requests the runtime took (not refused with 429); each accepted request
    either completed or ended with an explicit error, so ``lost`` must be 0.
    """

    sent: int
    accepted: int
    completed: int
    errors: int
    rejected: int

    @property
    def lost(self) -> int:
        return self.accepted - self.completed - self.errors


class DecisionRecord(_Model):
    """One decision the operator printed, placed in its phase."""

    t_s: float  # seconds since the phase started
    model: str
    direction: str
    reason: str
    window: str | None = None  # the window it decided, as the operator wrote it
    budget: int | None = None  # its maxPrefillTokens, when it has one


class ModelPhaseResult(_Model):
    model: str
    load: LoadCounts
    runtime_outcomes: dict[str, int]  # batchpilot_requests_total increase over the phase, by outcome
    p50_ms: float | None  # of the SLO's latency metric over the whole phase
    p99_ms: float | None
    p999_ms: float | None
    e2e_p99_ms: float | None
    slo_met_share: float | None  # share of requests whose SLO latency was at most slo.p99Ms
    tokens_per_s: float | None
    goodput_tokens_per_s: float | None  # tokens/s scaled by the share of requests that met the SLO
    mean_decode_batch_size: float | None
    kv_usage_max: float | None
    queue_depth_max: float | None
    preemptions: int
    decisions: int  # decisions that changed the window (up, down, reset)
    window_start: WindowSnapshot | None
    window_end: WindowSnapshot | None
    series: TimeSeries
    decode_batch_size: Histogram
    queue_wait_s: Histogram
    itl_p50_ms: float | None = None  # the gap between two tokens of one request, over the whole phase
    itl_p99_ms: float | None = None
    itl_slo_met_share: float | None = None  # share of gaps at most slo.interTokenP99Ms (None without one)


class PhaseResult(_Model):
    mode: Mode
    replay_s: float  # length of the replayed arrivals
    wall_s: float  # from the first arrival to the last answer
    models: list[ModelPhaseResult]
    decisions: list[DecisionRecord]

    def model(self, name: str) -> ModelPhaseResult | None:
        return next((m for m in self.models if m.model == name), None)


class DemoModelInfo(_Model):
    """One of the demo's models and the profile it was tuned by."""

    name: str
    preset: str
    batch_friendliness: str
    latency_metric: str
    slo_p99_ms: float
    slo_p999_ms: float | None
    window: str  # the starting (and static) window
    requests: int  # arrivals per phase
    description: str
    slo_itl_p99_ms: float | None = None  # slo.interTokenP99Ms
    window_label: str = ""  # what the static window is ("engine defaults", ...)
    surge: str = ""  # the surge in its arrivals, if any, in words
    surge_s: tuple[float, float] | None = None  # where it lies in each phase (seconds into the phase)


class DemoRunInfo(_Model):
    duration_s: float
    phase_replay_s: float
    wall_s: float
    metrics_source: str  # "prometheus" or "scrape": what the operator read
    scrape_interval_s: float
    series_window_s: float
    operator_interval_s: int
    trace: str  # the trace file and how it was scaled
    host: str
    command: str = ""  # the command line that reproduces the run
    sizing: str = ""  # how the chat prompts were sized to the host (demo/sizing.py)


class ComparisonRow(_Model):
    model: str
    figure: str
    unit: str
    better: Literal["lower", "higher", "neither"]
    static: float | None
    adaptive: float | None
    change_pct: float | None  # (adaptive - static) / static


class ChatAnswer(_Model):
    """A question put to the real chat model before the replay, and its answer (temperature 0)."""

    model: str
    question: str
    answer: str
    completion_tokens: int
    finish_reason: str
    seconds: float  # from the request to the whole answer, the model alone on the machine


class DemoReport(_Model):
    version: int = 1
    created_at: str
    run: DemoRunInfo
    models: list[DemoModelInfo]
    phases: list[PhaseResult]
    comparison: list[ComparisonRow]
    answers: list[ChatAnswer] = []  # empty when the demo ran with --no-answers

    def phase(self, mode: Mode) -> PhaseResult | None:
        return next((p for p in self.phases if p.mode == mode), None)


# (label, unit, which way is better, how to read it from a model's phase result)
_COMPARED: tuple[tuple[str, str, Literal["lower", "higher", "neither"], str], ...] = (
    ("P99 latency", "ms", "lower", "p99_ms"),
    ("P99.9 latency", "ms", "lower", "p999_ms"),
    ("P50 latency", "ms", "lower", "p50_ms"),
    ("Inter-token P99", "ms", "lower", "itl_p99_ms"),
    ("Gaps within the inter-token SLO", "%", "higher", "itl_slo_met_share"),
    ("Requests within the SLO", "%", "higher", "slo_met_share"),
    ("Throughput", "tokens/s", "higher", "tokens_per_s"),
    ("Goodput", "tokens/s", "higher", "goodput_tokens_per_s"),
    ("End-to-end P99", "ms", "lower", "e2e_p99_ms"),
    ("Mean decode batch", "seqs", "higher", "mean_decode_batch_size"),
    ("Peak KV usage", "%", "lower", "kv_usage_max"),
    ("Completed requests", "", "higher", "completed"),
    ("Lost requests", "", "lower", "lost"),
    ("Window changes", "", "neither", "decisions"),
)


def _figure(result: ModelPhaseResult, attribute: str) -> float | None:
    if attribute == "completed":
        return float(result.load.completed)
    if attribute == "lost":
        return float(result.load.lost)
    if attribute == "decisions":
        return float(result.decisions)
    value = getattr(result, attribute)
    if value is None:
        return None
    if attribute in ("slo_met_share", "itl_slo_met_share", "kv_usage_max"):
        return round_figure(100.0 * float(value))
    return round_figure(float(value))


def compare(phases: list[PhaseResult], model_names: list[str]) -> list[ComparisonRow]:
    """The comparison table: each figure of each model, static beside adaptive."""
    static = next((p for p in phases if p.mode == "static"), None)
    adaptive = next((p for p in phases if p.mode == "adaptive"), None)
    rows: list[ComparisonRow] = []
    for name in model_names:
        before = static.model(name) if static else None
        after = adaptive.model(name) if adaptive else None
        for label, unit, better, attribute in _COMPARED:
            a = _figure(before, attribute) if before else None
            b = _figure(after, attribute) if after else None
            change = round_figure(100.0 * (b - a) / a, 3) if a and b is not None else None
            rows.append(
                ComparisonRow(
                    model=name, figure=label, unit=unit, better=better, static=a, adaptive=b, change_pct=change
                )
            )
    return rows
