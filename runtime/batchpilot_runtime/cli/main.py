"""``batchpilot-runtime``: the runtime's command line."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Sequence

from batchpilot_runtime import __version__
from batchpilot_runtime.cli.command import run_command

# Modules that each define ``register(subparsers)`` adding their own subcommand;
# they import torch and the web stack inside the handler, so --help stays fast.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "batchpilot_runtime.cli.serve",
    "batchpilot_runtime.cli.loadgen",
    "batchpilot_runtime.cli.generate",
    "batchpilot_runtime.cli.calibrate",
    "batchpilot_runtime.cli.time_step",
    "batchpilot_runtime.cli.servegen",
)


def _cmd_metrics(args: argparse.Namespace) -> int:
    from batchpilot_runtime.contract.metric_names import RUNTIME_METRICS

    if args.json:
        rows = [
            {"name": m.name, "type": m.type, "labels": list(m.labels), "help": m.help, "buckets": list(m.buckets)}
            for m in RUNTIME_METRICS
        ]
        print(json.dumps(rows, indent=2))
    else:
        for m in RUNTIME_METRICS:
            print(f"{m.name:45s} {m.type:9s} {{{','.join(m.labels)}}}  {m.help}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchpilot-runtime",
        description="The batchpilot runtime: a continuous-batching LLM worker whose window the operator tunes.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    metrics = sub.add_parser("metrics", help="list the metrics the runtime exports (the metric contract)")
    metrics.add_argument("--json", action="store_true", help="print JSON instead of a table")
    metrics.set_defaults(handler=_cmd_metrics)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
