"""``batchpilot-runtime loadgen``: replay a trace against runtimes and print a JSON summary.

The shared Azure conversation trace is the default workload. Scale time with --time-scale
(2 = twice the arrival rate) or --rate (requests/s on average), and tokens with --token-scale,
--max-prompt-tokens and --max-output-tokens so that a small CPU model is loaded realistically.
The summary (throughput, P50/P99/P999 of TTFT and end-to-end latency, outcome counts and the
scaling used) is printed and, with --json, written to a file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from batchpilot_runtime.cli.args import positive_float, positive_int


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "loadgen",
        help="replay a request trace against runtimes (open loop) and summarize latency and throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="URL[,model=NAME][,lane=LANE]",
        help="serving URL of a runtime (repeatable); the model is read from /v1/models if not given",
    )
    parser.add_argument(
        "--fanout",
        choices=("each", "round-robin"),
        default="each",
        help="each: every endpoint gets the whole trace; round-robin: the trace is spread over them",
    )
    trace = parser.add_argument_group("trace and scaling")
    trace.add_argument("--trace", type=Path, help="CSV in the Azure trace format (default: the shared Azure trace)")
    timing = trace.add_mutually_exclusive_group()
    timing.add_argument(
        "--time-scale", type=positive_float, default=1.0, help="divide inter-arrival times by this (default 1)"
    )
    timing.add_argument("--rate", type=positive_float, help="mean arrival rate in requests/s (sets the time scale)")
    trace.add_argument("--token-scale", type=positive_float, default=1.0, help="multiply token counts (default 1)")
    trace.add_argument("--max-prompt-tokens", type=positive_int, help="clamp prompt lengths")
    trace.add_argument("--max-output-tokens", type=positive_int, help="clamp output lengths")
    trace.add_argument("--start-s", type=float, default=0.0, help="start of the slice of the trace, in seconds")
    trace.add_argument("--duration-s", type=positive_float, help="length of the slice (original seconds)")
    trace.add_argument("--limit", type=positive_int, help="send only the first N requests of the slice")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthesized prompts and of sampling")
    parser.add_argument("--timeout-s", type=positive_float, default=600.0, help="per-request timeout")
    parser.add_argument("--json", type=Path, help="also write the summary to this file")
    parser.add_argument("--results", action="store_true", help="include every request's result in the JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (never shown off a terminal)")
    parser.set_defaults(handler=_cmd_loadgen)


def _cmd_loadgen(args: argparse.Namespace) -> int:
    import asyncio

    from batchpilot_runtime.replay.loadgen import Endpoint, run_load
    from batchpilot_runtime.replay.trace import DEFAULT_TRACE_PATH, plan_replay, read_trace

    endpoints = [Endpoint.parse(spec) for spec in args.endpoint]
    notes: dict[str, object] = {"trace": str(args.trace or DEFAULT_TRACE_PATH)}
    if args.rate is not None:
        notes["target_rate_per_s"] = args.rate
    scaling, requests = plan_replay(
        read_trace(args.trace or DEFAULT_TRACE_PATH),
        time_scale=args.time_scale,
        rate_per_s=args.rate,
        token_scale=args.token_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        start_s=args.start_s,
        duration_s=args.duration_s,
        limit=args.limit,
    )
    summary = asyncio.run(
        run_load(
            endpoints,
            requests,
            fanout=args.fanout,
            seed=args.seed,
            scaling=scaling,
            request_timeout_s=args.timeout_s,
            progress=not args.no_progress,
            notes=notes,
        )
    )
    text = summary.to_json(include_results=args.results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0
