"""Policy benchmark (issue 5): adaptive vs the best static window vs AIMD vs a large fixed window.

All four run on the same trace, scaling and cost model, through the runtime's real scheduler
(``batchpilot_operator.sim.simulator``). ``best_static`` is found in hindsight by grid search over
targetBatchSize in {1, 2, 4, ..., 256}, hardCap in {1x, 1.5x, 2x} the target and maxWaitMs in
{0, 5, 10, 20, 50, 100, 200}: the window with the highest goodput whose P99 meets the SLO (the
highest goodput overall, flagged, when none meets it).

The grid is searched in two stages, to fit the time budget on two CPU cores:

1. screening: every grid window on the busiest stretch of the trace (``--screen-minutes`` of
   trace time, where the peaks that decide P99 are), in parallel processes; a run stops early
   once 5 % of the stretch's requests have missed the SLO (it is out of the running);
2. confirmation: the ``--finalists`` best screened windows (feasible first, by goodput) on the
   whole benchmark span; the best of those is ``best_static``.

``--quick`` uses a coarser grid (targets 1, 4, 16, 64, 256; caps 1x, 2x; waits 0, 20, 100 ms),
a 20-minute span and a 5-minute screening stretch, and finishes in under 3 minutes.

Beside the four policies the JSON carries three ``references`` (the profile's starting window held
static; work-conserving admission: target 1, the largest cap, no wait; the same on a KV cache that
holds the whole replay), the best static
window's ``saturation`` at the peaks, and ``bounds``: the goodput ceiling (every offered token
served within the SLO) and the P99 floor (each request alone on an idle engine), which say
whether the two relative targets are within reach of any policy at all.

Usage::

    .venv/bin/python tests/bench/bench_policy.py --quick --json bench.json --plot bench.png
    .venv/bin/python tests/bench/bench_policy.py --json bench.json --plot bench.png   # full hour
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from batchpilot_operator.api.profile import LatencyMetric
from batchpilot_operator.cli.simulate import json_safe
from batchpilot_operator.sim.bounds import latency_floor_quantile_s, offered_tokens_per_s
from batchpilot_operator.sim.runner import (
    GRID_CAP_FACTORS,
    GRID_TARGETS,
    GRID_WAITS_MS,
    PolicyRun,
    busiest_span,
    default_spec,
    grid_windows,
    load_profile_spec,
    plot_runs,
    run_policy,
    slice_requests,
    work_conserving_window,
)
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import CostModel, load_cost_model
from batchpilot_runtime.replay.trace import DEFAULT_TRACE_PATH, TraceRequest, TraceScaling, read_trace, scale_trace

# Load: issue 5 asks for a load at which the best static window is saturated at the trace's
# peaks. x0.64 of the trace's arrival rate (real token counts, one A100 serving Llama-2-7B, the
# a100-llama2-7b profile) is the heaviest, in steps of 0.01, at which a static window still
# meets the 1 s TTFT SLO over the hour: its KV cache fills at the peaks (0.97 in use at an
# interval boundary). At x0.65 no window of the grid meets the SLO any more.
DEFAULT_TIME_SCALE = 0.64
DEFAULT_SLO_MS = 1000.0


def _screen_one(args: tuple[Window, list[TraceRequest], Any, CostModel, int]) -> tuple[Window, dict[str, Any]]:
    window, requests, spec, cost, max_misses = args
    run = run_policy(
        "static", requests, spec, cost, window=window, abort_after_misses=max_misses, record_timeline=False
    )
    return window, run.summary


def _confirm_one(args: tuple[Window, list[TraceRequest], Any, CostModel]) -> PolicyRun:
    window, requests, spec, cost = args
    return run_policy("static", requests, spec, cost, window=window)


def _rank_key(summary: dict[str, Any], slo_s: float) -> tuple[int, float]:
    feasible = (not summary["aborted"]) and summary["p99_s"] <= slo_s
    return (1 if feasible else 0, summary["goodput_tokens_per_s"])


def grid_search(
    requests: list[TraceRequest],
    screen: list[TraceRequest],
    spec: Any,
    cost: CostModel,
    windows: list[Window],
    finalists: int,
    workers: int,
) -> tuple[PolicyRun, dict[str, Any]]:
    slo_s = spec.slo.p99_ms / 1000.0
    # The busiest stretch may be saturated for every window, so a run is only stopped once it is
    # hopeless (5 % of the stretch's requests missed); the ranking is feasibility, then goodput.
    max_misses = max(1, math.floor(0.05 * len(screen)))
    jobs = [(w, screen, spec, cost, max_misses) for w in windows]
    began = time.perf_counter()
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            screened = list(pool.map(_screen_one, jobs))
    else:
        screened = [_screen_one(job) for job in jobs]
    screen_s = time.perf_counter() - began
    screened.sort(key=lambda item: _rank_key(item[1], slo_s), reverse=True)
    chosen = [w for w, _ in screened[:finalists]]
    began = time.perf_counter()
    confirm_jobs = [(w, requests, spec, cost) for w in chosen]
    if workers > 1 and len(confirm_jobs) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            confirmed = list(pool.map(_confirm_one, confirm_jobs))
    else:
        confirmed = [_confirm_one(job) for job in confirm_jobs]
    confirm_s = time.perf_counter() - began
    confirmed.sort(key=lambda run: _rank_key(run.summary, slo_s), reverse=True)
    best = confirmed[0]
    best.name = "best_static"
    info = {
        "windows_screened": len(windows),
        "screened_feasible": sum(1 for _, s in screened if _rank_key(s, slo_s)[0]),
        "screen_requests": len(screen),
        "screen_wall_s": screen_s,
        "finalists": [
            {
                "window": r.summary["window"],
                "goodput_tokens_per_s": r.summary["goodput_tokens_per_s"],
                "p99_s": r.summary["p99_s"],
            }
            for r in confirmed
        ],
        "confirm_wall_s": confirm_s,
        "best_meets_slo": bool(_rank_key(best.summary, slo_s)[0]),
        # With --finalists at the grid's size, this is the lowest P99 any static window reaches.
        "finalists_min_p99": min(
            ({"window": r.summary["window"], "p99_s": r.summary["p99_s"]} for r in confirmed),
            key=lambda item: item["p99_s"],
        ),
        "top_screened": [
            {
                "window": s["window"],
                "goodput_tokens_per_s": s["goodput_tokens_per_s"],
                "p99_s": s["p99_s"],
                "aborted": s["aborted"],
            }
            for _, s in screened[:10]
        ],
    }
    return best, info


JSON_FIELDS = (
    "goodput_tokens_per_s",
    "throughput_tokens_per_s",
    "p50_s",
    "p99_s",
    "p999_s",
    "share_wait_over_1s",
    "batch_hit_ratio_busy",
    "batch_hit_ratio_idle",
    "decisions_per_hour",
    "window",
)
POLICY_ORDER = ("adaptive", "best_static", "aimd", "large_fixed")


def target_bounds(
    requests: list[TraceRequest], spec: Any, cost: CostModel, runs: dict[str, PolicyRun]
) -> dict[str, Any]:
    """Whether the two relative targets are reachable by any policy at all on this replay.

    The goodput ceiling is every offered output token served within the SLO; the P99 floor is
    the P99 of each request's latency on an idle engine (``batchpilot_operator.sim.bounds``).
    A target above the ceiling, or below the floor, is out of reach whatever the window.
    """
    metric = LatencyMetric(spec.slo.latency_metric)
    span_s = runs["best_static"].result.trace_span_s
    offered = offered_tokens_per_s(requests, span_s)
    best_goodput = runs["best_static"].summary["goodput_tokens_per_s"]
    floor = latency_floor_quantile_s(requests, cost, metric, 0.99)
    large_p99 = runs["large_fixed"].summary["p99_s"]
    ceiling_ratio = offered / best_goodput if best_goodput > 0 else math.inf
    return {
        "offered_tokens_per_s": offered,
        "goodput_ceiling_over_best_static": ceiling_ratio,
        "goodput_1.3x_reachable": ceiling_ratio >= 1.3,
        "p99_floor_s": floor,
        "p99_floor_over_large_fixed_p99": floor / large_p99 if large_p99 > 0 else math.inf,
        "p99_0.3x_large_fixed_reachable": floor <= 0.3 * large_p99,
    }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE_PATH, help="CSV in the Azure trace format")
    parser.add_argument("--profile", type=Path, default=None, help="BatchProfile YAML (default: 1 s TTFT chat)")
    parser.add_argument("--cost-profile", default="a100-llama2-7b")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE)
    parser.add_argument("--token-scale", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=None, help="trace seconds to replay (default: all)")
    parser.add_argument("--screen-minutes", type=float, default=None)
    parser.add_argument("--finalists", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class SearchPlan:
    """The grid searched and the stretch replayed: ``--quick``'s coarser grid, or the full one."""

    targets: tuple[int, ...]
    cap_factors: tuple[float, ...]
    waits_ms: tuple[int, ...]
    duration_s: float | None  # None: the whole trace
    screen_minutes: float
    finalists: int


