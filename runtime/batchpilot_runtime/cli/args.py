"""Argument types and flags shared by the runtime's commands (``serve``, ``batchpilot-gate``...): each type
refuses what it cannot use with an argparse error that names the value, and every flag added here can
also come from ``BATCHPILOT_<FLAG>``."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from batchpilot_runtime.contract.admin_api import DEFAULT_ADMIN_PORT, DEFAULT_SERVE_PORT


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


def dtype_name(text: str) -> str:
    """One of the dtypes the model runs in (``model.device``)."""
    from batchpilot_runtime.model.device import DTYPE_NAMES

    if text not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DTYPE_NAMES)}, got {text!r}")
    return text


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


def add_lane_flag(window: argparse._ActionsContainer) -> None:
    """``--lane`` (repeatable; ``BATCHPILOT_LANE`` holds several, ';'-separated)."""
    lanes_default = os.environ.get(env_name("--lane"))
    window.add_argument(
        "--lane",
        action="append",
        metavar="NAME:target=N,cap=N,wait=MS[,tail=R][,reserved=N]",
        default=[s for s in (lanes_default or "").split(";") if s.strip()],
        help=f"a priority lane with its own window (repeatable) [env {env_name('--lane')}, ';'-separated]",
    )


def add_listen_flags(parser: argparse.ArgumentParser, *, serving: str) -> argparse._ArgumentGroup:
    """The network group both servers share: host, the two ports (``serving`` says what the serving port
    serves), the admin token, the ready file, the drain; returned for a server's own flags."""
    net = parser.add_argument_group("network")
    add_env_flag(net, "--host", default="127.0.0.1", help="address both ports bind (0.0.0.0 in a container)")
    add_env_flag(net, "--port", default=DEFAULT_SERVE_PORT, type=port_number, help=f"serving port: {serving}")
    add_env_flag(net, "--admin-port", default=DEFAULT_ADMIN_PORT, type=port_number, help="admin port: /admin/window")
    add_env_flag(
        net,
        "--admin-token-file",
        type=Path,
        help="file holding the admin bearer token; without it a random token is written to a new private "
        "temporary directory and its path is logged",
    )
    add_env_flag(
        net,
        "--ready-file",
        type=Path,
        help="write a JSON file with the pid, URLs and token file once ready (for port 0 and launchers)",
    )
    add_env_flag(net, "--drain-timeout-s", default=600.0, type=float, help="longest SIGTERM drain before forcing exit")
    return net
