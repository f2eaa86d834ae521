"""``batchpilot-operator``: the operator's command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from batchpilot_operator import __version__
from batchpilot_operator.cli.env import EnvParser
from batchpilot_runtime.cli.command import run_command


def _cmd_crd(args: argparse.Namespace) -> int:
    from batchpilot_operator.api.crd import render_crd

    text = render_crd()
    if args.output:
        for path in args.output:
            Path(path).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    """Every problem of every profile, one line each; a path without a profile is an error too."""
    from batchpilot_operator.api.manifests import load_profiles
    from batchpilot_operator.tuning.unused import unused_settings

    failures = 0
    for path in args.paths:
        loaded_profiles = load_profiles(Path(path))
        if not loaded_profiles:
            failures += 1
            print(f"{path}: no BatchProfile found (nothing to validate)")
        for loaded in loaded_profiles:
            if loaded.spec is None:
                failures += 1
                for problem in loaded.problems or (loaded.error or "invalid",):
                    print(f"{loaded.source}: {loaded.name or '?'}: INVALID: {problem}")
                continue
            print(f"{loaded.source}: {loaded.namespace}/{loaded.name}: ok")
            spec = loaded.spec
            if spec.given_window is None:
                w = spec.window
                budget = "unset" if w.max_prefill_tokens is None else str(w.max_prefill_tokens)
                window = (
                    f"target {w.target_batch_size}, cap {w.hard_cap}, wait {w.max_wait_ms} ms, "
                    f"tail-mark ratio {w.tail_mark_ratio:g}, budget {budget}"
                )
                where = f"{loaded.source}: {loaded.namespace}/{loaded.name}"
                print(f"{where}: starting window {window}, {spec.window_source}")
            for warning in unused_settings(loaded.spec):
                print(f"{loaded.source}: {loaded.namespace}/{loaded.name}: warning: {warning}")
    return 1 if failures else 0


def _cmd_reference(args: argparse.Namespace) -> int:
    from batchpilot_operator.api.reference import render_reference

    sys.stdout.write(render_reference())
    return 0


# Modules that each define ``register(subparsers)`` adding their own subcommand;
# they import their heavy dependencies inside the handler, so --help stays fast.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "batchpilot_operator.cli.demo",
    "batchpilot_operator.cli.commands",
    "batchpilot_operator.cli.simulate",
)


def build_parser() -> argparse.ArgumentParser:
    # EnvParser: `run` and `local` let each flag fall back to BATCHPILOT_<FLAG> (cli/env.py).
    parser = EnvParser(
        prog="batchpilot-operator",
        description="Keep every LLM model's batching window tuned to its live load.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    crd = sub.add_parser("crd", help="print the BatchProfile CustomResourceDefinition generated from the models")
    crd.add_argument(
        "-o", "--output", action="append", metavar="FILE", help="write to FILE instead of stdout (repeatable)"
    )
    crd.set_defaults(handler=_cmd_crd)

    validate = sub.add_parser(
        "validate",
        help="validate BatchProfile YAML files or folders (exit 1 naming each bad field)",
        description=(
            "Validate BatchProfiles as the API server and the operator would, printing every problem of a "
            "file in one run. Exit 1 when a profile is invalid or a PATH holds no BatchProfile; settings "
            "the tuning policy will never use are printed as warnings (exit 0)."
        ),
    )
    validate.add_argument("paths", nargs="+", metavar="PATH")
    validate.set_defaults(handler=_cmd_validate)

    reference = sub.add_parser("reference", help="print the BatchProfile field reference (Markdown)")
    reference.set_defaults(handler=_cmd_reference)

    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), argv, user_errors=(yaml.YAMLError,))


if __name__ == "__main__":
    raise SystemExit(main())
