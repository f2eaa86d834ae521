"""``batchpilot-runtime servegen``: sample a day-long replay from the Alibaba ServeGen statistics
(:mod:`batchpilot_runtime.replay.servegen`) and write it as a trace CSV.

    batchpilot-runtime servegen --model m-large --day 3 --hours 0-24 --target-rate 5.5 --seed 0 -o day.csv
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from batchpilot_runtime.cli.args import positive_float, positive_int
from batchpilot_runtime.replay.servegen import (
    SERVEGEN_ENV,
    describe,
    drifting_day,
    generate_replay,
    load_servegen,
    summarize,
    write_trace_csv,
)


def _hours(text: str) -> tuple[float, float]:
    parts = text.split("-")
    try:
        if len(parts) != 2:
            raise ValueError
        first, last = float(parts[0]), float(parts[1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START-END in hours, e.g. 0-24 or 18-22, got {text!r}") from None
    if not (0 <= first < last <= 24):
        raise argparse.ArgumentTypeError(f"need 0 <= START < END <= 24, got {text!r}")
    return first, last


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="m-large", help="ServeGen language model: m-large or m-small")
    parser.add_argument("--data", type=Path, help=f"folder of the tarballs (default ${SERVEGEN_ENV} or ../shared)")
    parser.add_argument("--day", type=int, help="0-based day (default: the day whose prompt lengths drift most)")
    parser.add_argument("--hours", type=_hours, default=(0.0, 24.0), help="span of the day, START-END (default 0-24)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--target-rate", type=positive_float, help="mean requests/s of the replay (scales all rates)")
    rate.add_argument("--rate-scale", type=positive_float, default=1.0, help="multiply every client's rate")
    parser.add_argument("--max-clients", type=positive_int, help="keep only the N busiest clients of the span")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", type=Path, help="write the replay as an Azure-format CSV (--trace CSV)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add a ``servegen`` subcommand (for a CLI that lists this module among its subcommands)."""
    parser = subparsers.add_parser("servegen", help="sample a day-long replay from Alibaba ServeGen statistics")
    add_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    data = load_servegen(args.model, args.data)
    day = drifting_day(data) if args.day is None else args.day
    first, last = args.hours
    replay = generate_replay(
        data,
        day,
        start_s=first * 3600.0,
        duration_s=(last - first) * 3600.0,
        rate_scale=args.rate_scale if args.target_rate is None else 1.0,
        seed=args.seed,
        target_mean_rate_per_s=args.target_rate,
        max_clients=args.max_clients,
    )
    summary = summarize(replay.requests, replay.duration_s)
    windows = describe(data, day)
    if args.output is not None:
        write_trace_csv(replay.requests, args.output)
    if args.json:
        report = {
            "replay": replay.describe(),
            "rate_scale": replay.rate_scale,
            "raw_mean_rate_per_s": replay.raw_mean_rate_per_s,
            "summary": summary.__dict__,
            "six_hour_windows_raw": [w.__dict__ for w in windows],
            "output": None if args.output is None else str(args.output),
        }
        print(json.dumps(report, indent=2))
        return 0
    print(replay.describe())
    print(
        f"{summary.requests} requests, {summary.mean_rate_per_s:.3f} req/s "
        f"(peak 10 min {summary.peak_10min_rate_per_s:.3f}); prompt P50 {summary.prompt_p50:g} "
        f"P99 {summary.prompt_p99:g}; output P50 {summary.output_p50:g} P99 {summary.output_p99:g}"
    )
    print("raw 6-hour windows of the day: start  req/s  prompt P50/P99  output P50/P99  token coverage")
    for w in windows:
        print(
            f"  {w.start_s / 3600:4.0f}h {w.mean_rate_per_s:8.1f} {w.prompt_p50:7d}/{w.prompt_p99:<7d} "
            f"{w.output_p50:6d}/{w.output_p99:<6d} {w.token_coverage:6.0%}"
        )
    if args.output is not None:
        print(f"wrote {args.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchpilot_runtime.cli.servegen",
        description="Sample a day-long request replay from the Alibaba ServeGen statistics (Apache-2.0, arXiv:2505.09999).",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (OSError, ValueError) as error:
        print(f"servegen: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
