"""Argument types shared by the runtime's subcommands: each refuses what it cannot use with an
argparse error that names the value."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any


def positive_float(text: str) -> float:
    """A finite number > 0 (inf and nan refused)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


ENV_PREFIX = "BATCHPILOT_"


def env_name(flag: str) -> str:
    """``BATCHPILOT_<FLAG>`` of a long option (``--hard-cap`` -> ``BATCHPILOT_HARD_CAP``)."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_env_flag(
    parser: argparse._ActionsContainer, flag: str, *, default: Any = None, help: str, **kwargs: Any
) -> None:
    """Add a flag whose default comes from ``BATCHPILOT_<FLAG>`` (argparse applies ``type`` to it, so a
    bad value is a usage error); the flag on the command line wins, and ``--help`` names the variable."""
    variable = env_name(flag)
    value = os.environ.get(variable, default)
    shown = "" if default is None else f" (default: {default})"
    parser.add_argument(flag, default=value, help=f"{help}{shown} [env {variable}]", **kwargs)


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535 (0 picks a free one), got {value}")
    return value
