"""``batchpilot-operator simulate``: replay a trace through the real scheduler under a policy."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from batchpilot_operator.cli.extras import require_extra


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a trace through the runtime's scheduler on a virtual clock under a tuning policy",
        description=(
            "Discrete-event simulation: the runtime's real scheduler, a step-time cost model, a trace in the "
            "Azure format, and a policy run in closed loop at the profile's intervalSeconds."
        ),
    )
    parser.add_argument("--trace", type=Path, default=None, help="trace CSV (default: the shared Azure conv trace)")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="BatchProfile YAML (manifest or spec); default: a chat profile with a 1 s TTFT SLO",
    )
    parser.add_argument(
        "--cost-profile",
        default="a100-llama2-7b",
        help="a named cost profile (a100-llama2-7b, unit) or a JSON file from 'calibrate'",
    )
    parser.add_argument("--policy", default="adaptive", choices=("adaptive", "static", "aimd", "large_fixed"))
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument(
        "--time-scale", type=float, default=None, help="divide inter-arrival times by this (2 = twice the arrival rate)"
    )
    scale.add_argument("--rate", type=float, default=None, help="scale time so the mean arrival rate is this (req/s)")
    parser.add_argument("--token-scale", type=float, default=1.0, help="multiply prompt and output lengths")
    parser.add_argument("--start", type=float, default=0.0, help="start of the trace slice (s, before scaling)")
    parser.add_argument("--duration", type=float, default=None, help="length of the trace slice (s, before scaling)")
    parser.add_argument("--max-prompt-tokens", type=int, default=7000)
    parser.add_argument("--max-output-tokens", type=int, default=1024)
    parser.add_argument("--json", type=Path, default=None, help="write the summary (and timeline) as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of load, window and P99 over time here")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from batchpilot_operator.sim.runner import default_spec, load_profile_spec, plot_runs, run_policy, slo_p99_s
    from batchpilot_operator.tuning.model_metrics import finite_or_none
    from batchpilot_runtime.replay.cost_model import load_cost_model
    from batchpilot_runtime.replay.trace import DEFAULT_TRACE_PATH, plan_replay, read_trace

    if args.plot:
        require_extra("matplotlib", "report", "simulate --plot")
    for name in ("time_scale", "token_scale", "rate", "duration"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    spec = load_profile_spec(args.profile) if args.profile else default_spec()
    cost = load_cost_model(args.cost_profile)
    trace_path = args.trace or DEFAULT_TRACE_PATH
    scaling, requests = plan_replay(
        read_trace(trace_path),
        time_scale=args.time_scale,
        rate_per_s=args.rate,
        token_scale=args.token_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        start_s=args.start,
        duration_s=args.duration,
    )
    began = time.perf_counter()
    run = run_policy(args.policy, requests, spec, cost)
    elapsed_s = time.perf_counter() - began
    summary = dict(run.summary)
    summary.update(
        policy=args.policy,
        trace=str(trace_path),
        scaling=scaling.describe(),
        cost_profile=cost.name,
        slo_p99_s=slo_p99_s(spec),
        latency_metric=spec.slo.latency_metric.value,
        slo_itl_p99_ms=spec.slo.inter_token_p99_ms,
        simulated_s=run.result.sim_end_s,
        wall_s=elapsed_s,
    )
    _print_summary(summary)
    if args.json:
        payload = dict(summary)
        payload["timeline"] = [
            {
                "t_s": p.t_s,
                "arrival_rate_per_s": p.arrival_rate_per_s,
                "p99_s": finite_or_none(p.p99_s),
                "queue_depth": p.queue_depth,
                "running": p.running,
                "kv_usage_ratio": p.kv_usage_ratio,
                "target_batch_size": p.target_batch_size,
                "hard_cap": p.hard_cap,
                "max_wait_ms": p.max_wait_ms,
                "tail_mark_ratio": p.tail_mark_ratio,
            }
            for p in run.result.timeline
        ]
        args.json.write_text(json.dumps(json_safe(payload), indent=2))
    if args.plot:
        plot_runs([run], slo_p99_s(spec), args.plot, f"{args.policy} on {trace_path.name} ({scaling.describe()})")
    return 0


def json_safe(value: Any) -> Any:
    """The value with non-finite floats made JSON-safe (NaN -> null, inf -> \"inf\"), recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else (None if math.isnan(value) else "inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def _print_summary(summary: dict[str, Any]) -> None:
    slo_s = summary["slo_p99_s"]
    slo = (
        f"SLO P99 {slo_s:.3f} s, met by {summary['slo_met_share']:.1%}"
        if math.isfinite(slo_s)
        else "no first-token SLO"
    )
    itl_slo_ms = summary.get("slo_itl_p99_ms")
    itl_slo = f" (SLO {itl_slo_ms:g} ms)" if itl_slo_ms is not None else ""
    lines = [
        f"policy {summary['policy']} on {summary['trace']} ({summary['scaling']}), cost {summary['cost_profile']}",
        f"  requests {summary['requests']} (rejected {summary['rejected']}, unfinished {summary['unfinished']}), "
        f"{summary['steps']} steps, simulated {summary['simulated_s']:.0f} s in {summary['wall_s']:.1f} s",
        f"  {summary['latency_metric']} P50 {summary['p50_s']:.3f} s  P99 {summary['p99_s']:.3f} s  "
        f"P999 {summary['p999_s']:.3f} s  ({slo})  inter-token P99 {summary['itl_p99_s'] * 1000:.1f} ms{itl_slo}",
        f"  goodput {summary['goodput_tokens_per_s']:.1f} tok/s  throughput {summary['throughput_tokens_per_s']:.1f} tok/s"
        f"  waits > 1 s {summary['share_wait_over_1s']:.2%}",
        f"  batch-hit ratio busy {summary['batch_hit_ratio_busy']:.2f} idle {summary['batch_hit_ratio_idle']:.2f}  "
        f"decisions/h {summary['decisions_per_hour']:.1f}  final window {summary['window']}",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
