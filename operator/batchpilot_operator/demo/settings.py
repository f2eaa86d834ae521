"""What the demo runs: its two models, their profiles, the arrivals each gets, and its timing.

The two models want different windows. ``chat`` is an interactive assistant with long prompts
under two SLOs at once, time to first token (``p99Ms``) and the gap between tokens
(``interTokenP99Ms``); it starts on an engine's defaults (no wait, a cap of 256, vLLM's prompt-token
budget per step of 2048), and its arrivals surge to ``surge_factor`` times their rate for half of
each phase. A step that prefills up to 2048 prompt tokens while others decode is what pushes its
inter-token gaps over 40 ms in the surge (on the 2-core development machine a decode-only step
takes 2-3 ms, one with a 1024-token prompt 40-50 ms); the operator answers by lowering the budget.
Its prompts (and the budget with them) are sized to the host before the replay
(``demo/sizing.py``), so that a loaded or slower host still meets the surge with a budget to
find. ``bulk`` is an offline job under a loose SLO, declared highly batch-friendly; it starts on
a window tuned for latency (small batches), which leaves throughput on the table and queues up
in bursts. The static phase keeps those windows; the adaptive phase lets the operator retune
them.

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
from batchpilot_runtime.contract.window import WindowFields
from batchpilot_runtime.replay.trace import TraceRequest, TraceScaling, read_trace, scale_trace

DURATION_ENV = "BATCHPILOT_DEMO_DURATION"
DEFAULT_DURATION_S = 180.0
MIN_DURATION_S = 20.0
# The first 15 minutes of the Azure conversation trace, shipped with the runtime package
# (the full trace is not part of a clone); --trace replays another file.
DEMO_TRACE = "azure_llm_2023_conv_15min.csv"
# Each model's rate window holds the policy's 20 samples in the surge (chat) or throughout (bulk),
# and the surge lasts nine intervals: a reactive policy needs a few of them to find the budget.
OPERATOR_INTERVAL_S = 5
SCRAPE_INTERVAL_S = 1.0
SERIES_WINDOW_S = 10.0
ITL_SLO_MS = 40.0
# Where the surge lies in each phase (shares of its replay): after the operator's first few
# intervals, and with a calm stretch after it to show what the window does when it ends.
SURGE_START_FRACTION = 0.3
SURGE_END_FRACTION = 0.8


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
    window_label: str  # what the starting (static) window is, in the report and the live view
    arrival_rate_per_s: float  # mean rate of its replay, whatever the phase length
    token_scale: float
    max_prompt_tokens: int
    max_output_tokens: int
    kv_cache_tokens: int
    trace_offset_s: float = 0.0  # where in the trace its slice starts (the models see different traffic)
    slo_itl_p99_ms: float | None = None  # slo.interTokenP99Ms: with it the operator tunes maxPrefillTokens
    surge_factor: float = 1.0  # arrival rate during the surge over the rate outside it (1: no surge)
    size_to_host: bool = False  # scale its tokens to this host's prefill speed (demo/sizing.py)
    max_step_fraction: float = 0.5  # tuning.maxStepFraction

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
                    **({"interTokenP99Ms": self.slo_itl_p99_ms} if self.slo_itl_p99_ms is not None else {}),
                },
                "tuning": {
                    "mode": mode,
                    "intervalSeconds": OPERATOR_INTERVAL_S,
                    # Below the interval: ticks come a little early or late, and a cooldown of exactly
                    # one interval would then block every other tick.
                    "cooldownSeconds": OPERATOR_INTERVAL_S - 2,
                    "maxStepFraction": self.max_step_fraction,
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
                "interactive assistant with long prompts, under a first-token SLO and an inter-token SLO; "
                "started on engine defaults (no wait, a cap of 256, a prefill budget of vLLM's 2048 tokens "
                "at the trace's token scale); friendliness measured by the operator"
            ),
            batch_friendliness="auto",
            window=WindowFields(
                target_batch_size=1, hard_cap=256, max_wait_ms=0, tail_mark_ratio=2.0, max_prefill_tokens=2048
            ),
            window_label="engine defaults",
            slo_p99_ms=500.0,
            slo_p999_ms=1000.0,
            slo_itl_p99_ms=ITL_SLO_MS,
            latency_metric="ttft",
            bounds={
                "targetBatchSize": {"min": 1, "max": 32},
                "hardCap": {"min": 2, "max": 256},
                "maxWaitMs": {"min": 0, "max": 500},
                "tailMarkRatio": {"min": 1.5, "max": 4.0},
                "maxPrefillTokens": {"min": 64, "max": 2048},
            },
            arrival_rate_per_s=4.0,
            token_scale=1.0,
            max_prompt_tokens=2048,
            max_output_tokens=24,
            kv_cache_tokens=65536,
            surge_factor=2.5,
            size_to_host=True,
            # A budget cut costs nothing but prefill speed: three quarters at a time answer the surge
            # within two intervals (a 2048-token start reaches ~400 in 2, against 3-4 at a half).
            max_step_fraction=0.75,
        ),
        DemoModel(
            name="bulk",
            preset="tiny",
            description=(
                "offline summarization, loose SLO, declared highly batch-friendly; started on a latency "
                "window (small batches)"
            ),
            window_label="the profile's starting window",
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
    answers: bool = True  # the real chat model answers a few questions first (demo/answers.py)
    trace_path: Path | None = None
    seed: int = 0
    ready_timeout_s: float = 180.0
    token_scale: float | None = None  # of the models sized to the host; None: measured (demo/sizing.py)
    command: str = ""  # how the demo was started, for the report

    def __post_init__(self) -> None:
        if not self.duration_s >= MIN_DURATION_S:
            raise ValueError(f"--duration must be at least {MIN_DURATION_S:g} seconds, got {self.duration_s:g}")
        if self.token_scale is not None and not 0.0 < self.token_scale <= 1.0:
            raise ValueError(f"--token-scale must be in (0, 1], got {self.token_scale:g}")

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
class Surge:
    """A stretch of the phase, ``[start_s, end_s)``, whose arrivals come ``factor`` times as fast
    as the rest of the phase's."""

    start_s: float
    end_s: float
    factor: float

    def describe(self) -> str:
        return f"surge x{self.factor:g} from {self.start_s:g} s to {self.end_s:g} s"


