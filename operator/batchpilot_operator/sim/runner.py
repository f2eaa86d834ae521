"""Running simulations by name: the trace, the profile, the policy, the grid search, the plots.

Shared by ``batchpilot-operator simulate`` and ``tests/bench/bench_policy.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpilot_operator.api.profile import BatchProfileSpec, LatencyMetric, ProfileError, parse_manifest, parse_spec
from batchpilot_operator.api.yaml_input import read_yaml_documents
from batchpilot_operator.sim.controllers import (
    LARGE_FIXED_WINDOW,
    AdaptiveController,
    AimdController,
    StaticController,
)
from batchpilot_operator.sim.metrics import summarize
from batchpilot_operator.sim.simulator import Controller, SimConfig, SimResult, Simulator, scheduler_config_for
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import CostModel
from batchpilot_runtime.replay.trace import TraceRequest

POLICIES = ("adaptive", "static", "aimd", "large_fixed")
DRAIN_LIMIT_S = 600.0

# The benchmark's grid (issue 5): target in powers of two, cap 1x/1.5x/2x the target, seven waits.
GRID_TARGETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRID_CAP_FACTORS = (1.0, 1.5, 2.0)
GRID_WAITS_MS = (0, 5, 10, 20, 50, 100, 200)


def slo_p99_s(spec: BatchProfileSpec) -> float:
    """The SLO's P99 target in seconds; inf when it states only an inter-token objective."""
    return spec.slo.p99_ms / 1000.0 if spec.slo.p99_ms is not None else math.inf


def default_spec(slo_p99_ms: float = 1000.0, latency_metric: str = "ttft") -> BatchProfileSpec:
    """The profile the benchmark uses when none is given: a chat model, auto friendliness."""
    return parse_spec(
        {
            "model": "sim",
            "selector": {"matchLabels": {"app": "sim"}},
            "batchFriendliness": "auto",
            # The chat window of the production report (target 16, room to 64), as a user would start.
            "window": {"targetBatchSize": 16, "hardCap": 64, "maxWaitMs": 20, "tailMarkRatio": 2.0},
            "slo": {"latencyMetric": latency_metric, "p99Ms": slo_p99_ms},
            "tuning": {"intervalSeconds": 15, "cooldownSeconds": 30, "maxStepFraction": 0.5},
        }
    )


def load_profile_spec(path: Path) -> BatchProfileSpec:
    """The spec of the first BatchProfile in a YAML file (a whole manifest or a bare spec).

    Raises YamlInputError (a ValueError naming the file) when the file is refused as a whole.
    """
    documents = [d for d in read_yaml_documents(path) if d]
    if not documents:
        raise ProfileError(f"{path}: no YAML document")
    document = documents[0]
    if isinstance(document, dict) and "apiVersion" in document:
        return parse_manifest(document)[2]
    if isinstance(document, dict) and "spec" in document:
        return parse_spec(document["spec"])
    return parse_spec(document)


def make_controller(policy: str, spec: BatchProfileSpec) -> Controller:
    if policy == "adaptive":
        return AdaptiveController(spec)
    if policy == "aimd":
        return AimdController(spec)
    if policy in ("static", "large_fixed"):
        return StaticController(name=policy)
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def work_conserving_window(spec: BatchProfileSpec) -> Window:
    """Target 1, the largest cap the bounds allow, no wait: a window that holds no request back,
    so that only the KV cache limits admissions (the benchmarks' reference)."""
    return Window(
        target_batch_size=1,
        hard_cap=spec.tuning.bounds.hard_cap.max,
        max_wait_ms=0,
        tail_mark_ratio=spec.window.tail_mark_ratio,
    )


def start_window(policy: str, spec: BatchProfileSpec) -> Window:
    if policy == "large_fixed":
        return LARGE_FIXED_WINDOW
    return Window.from_fields(spec.window, generation=1)


def sim_config(
    spec: BatchProfileSpec,
    cost: CostModel,
    rate_window_s: float | None = None,
    abort_after_misses: int | None = None,
    record_timeline: bool = True,
    max_prefill_tokens_per_step: int | None = None,
    max_sim_s: float | None = None,
) -> SimConfig:
    interval_s = float(spec.tuning.interval_seconds)
    return SimConfig(
        cost=cost,
        scheduler=scheduler_config_for(cost, max_prefill_tokens_per_step=max_prefill_tokens_per_step),
        slo_p99_s=slo_p99_s(spec),
        slo_itl_p99_s=spec.slo.inter_token_p99_ms / 1000.0 if spec.slo.inter_token_p99_ms is not None else None,
        latency_metric=LatencyMetric(spec.slo.latency_metric),
        interval_s=interval_s,
        rate_window_s=rate_window_s if rate_window_s is not None else 2 * interval_s,
        abort_after_misses=abort_after_misses,
        record_timeline=record_timeline,
        max_sim_s=max_sim_s,
    )


