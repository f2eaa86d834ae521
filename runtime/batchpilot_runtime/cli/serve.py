"""``batchpilot-runtime serve``: run one model behind the OpenAI-compatible API and the admin API.

Every flag can also be set by an environment variable ``BATCHPILOT_<FLAG>`` (``--hard-cap``
-> ``BATCHPILOT_HARD_CAP``); a flag on the command line wins. ``--lane`` repeats; its
variable ``BATCHPILOT_LANE`` holds several lanes separated by ``;``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from batchpilot_runtime.cli.args import add_env_flag, add_lane_flag, add_listen_flags, dtype_name, positive_int
from batchpilot_runtime.engine.watchdog import DEFAULT_STALL_TIMEOUT_S
from batchpilot_runtime.model.kernels import BATCH_INVARIANT_ENV, resolve_batch_invariant


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
    add_env_flag(model, "--model-name", help="name reported in /v1/models and in every metric's model label")
    source = model.add_mutually_exclusive_group()
    add_env_flag(source, "--preset", default="tiny", help="architecture preset with random weights (no download)")
    add_env_flag(
        source,
        "--checkpoint",
        help="a named model (smollm2-135m-instruct), a Llama GGUF file, or a local directory with a safetensors "
        "checkpoint in HF Llama naming",
    )
    add_env_flag(model, "--seed", default=0, type=int, help="seed of the random weights")
    add_env_flag(model, "--device", help="torch device (default: CUDA when available, else CPU)")
    add_env_flag(
        model,
        "--dtype",
        type=dtype_name,
        help="weights, activations and KV cache: float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on "
        "CPU; bfloat16 on a CPU with AVX-512 bf16 or AMX served 1.2-1.3x the tokens/s in the runtime benchmark, with "
        "bf16 rounding)",
    )
    add_env_flag(
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
    add_env_flag(
        model,
        "--kv-cache-tokens",
        type=positive_int,
        help="KV-cache capacity in tokens (default: 65536 on CPU, 85%% of free memory on CUDA)",
    )
    add_env_flag(
        model,
        "--max-model-len",
        type=positive_int,
        help="longest prompt + output of one request (default: the model's context length)",
    )


def _add_window_args(parser: argparse.ArgumentParser) -> None:
    window = parser.add_argument_group("batching window (the operator retunes these at run time)")
    add_env_flag(window, "--target-batch-size", default=8, type=positive_int, help="batch size admission waits for")
    add_env_flag(window, "--hard-cap", default=16, type=positive_int, help="most sequences running at once")
    add_env_flag(
        window, "--max-wait-ms", default=20, type=int, help="longest wait of the oldest request for the target"
    )
    add_env_flag(
        window, "--tail-mark-ratio", default=2.0, type=float, help="tail-mark requests waiting this x P50 wait"
    )
    add_env_flag(window, "--batching", default="continuous", choices=("continuous", "static"), help="batching mode")
    add_env_flag(
        window,
        "--max-queue",
        default=1024,
        type=positive_int,
        help="waiting requests (all lanes) before new ones get 429",
    )
    add_env_flag(
        window,
        "--max-prefill-tokens",
        type=positive_int,
        help="prefill tokens per step (chunked prefill); unset = whole prompts",
    )
    add_lane_flag(window)


def _add_network_args(parser: argparse.ArgumentParser) -> None:
    net = add_listen_flags(parser, serving="/v1, /metrics, /healthz, /readyz")
    add_env_flag(
        net,
        "--engine-stall-timeout-s",
        default=DEFAULT_STALL_TIMEOUT_S,
        type=float,
        help="seconds pending requests may go without an engine step before /healthz and /readyz fail "
        "(keep it above the longest prefill step)",
    )
    add_env_flag(net, "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")
    add_env_flag(
        net,
        "--step-log",
        type=Path,
        help="write every engine step (its prompt tokens, decoding sequences, KV tokens and seconds) to this file "
        "as JSON lines, for `batchpilot-runtime calibrate --from-step-log`",
    )


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
    if args.step_log is not None and not args.step_log.parent.is_dir():
        raise ValueError(f"--step-log: no directory {str(args.step_log.parent)!r} to write {args.step_log.name!r} in")
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
        dtype=args.dtype,
        threads=args.threads,
        batch_invariant=resolve_batch_invariant(args.batch_invariant),
        ready_file=args.ready_file,
        drain_timeout_s=args.drain_timeout_s,
        engine_stall_timeout_s=args.engine_stall_timeout_s,
        log_level=args.log_level,
        step_log=args.step_log,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from batchpilot_runtime.server.logs import configure_logging
    from batchpilot_runtime.server.runtime import Runtime

    config = config_from_args(args)
    configure_logging(config.log_level)
    return asyncio.run(Runtime(config).serve())
