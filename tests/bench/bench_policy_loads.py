"""Policy figures across loads: where the window matters, and what no window can do.

``bench_policy.py`` compares the policies at one load. This sweep replays the same trace and
cost model at several arrival-rate scalings and records, at each, for:

* ``adaptive``: the policy, starting from the profile's window;
* ``start_static``: the profile's starting window held static (what a user gets untuned);
* ``work_conserving``: target 1, the largest cap, no wait (no window holds a request back);
* ``large_fixed``: target 256, cap 256, wait 200 ms;

goodput, P99, the share of waits over 1 s and the SLO-met share, beside the two bounds of
``batchpilot_operator.sim.bounds``: the goodput ceiling (every offered token within the SLO)
and the P99 floor (each request alone on an idle engine). The grid search of ``bench_policy``
is left out (it costs a minute per load); at x0.64 its best window is within 0.02 % of
work-conserving admission in goodput and 0.5 % in P99.

Usage::

    .venv/bin/python tests/bench/bench_policy_loads.py --json loads.json --plot loads.png
    .venv/bin/python tests/bench/bench_policy_loads.py --loads 0.5 0.64 --duration 1200
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from batchpilot_operator.api.profile import BatchProfileSpec, LatencyMetric
from batchpilot_operator.cli.simulate import json_safe
from batchpilot_operator.sim.bounds import latency_floor_quantile_s, offered_tokens_per_s
from batchpilot_operator.sim.runner import (
    busiest_span,
    default_spec,
    load_profile_spec,
    run_policy,
    work_conserving_window,
)
from batchpilot_runtime.replay.cost_model import CostModel, load_cost_model
from batchpilot_runtime.replay.trace import DEFAULT_TRACE_PATH, TraceRequest, TraceScaling, read_trace, scale_trace

DEFAULT_LOADS = (0.3, 0.4, 0.5, 0.55, 0.6, 0.62, 0.64, 0.66, 0.7)
POLICIES = ("adaptive", "start_static", "work_conserving", "large_fixed")
FIELDS = ("goodput_tokens_per_s", "p50_s", "p99_s", "share_wait_over_1s", "slo_met_share", "decisions_per_hour")


def _run(args: tuple[str, float, list[TraceRequest], BatchProfileSpec, CostModel]) -> tuple[str, float, dict[str, Any]]:
    policy, load, requests, spec, cost = args
    if policy == "work_conserving":
        window = work_conserving_window(spec)
        run = run_policy("static", requests, spec, cost, window=window, record_timeline=False)
    elif policy == "start_static":
        run = run_policy("static", requests, spec, cost, record_timeline=False)
    else:
        run = run_policy(policy, requests, spec, cost, record_timeline=False)
    return policy, load, {f: run.summary[f] for f in FIELDS} | {"span_s": run.result.trace_span_s}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [row["load"] for row in report["loads"]]
    fig, axes = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    for policy in POLICIES:
        axes[0].plot(loads, [row["policies"][policy]["p99_s"] for row in report["loads"]], marker="o", label=policy)
        axes[1].plot(
            loads,
            [row["policies"][policy]["goodput_tokens_per_s"] / row["offered_tokens_per_s"] for row in report["loads"]],
            marker="o",
            label=policy,
        )
    axes[0].plot(loads, [row["p99_floor_s"] for row in report["loads"]], color="grey", linestyle=":", label="P99 floor")
    axes[0].axhline(report["slo_p99_s"], color="red", linestyle="--", label="SLO")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("P99 (s)")
    axes[0].legend(fontsize=8)
    axes[0].set_title(report["title"], fontsize=9)
    axes[1].set_ylabel("goodput / offered tokens")
    axes[1].set_xlabel("arrival rate x the trace's")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE_PATH, help="CSV in the Azure trace format")
    parser.add_argument("--profile", type=Path, default=None, help="BatchProfile YAML (default: 1 s TTFT chat)")
    parser.add_argument("--cost-profile", default="a100-llama2-7b")
    parser.add_argument("--loads", type=float, nargs="+", default=list(DEFAULT_LOADS), help="arrival-rate scalings")
    parser.add_argument("--duration", type=float, default=None, help="trace seconds to replay (the busiest stretch)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if any(load <= 0 for load in args.loads):
        parser.error("--loads must all be > 0")
    return args


def replays_by_load(args: argparse.Namespace) -> dict[float, list[TraceRequest]]:
    """The same stretch of the trace at each arrival-rate scaling of ``--loads``."""
    raw = read_trace(args.trace)
    start_s = busiest_span(raw, args.duration)[0] if args.duration is not None else 0.0
    replays: dict[float, list[TraceRequest]] = {}
    for load in args.loads:
        scaling = TraceScaling(
            time_scale=load,
            max_prompt_tokens=7000,
            max_output_tokens=1024,
            start_s=start_s,
            duration_s=args.duration,
        )
        replays[load] = scale_trace(raw, scaling)
    return replays


def run_all(
    loads: list[float],
    replays: dict[float, list[TraceRequest]],
    spec: BatchProfileSpec,
    cost: CostModel,
    workers: int,
) -> list[tuple[str, float, dict[str, Any]]]:
    jobs = [(policy, load, replays[load], spec, cost) for load in loads for policy in POLICIES]
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(_run, jobs))
    return [_run(job) for job in jobs]


def load_row(
    load: float,
    requests: list[TraceRequest],
    results: list[tuple[str, float, dict[str, Any]]],
    cost: CostModel,
    metric: LatencyMetric,
) -> dict[str, Any]:
    """One load's figures, beside its bounds; the span of the adaptive run is the offered rate's span."""
    figures = {policy: summary for policy, at, summary in results if at == load}
    span_s = figures["adaptive"].pop("span_s")
    for summary in figures.values():
        summary.pop("span_s", None)
    offered = offered_tokens_per_s(requests, span_s)
    floor = latency_floor_quantile_s(requests, cost, metric, 0.99)
    large_p99 = figures["large_fixed"]["p99_s"]
    return {
        "load": load,
        "requests": len(requests),
        "offered_tokens_per_s": offered,
        "p99_floor_s": floor,
        "policies": figures,
        "adaptive_goodput_over_start_static": figures["adaptive"]["goodput_tokens_per_s"]
        / max(figures["start_static"]["goodput_tokens_per_s"], 1e-9),
        "adaptive_p99_over_large_fixed": figures["adaptive"]["p99_s"] / large_p99,
        "work_conserving_p99_over_large_fixed": figures["work_conserving"]["p99_s"] / large_p99,
        "floor_over_large_fixed": floor / large_p99 if math.isfinite(large_p99) else 0.0,
    }


def print_row(row: dict[str, Any]) -> None:
    figures = row["policies"]
    a, w = figures["adaptive"], figures["work_conserving"]
    print(
        f"x{row['load']:<5g} offered {row['offered_tokens_per_s']:7.1f} tok/s | adaptive "
        f"{a['goodput_tokens_per_s']:7.1f} tok/s P99 {a['p99_s']:7.3f} s | work-conserving P99 {w['p99_s']:7.3f} s "
        f"| start static P99 {figures['start_static']['p99_s']:7.3f} s | large fixed P99 "
        f"{figures['large_fixed']['p99_s']:7.3f} s | floor {row['p99_floor_s']:.3f} s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    began = time.perf_counter()
    spec = load_profile_spec(args.profile) if args.profile else default_spec()
    cost = load_cost_model(args.cost_profile)
    metric = LatencyMetric(spec.slo.latency_metric)
    replays = replays_by_load(args)
    results = run_all(args.loads, replays, spec, cost, args.workers)

    slo_s = spec.slo.p99_ms / 1000.0
    rows = []
    for load in args.loads:
        rows.append(load_row(load, replays[load], results, cost, metric))
        print_row(rows[-1])
    report = {
        "title": f"{args.trace.name}, cost {cost.name}, SLO {metric.value} P99 {slo_s:g} s",
        "slo_p99_s": slo_s,
        "latency_metric": metric.value,
        "trace": str(args.trace),
        "duration_s": args.duration,
        "cost_profile": cost.as_dict(),
        "loads": rows,
        "wall_s": time.perf_counter() - began,
    }
    if args.json:
        args.json.write_text(json.dumps(json_safe(report), indent=2))
    if args.plot:
        plot(report, args.plot)
    print(f"wall {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