@dataclass
class PolicyRun:
    name: str
    summary: dict[str, Any]
    result: SimResult


def run_policy(
    policy: str,
    requests: Sequence[TraceRequest],
    spec: BatchProfileSpec,
    cost: CostModel,
    window: Window | None = None,
    **config: Any,
) -> PolicyRun:
    if "max_sim_s" not in config and requests:
        # Every policy gets the same drain time after the last arrival; what is left then missed the SLO.
        config["max_sim_s"] = requests[-1].arrival_s + DRAIN_LIMIT_S
    cfg = sim_config(spec, cost, **config)
    controller = make_controller(policy, spec)
    result = Simulator(requests, window or start_window(policy, spec), cfg, controller).run()
    return PolicyRun(policy, summarize(result, cfg.slo_p99_s, cfg.latency_metric), result)


def grid_windows(
    targets: Sequence[int] = GRID_TARGETS,
    cap_factors: Sequence[float] = GRID_CAP_FACTORS,
    waits_ms: Sequence[int] = GRID_WAITS_MS,
) -> list[Window]:
    windows = []
    for target in targets:
        for factor in cap_factors:
            cap = max(target, math.floor(target * factor))
            for wait in waits_ms:
                windows.append(Window(target_batch_size=target, hard_cap=cap, max_wait_ms=wait, tail_mark_ratio=2.0))
    unique: dict[tuple[int, int, int], Window] = {}
    for w in windows:
        unique.setdefault((w.target_batch_size, w.hard_cap, w.max_wait_ms), w)
    return list(unique.values())


def busiest_span(requests: Sequence[TraceRequest], span_s: float, step_s: float = 60.0) -> tuple[float, float]:
    """Start and end of the ``span_s`` stretch (aligned to ``step_s``) with the most arrivals."""
    if not requests:
        return 0.0, span_s
    end_s = requests[-1].arrival_s
    best_start, best_count = 0.0, -1
    start = 0.0
    arrivals = [r.arrival_s for r in requests]
    import bisect

    while start + span_s <= end_s + step_s:
        count = bisect.bisect_left(arrivals, start + span_s) - bisect.bisect_left(arrivals, start)
        if count > best_count:
            best_start, best_count = start, count
        start += step_s
    return best_start, best_start + span_s


def slice_requests(requests: Sequence[TraceRequest], start_s: float, end_s: float) -> list[TraceRequest]:
    chosen = [r for r in requests if start_s <= r.arrival_s < end_s]
    if not chosen:
        return []
    origin = chosen[0].arrival_s
    return [TraceRequest(r.arrival_s - origin, r.prompt_tokens, r.output_tokens) for r in chosen]


def plot_runs(runs: Sequence[PolicyRun], slo_p99_s: float, path: Path, title: str) -> None:
    """Arrival rate, window fields and observed P99 vs the SLO over time, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    first = runs[0].result.timeline
    axes[0].plot([p.t_s / 60 for p in first], [p.arrival_rate_per_s for p in first], color="black")
    axes[0].set_ylabel("arrivals/s")
    axes[0].set_title(title, fontsize=9)
    for run in runs:
        tl = run.result.timeline
        minutes = [p.t_s / 60 for p in tl]
        axes[1].step(minutes, [p.hard_cap for p in tl], where="post", label=f"{run.name} cap")
        axes[1].step(
            minutes, [p.target_batch_size for p in tl], where="post", linestyle=":", label=f"{run.name} target"
        )
        axes[2].step(minutes, [p.max_wait_ms for p in tl], where="post", label=run.name)
        p99 = [min(p.p99_s, 200.0) if not math.isnan(p.p99_s) else math.nan for p in tl]
        axes[3].plot(minutes, p99, label=run.name, linewidth=0.8)
    axes[1].set_ylabel("batch size")
    axes[1].set_yscale("symlog")
    axes[1].legend(fontsize=7, ncol=2)
    axes[2].set_ylabel("maxWaitMs")
    axes[2].legend(fontsize=7)
    if math.isfinite(slo_p99_s):
        axes[3].axhline(slo_p99_s, color="red", linestyle="--", label="SLO")
    axes[3].set_yscale("log")
    axes[3].set_ylabel("observed P99 (s)")
    axes[3].set_xlabel("trace time (min)")
    span_min = max((run.result.trace_span_s for run in runs), default=0.0) / 60
    if span_min > 0:
        axes[3].set_xlim(0, span_min)
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
