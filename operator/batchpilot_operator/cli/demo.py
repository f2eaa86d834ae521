"""``batchpilot-operator demo``: the embedded demo (no cluster, no GPU).

First the real chat model (smollm2-135m-instruct) answers a few questions over the chat API,
alone on the machine (``--no-answers`` skips it). Then two runtimes serve two models that want different windows (an interactive one under a
tight SLO, an offline one under a loose SLO), a slice of the Azure conversation trace is
replayed against them twice — with the profiles' windows held
(static), then retuned by the operator (adaptive) — and a self-contained HTML report with
its figures as JSON beside it is written. The last line printed is ``report: PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

from batchpilot_operator.cli.extras import require_extra
from batchpilot_operator.demo.settings import DEFAULT_DURATION_S, DURATION_ENV


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the demo: two runtimes, a trace replay, static vs adaptive windows, an HTML report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        default=None,
        help=f"seconds of replayed arrivals in all, half per phase (default: ${DURATION_ENV} or "
        f"{DEFAULT_DURATION_S:g}); start-up, draining and the report come on top; the shipped 15-minute "
        "trace excerpt lasts for up to about 1,100 s",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        default=Path("out/demo"),
        help="folder for the report, its JSON, the profiles and every child's log (default: ./out/demo)",
    )
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="plain progress lines instead of the live view (the default when stdout is not a terminal)",
    )
    parser.add_argument(
        "--preset",
        metavar="NAME",
        default=None,
        help="run every model on this runtime preset (default: tiny; e.g. small on a fast machine)",
    )
    parser.add_argument(
        "--no-prometheus",
        action="store_true",
        help="let the operator scrape the runtimes itself even when prometheus is installed",
    )
    parser.add_argument(
        "--no-answers",
        action="store_true",
        help="skip the real chat model (smollm2-135m-instruct) answering a few questions before the replay",
    )
    parser.add_argument(
        "--token-scale",
        type=float,
        metavar="X",
        default=None,
        help="scale the chat model's prompt lengths and prefill budget by X in (0, 1] (default: from a "
        "prefill step timed on this host first, so that its surge fits the host)",
    )
    parser.add_argument("--trace", type=Path, metavar="CSV", default=None, help="a trace in the Azure trace format")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts (default: 0)")
    parser.set_defaults(handler=_cmd_demo)


def _reproduce(args: argparse.Namespace, duration_s: float) -> str:
    """The command line that replays the same run (the output folder aside)."""
    words = ["batchpilot-operator", "demo", "--duration", f"{duration_s:g}"]
    if args.preset:
        words += ["--preset", args.preset]
    if args.no_prometheus:
        words.append("--no-prometheus")
    if args.no_answers:
        words.append("--no-answers")
    if args.trace:
        words += ["--trace", str(args.trace)]
    if args.seed:
        words += ["--seed", str(args.seed)]
    if args.token_scale is not None:
        words += ["--token-scale", f"{args.token_scale:g}"]
    return " ".join(shlex.quote(w) for w in words)


def _cmd_demo(args: argparse.Namespace) -> int:
    from batchpilot_operator.demo.children import DemoError
    from batchpilot_operator.demo.run import run_demo
    from batchpilot_operator.demo.settings import DemoSettings, duration_from_env

    # Checked before any child starts: the runtimes need torch, the report matplotlib.
    require_extra("torch", "runtime", "the demo")
    require_extra("matplotlib", "report", "the demo's report")
    duration_s = args.duration if args.duration is not None else duration_from_env()
    settings = DemoSettings(
        duration_s=duration_s,
        out_dir=args.out.resolve(),
        live=not args.no_live and sys.stdout.isatty(),
        preset_override=args.preset,
        prometheus=not args.no_prometheus,
        answers=not args.no_answers,
        trace_path=args.trace,
        seed=args.seed,
        token_scale=args.token_scale,
        command=_reproduce(args, duration_s),
    )
    try:
        html_path = run_demo(settings)
    except DemoError as error:
        print(f"batchpilot-operator demo: failed: {error}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError) as stop:
        print("batchpilot-operator demo: interrupted; its child processes were stopped", file=sys.stderr)
        return 130 if isinstance(stop, KeyboardInterrupt) else 143
    print(f"report: {html_path}", flush=True)
    return 0