def search_plan(args: argparse.Namespace) -> SearchPlan:
    if args.quick:
        duration = args.duration or 1200.0
        return SearchPlan(
            (1, 4, 16, 64, 256), (1.0, 2.0), (0, 20, 100), duration, args.screen_minutes or 5.0, args.finalists or 2
        )
    return SearchPlan(
        GRID_TARGETS, GRID_CAP_FACTORS, GRID_WAITS_MS, args.duration, args.screen_minutes or 10.0, args.finalists or 4
    )


def replay_requests(args: argparse.Namespace, duration_s: float | None) -> tuple[TraceScaling, list[TraceRequest]]:
    raw = read_trace(args.trace)
    # The quick run replays the busiest stretch of the trace, so that its peaks are in it.
    start_s = 0.0
    if duration_s is not None:
        start_s, _ = busiest_span(raw, duration_s)
    scaling = TraceScaling(
        time_scale=args.time_scale,
        token_scale=args.token_scale,
        max_prompt_tokens=7000,
        max_output_tokens=1024,
        start_s=start_s,
        duration_s=duration_s,
    )
    return scaling, scale_trace(raw, scaling)


def run_named_policies(
    requests: list[TraceRequest], spec: Any, cost: CostModel
) -> tuple[dict[str, PolicyRun], dict[str, float]]:
    """adaptive, aimd and large_fixed, each with its wall time."""
    runs: dict[str, PolicyRun] = {}
    walls: dict[str, float] = {}
    for name in ("adaptive", "aimd", "large_fixed"):
        t0 = time.perf_counter()
        runs[name] = run_policy(name, requests, spec, cost)
        walls[name] = time.perf_counter() - t0
        print(f"  {name}: {walls[name]:.1f} s", flush=True)
    return runs, walls


