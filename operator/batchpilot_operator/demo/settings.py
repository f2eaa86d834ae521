"""What the demo runs: its two models, their profiles, the arrivals each gets, and its timing.

The two models want different windows. ``chat`` is an interactive assistant under a tight
time-to-first-token SLO; it starts on a window tuned for throughput (a long wait for a large
target), which a chat model pays for in latency. ``bulk`` is an offline job under a loose
SLO, declared highly batch-friendly; it starts on a window tuned for latency (small
batches), which leaves throughput on the table and queues up in bursts. The static phase
keeps those windows; the adaptive phase lets the operator retune them.

Both run the ``tiny`` preset by default: on a small CPU machine the ``small`` preset serves
too few requests per second for the operator to have enough samples per interval (it
refuses to act on fewer than 20); ``--preset`` changes that on a faster machine. ``chat``'s
friendliness is ``auto``: the operator measures it from the runtime's step times.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from batchpilot_operator import API_VERSION, KIND
from batchpilot_operator.demo.results import Mode
from batchpilot_runtime.trace import TraceRequest, TraceScaling, read_trace, scale_trace
from batchpilot_runtime.window import WindowFields

DURATION_ENV = "BATCHPILOT_DEMO_DURATION"
DEFAULT_DURATION_S = 180.0
MIN_DURATION_S = 20.0
# The first 15 minutes of the Azure conversation trace, shipped with the runtime package
# (the full trace is not part of a clone); --trace replays another file.
DEMO_TRACE = "azure_llm_2023_conv_15min.csv"
# Long enough that each model's rate window holds the policy's 20 samples at the demo's rates.
OPERATOR_INTERVAL_S = 8
SCRAPE_INTERVAL_S = 1.0
SERIES_WINDOW_S = 10.0


@dataclass(frozen=True)
class DemoModel:
    """One runtime of the demo, the profile that tunes it, and the arrivals it is sent."""

    name: str
    preset: str
    description: str
    batch_friendliness: str
    window: WindowFields
    slo_p99_ms: float
    slo_p999_ms: float | None
    latency_metric: str
    bounds: dict[str, dict[str, float]]
    arrival_rate_per_s: float  # mean rate of its replay, whatever the phase length
    token_scale: float
    max_prompt_tokens: int
    max_output_tokens: int
    kv_cache_tokens: int
    trace_offset_s: float = 0.0  # where in the trace its slice starts (the models see different traffic)

    def profile_manifest(self, mode: Mode, namespace: str = "demo") -> dict[str, Any]:
        """The BatchProfile of this model for one phase (only ``tuning.mode`` differs)."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": self.name, "namespace": namespace},
            "spec": {
                "model": self.name,
                "selector": {"matchLabels": {"app.kubernetes.io/name": self.name}},
                "batchFriendliness": self.batch_friendliness,
                "window": self.window.model_dump(by_alias=True),
                "slo": {
                    "latencyMetric": self.latency_metric,
                    "p99Ms": self.slo_p99_ms,
                    **({"p999Ms": self.slo_p999_ms} if self.slo_p999_ms is not None else {}),
                },
                "tuning": {
                    "mode": mode,
                    "intervalSeconds": OPERATOR_INTERVAL_S,
                    # Below the interval: ticks come a little early or late, and a cooldown of exactly
                    # one interval would then block every other tick.
                    "cooldownSeconds": OPERATOR_INTERVAL_S - 2,
                    "maxStepFraction": 0.5,
                    "bounds": self.bounds,
                },
            },
        }


