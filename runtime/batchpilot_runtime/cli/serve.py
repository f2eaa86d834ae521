"""``batchpilot-runtime serve``: run one model behind the OpenAI-compatible API and the admin API.

Every flag can also be set by an environment variable ``BATCHPILOT_<FLAG>`` (``--hard-cap``
-> ``BATCHPILOT_HARD_CAP``); a flag on the command line wins. ``--lane`` repeats; its
variable ``BATCHPILOT_LANE`` holds several lanes separated by ``;``.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from batchpilot_runtime.cli.args import positive_int
from batchpilot_runtime.contract.admin_api import DEFAULT_ADMIN_PORT, DEFAULT_SERVE_PORT
from batchpilot_runtime.engine.watchdog import DEFAULT_STALL_TIMEOUT_S
from batchpilot_runtime.model.kernels import BATCH_INVARIANT_ENV, resolve_batch_invariant

ENV_PREFIX = "BATCHPILOT_"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _add(parser: argparse._ActionsContainer, flag: str, *, default: Any = None, help: str, **kwargs: Any) -> None:
    """Add a flag whose default comes from its environment variable (argparse applies ``type`` to it)."""
    variable = env_name(flag)
    value = os.environ.get(variable, default)
    shown = "" if default is None else f" (default: {default})"
    parser.add_argument(flag, default=value, help=f"{help}{shown} [env {variable}]", **kwargs)


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535 (0 picks a free one), got {value}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model (OpenAI-compatible API, /metrics, and the admin window API)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(parser)
    _add_window_args(parser)
    _add_network_args(parser)
    parser.set_defaults(handler=_cmd_serve)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    _add(model, "--model-name", help="name reported in /v1/models and in every metric's model label")
    source = model.add_mutually_exclusive_group()
    _add(source, "--preset", default="tiny", help="architecture preset with random weights (no download)")
    _add(
        source,
        "--checkpoint",
        help="a named model (smollm2-135m-instruct), a Llama GGUF file, or a local directory with a safetensors "
        "checkpoint in HF Llama naming",
    )
    _add(model, "--seed", default=0, type=int, help="seed of the random weights")
    _add(model, "--device", help="torch device (default: CUDA when available, else CPU)")
    _add(
        model,
        "--threads",
        type=positive_int,
        help="torch intra-op threads on CPU (default: torch's choice; 1 when several runtimes share a small host)",
    )
    model.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batch-invariant kernels: each request's tokens bitwise as if it ran alone, in any batch, at a cost "
        f"in speed (default: off, the fastest kernels) [env {BATCH_INVARIANT_ENV}=1]",
    )
    _add(
        model,
        "--kv-cache-tokens",
        type=positive_int,
        help="KV-cache capacity in tokens (default: 65536 on CPU, 85%% of free memory on CUDA)",
    )
    _add(
        model,
        "--max-model-len",
        type=positive_int,
        help="longest prompt + output of one request (default: the model's context length)",
    )


def _add_window_args(parser: argparse.ArgumentParser) -> None:
    window = parser.add_argument_group("batching window (the operator retunes these at run time)")
    _add(window, "--target-batch-size", default=8, type=positive_int, help="batch size admission waits for")
    _add(window, "--hard-cap", default=16, type=positive_int, help="most sequences running at once")
    _add(window, "--max-wait-ms", default=20, type=int, help="longest wait of the oldest request for the target")
    _add(window, "--tail-mark-ratio", default=2.0, type=float, help="tail-mark requests waiting this x P50 wait")
    _add(window, "--batching", default="continuous", choices=("continuous", "static"), help="batching mode")
    _add(
        window,
        "--max-queue",
        default=1024,
        type=positive_int,
        help="waiting requests (all lanes) before new ones get 429",
    )
    _add(
        window,
        "--max-prefill-tokens",
        type=positive_int,
        help="prefill tokens per step (chunked prefill); unset = whole prompts",
    )
    lanes_default = os.environ.get(env_name("--lane"))
    window.add_argument(
        "--lane",
        action="append",
        metavar="NAME:target=N,cap=N,wait=MS[,tail=R][,reserved=N]",
        default=[s for s in (lanes_default or "").split(";") if s.strip()],
        help=f"a priority lane with its own window (repeatable) [env {env_name('--lane')}, ';'-separated]",
    )


def _add_network_args(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("network")
    _add(net, "--host", default="127.0.0.1", help="address both ports bind (0.0.0.0 in a container)")
    _add(net, "--port", default=DEFAULT_SERVE_PORT, type=_port, help="serving port: /v1, /metrics, /healthz, /readyz")
    _add(net, "--admin-port", default=DEFAULT_ADMIN_PORT, type=_port, help="admin port: /admin/window")
    _add(
        net,
        "--admin-token-file",
        type=Path,
        help="file holding the admin bearer token; without it a random token is written to a new private "
        "temporary directory and its path is logged",
    )
    _add(
        net,
        "--ready-file",
        type=Path,
        help="write a JSON file with the pid, URLs and token file once ready (for port 0 and launchers)",
    )
    _add(net, "--drain-timeout-s", default=600.0, type=float, help="longest SIGTERM drain before forcing exit")
    _add(
        net,
        "--engine-stall-timeout-s",
        default=DEFAULT_STALL_TIMEOUT_S,
        type=float,
        help="seconds pending requests may go without an engine step before /healthz and /readyz fail "
        "(keep it above the longest prefill step)",
    )
    _add(net, "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")


def config_from_args(args: argparse.Namespace) -> Any:
    from batchpilot_runtime.model.sources import resolve_checkpoint
    from batchpilot_runtime.server.config import ServeConfig, parse_lane, window_from_flags

    window = window_from_flags(args.target_batch_size, args.hard_cap, args.max_wait_ms, args.tail_mark_ratio)
    lanes = tuple(parse_lane(spec, window) for spec in args.lane)
    names = [lane.name for lane in lanes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lane: lane(s) given twice: {', '.join(duplicates)}")
    source = None if args.checkpoint is None else resolve_checkpoint(args.checkpoint)
    if args.drain_timeout_s <= 0:
        raise ValueError(f"--drain-timeout-s must be > 0, got {args.drain_timeout_s}")
    if not (math.isfinite(args.engine_stall_timeout_s) and args.engine_stall_timeout_s > 0):
        raise ValueError(f"--engine-stall-timeout-s must be a finite number > 0, got {args.engine_stall_timeout_s}")
    return ServeConfig(
        model_name=args.model_name or (source.name if source else f"batchpilot-{args.preset}"),
        window=window,
        lanes=lanes,
        preset=args.preset,
        checkpoint=None if source is None else source.path,
        host=args.host,
        port=args.port,
        admin_port=args.admin_port,
        admin_token_file=args.admin_token_file,
        kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
        batching=args.batching,
        max_queue=args.max_queue,
        max_prefill_tokens=args.max_prefill_tokens,
        seed=args.seed,
        device=args.device,
        threads=args.threads,
        batch_invariant=resolve_batch_invariant(args.batch_invariant),
        ready_file=args.ready_file,
        drain_timeout_s=args.drain_timeout_s,
        engine_stall_timeout_s=args.engine_stall_timeout_s,
        log_level=args.log_level,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from batchpilot_runtime.server.logs import configure_logging
    from batchpilot_runtime.server.runtime import Runtime

    config = config_from_args(args)
    configure_logging(config.log_level)
    return asyncio.run(Runtime(config).serve())