def run_references(requests: list[TraceRequest], spec: Any, cost: CostModel) -> dict[str, PolicyRun]:
    # References beside the four policies: the window the profile starts from, held static (what
    # a user gets without tuning), and work-conserving admission (target 1, the largest cap, no
    # wait: no window holds any request back; only the KV cache limits admissions), also on a KV
    # cache that holds the whole replay at once (what is left of P99 there is step sharing).
    open_window = work_conserving_window(spec)
    whole_replay_tokens = sum(r.prompt_tokens + r.output_tokens for r in requests)
    unlimited_kv = dataclasses.replace(cost, kv_capacity_tokens=max(cost.kv_capacity_tokens or 0, whole_replay_tokens))
    return {
        "start_static": run_policy("static", requests, spec, cost),
        "work_conserving": run_policy("static", requests, spec, cost, window=open_window),
        "work_conserving_unlimited_kv": run_policy("static", requests, spec, unlimited_kv, window=open_window),
    }


def policy_figures(runs: dict[str, PolicyRun], walls: dict[str, float]) -> dict[str, dict[str, Any]]:
    policies = {name: {f: runs[name].summary[f] for f in JSON_FIELDS} for name in POLICY_ORDER}
    for name in POLICY_ORDER:
        policies[name].update(
            slo_met_share=runs[name].summary["slo_met_share"],
            rejected=runs[name].summary["rejected"],
            wall_s=walls[name],
        )
    return policies