def surge_for(model: DemoModel, phase_replay_s: float) -> Surge | None:
    if model.surge_factor == 1.0:
        return None
    return Surge(
        round(SURGE_START_FRACTION * phase_replay_s, 2),
        round(SURGE_END_FRACTION * phase_replay_s, 2),
        model.surge_factor,
    )


def warp_arrival(u_s: float, surge: Surge) -> float:
    """The phase time of an arrival at ``u_s`` on the trace's even clock: the surge's stretch
    of that clock, ``factor`` times as long as the surge, is compressed into the surge."""
    start, length = surge.start_s, surge.end_s - surge.start_s
    if u_s <= start:
        return u_s
    if u_s <= start + surge.factor * length:
        return start + (u_s - start) / surge.factor
    return u_s - (surge.factor - 1.0) * length


@dataclass(frozen=True)
class Arrivals:
    model: str
    requests: list[TraceRequest]
    scaling: TraceScaling
    surge: Surge | None = None

    def describe(self) -> str:
        text = self.scaling.describe()
        return text if self.surge is None else f"{text}, {self.surge.describe()}"


def demo_trace_path() -> Path:
    return Path(str(resources.files("batchpilot_runtime") / "data" / DEMO_TRACE))


def plan_arrivals(settings: DemoSettings, trace: list[TraceRequest] | None = None) -> list[Arrivals]:
    """Each model's arrivals for one phase (both phases replay the very same ones).

    A slice of the trace is compressed in time so that its mean arrival rate is the model's
    rate over ``phase_replay_s``: the load keeps the trace's bursts and lulls, only faster.
    A model with a surge gets the same requests, but the trace runs ``surge_factor`` times
    faster within the surge than outside it (the mean rate over the phase is unchanged).
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
        surge = surge_for(model, settings.phase_replay_s)
        # The trace's even clock spans the phase plus what the surge compresses.
        even_span_s = settings.phase_replay_s
        if surge is not None:
            even_span_s += (surge.factor - 1.0) * (surge.end_s - surge.start_s)
        span_s = sliced[-1].arrival_s - sliced[0].arrival_s
        time_scale = max(span_s, 1e-3) / even_span_s
        scaling = TraceScaling(
            time_scale=time_scale,
            token_scale=model.token_scale,
            max_prompt_tokens=model.max_prompt_tokens,
            max_output_tokens=model.max_output_tokens,
            start_s=sliced[0].arrival_s,
            limit=wanted,
        )
        requests = scale_trace(full, scaling)
        if surge is not None:
            requests = [replace(r, arrival_s=warp_arrival(r.arrival_s, surge)) for r in requests]
        planned.append(Arrivals(model.name, requests, scaling, surge))
    return planned