def default_models() -> tuple[DemoModel, ...]:
    return (
        DemoModel(
            name="chat",
            preset="tiny",
            description=(
                "interactive assistant, tight TTFT SLO; started on a throughput window (a long wait for a "
                "large target); friendliness measured by the operator"
            ),
            batch_friendliness="auto",
            window=WindowFields(target_batch_size=16, hard_cap=16, max_wait_ms=400, tail_mark_ratio=2.0),
            slo_p99_ms=500.0,
            slo_p999_ms=1000.0,
            latency_metric="ttft",
            bounds={
                "targetBatchSize": {"min": 1, "max": 32},
                "hardCap": {"min": 2, "max": 32},
                "maxWaitMs": {"min": 0, "max": 500},
                "tailMarkRatio": {"min": 1.5, "max": 4.0},
            },
            arrival_rate_per_s=4.0,
            token_scale=0.05,
            max_prompt_tokens=64,
            max_output_tokens=24,
            kv_cache_tokens=8192,
        ),
        DemoModel(
            name="bulk",
            preset="tiny",
            description=(
                "offline summarization, loose SLO, declared highly batch-friendly; started on a latency "
                "window (small batches)"
            ),
            batch_friendliness="high",
            window=WindowFields(target_batch_size=2, hard_cap=4, max_wait_ms=10, tail_mark_ratio=2.0),
            slo_p99_ms=4000.0,
            slo_p999_ms=None,
            latency_metric="ttft",
            bounds={
                "targetBatchSize": {"min": 1, "max": 128},
                "hardCap": {"min": 2, "max": 256},
                "maxWaitMs": {"min": 0, "max": 500},
                "tailMarkRatio": {"min": 1.5, "max": 4.0},
            },
            arrival_rate_per_s=5.0,
            token_scale=0.1,
            max_prompt_tokens=128,
            max_output_tokens=32,
            kv_cache_tokens=32768,
            trace_offset_s=300.0,
        ),
    )


@dataclass(frozen=True)
class DemoSettings:
    duration_s: float
    out_dir: Path
    live: bool
    models: tuple[DemoModel, ...] = field(default_factory=default_models)
    preset_override: str | None = None  # e.g. "tiny" for every model (tests, slow machines)
    prometheus: bool = True  # use a real Prometheus when one is installed
    trace_path: Path | None = None
    seed: int = 0
    ready_timeout_s: float = 180.0
    command: str = ""  # how the demo was started, for the report

    def __post_init__(self) -> None:
        if not self.duration_s >= MIN_DURATION_S:
            raise ValueError(f"--duration must be at least {MIN_DURATION_S:g} seconds, got {self.duration_s:g}")

    @property
    def phase_replay_s(self) -> float:
        """Each of the two phases replays half of the duration's worth of arrivals."""
        return self.duration_s / 2.0

    def effective_models(self) -> tuple[DemoModel, ...]:
        if self.preset_override is None:
            return self.models
        return tuple(replace(m, preset=self.preset_override) for m in self.models)


def duration_from_env(default_s: float = DEFAULT_DURATION_S) -> float:
    """``BATCHPILOT_DEMO_DURATION`` in seconds, else ``default_s``; a bad value names the variable."""
    text = os.environ.get(DURATION_ENV)
    if text is None or not text.strip():
        return default_s
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{DURATION_ENV}={text!r}: expected a number of seconds") from None


@dataclass(frozen=True)
class Arrivals:
    model: str
    requests: list[TraceRequest]
    scaling: TraceScaling


def demo_trace_path() -> Path:
    return Path(str(resources.files("batchpilot_runtime") / "data" / DEMO_TRACE))


def plan_arrivals(settings: DemoSettings, trace: list[TraceRequest] | None = None) -> list[Arrivals]:
    """Each model's arrivals for one phase (both phases replay the very same ones).

    A slice of the trace is compressed in time so that its mean arrival rate is the model's
    rate over ``phase_replay_s``: the load keeps the trace's bursts and lulls, only faster.
    """
    path = settings.trace_path or demo_trace_path()
    full = trace if trace is not None else read_trace(path)
    planned = []
    for model in settings.effective_models():
        wanted = max(2, round(model.arrival_rate_per_s * settings.phase_replay_s))
        sliced = [r for r in full if r.arrival_s >= model.trace_offset_s][:wanted]
        if len(sliced) < wanted:
            raise ValueError(
                f"{path}: {len(sliced)} requests after {model.trace_offset_s:g} s, but model {model.name} needs "
                f"{wanted} for --duration {settings.duration_s:g}; use a shorter --duration or a longer --trace"
            )
        span_s = sliced[-1].arrival_s - sliced[0].arrival_s
        time_scale = max(span_s, 1e-3) / settings.phase_replay_s
        scaling = TraceScaling(
            time_scale=time_scale,
            token_scale=model.token_scale,
            max_prompt_tokens=model.max_prompt_tokens,
            max_output_tokens=model.max_output_tokens,
            start_s=sliced[0].arrival_s,
            limit=wanted,
        )
        planned.append(Arrivals(model.name, scale_trace(full, scaling), scaling))
    return planned