def targets_met(runs: dict[str, PolicyRun], slo_s: float) -> dict[str, bool]:
    a, s, lf = runs["adaptive"].summary, runs["best_static"].summary, runs["large_fixed"].summary
    return {
        "goodput_ge_1.3x_best_static": a["goodput_tokens_per_s"] >= 1.3 * s["goodput_tokens_per_s"],
        "adaptive_p99_within_slo": a["p99_s"] <= slo_s,
        "adaptive_p99_le_0.3x_large_fixed": a["p99_s"] <= 0.3 * lf["p99_s"],
        "share_wait_over_1s_le_0.6pct": a["share_wait_over_1s"] <= 0.006,
        "batch_hit_ratio_busy_ge_0.9": a["batch_hit_ratio_busy"] >= 0.9,
        "decisions_per_hour_le_60": a["decisions_per_hour"] <= 60,
    }


def goodput_and_p99_ratios(runs: dict[str, PolicyRun]) -> dict[str, float]:
    a, s, lf = runs["adaptive"].summary, runs["best_static"].summary, runs["large_fixed"].summary
    return {
        "adaptive_goodput_over_best_static": a["goodput_tokens_per_s"] / max(s["goodput_tokens_per_s"], 1e-9),
        "adaptive_p99_over_large_fixed_p99": a["p99_s"] / lf["p99_s"] if math.isfinite(lf["p99_s"]) else 0.0,
    }


def best_static_saturation(best: PolicyRun) -> dict[str, Any]:
    timeline = best.result.timeline
    return {
        "best_static_peak_kv_usage": max((p.kv_usage_ratio for p in timeline), default=math.nan),
        "best_static_intervals_kv_over_0.95": sum(1 for p in timeline if p.kv_usage_ratio > 0.95),
        "best_static_peak_queue": max((p.queue_depth for p in timeline), default=0),
        "intervals": len(timeline),
    }


def print_summary(report: dict[str, Any]) -> None:
    keys = ("policies", "ratios", "targets_met", "bounds", "references", "saturation", "wall_s")
    print(json.dumps(json_safe({key: report[key] for key in keys}), indent=1))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    began = time.perf_counter()
    spec = load_profile_spec(args.profile) if args.profile else default_spec(DEFAULT_SLO_MS)
    cost = load_cost_model(args.cost_profile)
    plan = search_plan(args)
    scaling, requests = replay_requests(args, plan.duration_s)
    screen_lo, screen_hi = busiest_span(requests, plan.screen_minutes * 60.0)
    screen = slice_requests(requests, screen_lo, screen_hi)
    slo_s = spec.slo.p99_ms / 1000.0
    print(
        f"trace {args.trace.name}: {len(requests)} requests ({scaling.describe()}), cost {cost.name}, "
        f"SLO {spec.slo.latency_metric.value} P99 {slo_s:g} s; screening on {screen_lo:.0f}-{screen_hi:.0f} s "
        f"({len(screen)} requests)",
        flush=True,
    )

    runs, walls = run_named_policies(requests, spec, cost)
    references = run_references(requests, spec, cost)
    t0 = time.perf_counter()
    windows = grid_windows(plan.targets, plan.cap_factors, plan.waits_ms)
    best, grid_info = grid_search(requests, screen, spec, cost, windows, plan.finalists, args.workers)
    walls["best_static"] = time.perf_counter() - t0
    runs["best_static"] = best
    print(
        f"  best_static (grid of {len(windows)}): {walls['best_static']:.1f} s -> {best.summary['window']}", flush=True
    )

    report = {
        "slo_p99_s": slo_s,
        "latency_metric": spec.slo.latency_metric.value,
        "trace": str(args.trace),
        "scaling": scaling.as_dict(),
        "scaling_text": scaling.describe(),
        "requests": len(requests),
        "cost_profile": cost.as_dict(),
        "quick": args.quick,
        "policies": policy_figures(runs, walls),
        "ratios": goodput_and_p99_ratios(runs),
        "targets_met": targets_met(runs, slo_s),
        "bounds": target_bounds(requests, spec, cost, runs),
        "references": {
            name: {f: run.summary[f] for f in (*JSON_FIELDS, "slo_met_share")} for name, run in references.items()
        },
        "saturation": best_static_saturation(runs["best_static"]),
        "grid_search": grid_info,
        "wall_s": time.perf_counter() - began,
    }
    if args.json:
        args.json.write_text(json.dumps(json_safe(report), indent=2))
    print_summary(report)
    if args.plot:
        title = f"{args.trace.name}: {scaling.describe()}, cost {cost.name}"
        plot_runs([runs[n] for n in POLICY_ORDER], slo_s, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
