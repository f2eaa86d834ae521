"""``batchpilot-gate``: the batching window, live, in front of any OpenAI-compatible engine.

Every flag can also be set by an environment variable ``BATCHPILOT_<FLAG>`` (``--hard-cap`` ->
``BATCHPILOT_HARD_CAP``); a flag on the command line wins. ``--lane`` repeats; its variable
``BATCHPILOT_LANE`` holds several lanes separated by ``;``. The window flags mean what they mean
for ``batchpilot-runtime serve``; the cap counts requests in flight to the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchpilot_runtime.cli.args import add_env_flag, add_lane_flag, add_listen_flags, env_name, positive_int
from batchpilot_runtime.contract.admin_api import DEFAULT_ADMIN_PORT, DEFAULT_SERVE_PORT, LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.gate.admission import GateLimits
from batchpilot_runtime.gate.proxy import HANG_UP_FINISH, HANG_UP_MODES, HANG_UP_STOP, GateApp
from batchpilot_runtime.gate.service import Gate
from batchpilot_runtime.gate.upstream import UpstreamSlots
from batchpilot_runtime.server.admin import create_admin_app
from batchpilot_runtime.server.config import parse_lane, window_from_flags
from batchpilot_runtime.server.listen import bind_socket, http_server, load_admin_token, url_of
from batchpilot_runtime.server.logs import configure_logging
from batchpilot_runtime.server.ready import RuntimeInfo, write_ready_file

logger = logging.getLogger("batchpilot.gate")

# Slots beyond --max-hard-cap: admission never uses them; a margin, not a need.
SPARE_SLOTS = 8


@dataclass(frozen=True)
class GateConfig:
    upstream: str
    model_name: str
    window: Window
    lanes: tuple[LaneWindow, ...] = ()
    limits: GateLimits = field(default_factory=GateLimits)
    max_model_len: int = 4096
    host: str = "127.0.0.1"
    port: int = DEFAULT_SERVE_PORT
    admin_port: int = DEFAULT_ADMIN_PORT
    admin_token_file: Path | None = None
    ready_file: Path | None = None
    connect_timeout_s: float = 5.0
    drain_timeout_s: float = 600.0
    log_level: str = "info"
    on_hang_up: str = HANG_UP_STOP
    engine_metrics_path: str | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchpilot-gate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    upstream = parser.add_argument_group("upstream engine")
    add_env_flag(upstream, "--upstream", help="the engine's base URL, e.g. http://127.0.0.1:8000 (required)")
    add_env_flag(upstream, "--model-name", help="the model's name in the metrics' model label (required)")
    add_env_flag(
        upstream,
        "--max-hard-cap",
        default=256,
        type=positive_int,
        help="the engine's own cap on running requests (vLLM --max-num-seqs): no window may exceed it",
    )
    add_env_flag(
        upstream,
        "--max-model-len",
        default=4096,
        type=positive_int,
        help="the engine's longest sequence, reported in the admin API's capacity",
    )
    add_env_flag(upstream, "--connect-timeout-s", default=5.0, type=float, help="connecting to the upstream")
    add_env_flag(
        upstream,
        "--engine-metrics",
        metavar="PATH",
        help=(
            "the engine's own metrics path (llama-server: /metrics), appended to the gate's /metrics with "
            "each series labelled model=--model-name, so that one scrape of the gate reads both"
        ),
    )
    add_env_flag(
        upstream,
        "--on-hang-up",
        default=HANG_UP_STOP,
        choices=HANG_UP_MODES,
        help=(
            "a client that leaves mid-answer keeps its slot until the upstream ends the exchange; "
            f"{HANG_UP_STOP}: the upstream is told (its connection half-closed) and stops; "
            f"{HANG_UP_FINISH}: it is not, and finishes the answer (exact for an engine that closes "
            "the connection before its abort takes effect, at the cost of the abandoned answer's work)"
        ),
    )
    window = parser.add_argument_group("batching window (the operator retunes these at run time)")
    add_env_flag(
        window, "--target-batch-size", default=8, type=positive_int, help="requests in flight admission waits for"
    )
    add_env_flag(window, "--hard-cap", default=16, type=positive_int, help="most requests in flight to the upstream")
    add_env_flag(
        window, "--max-wait-ms", default=20, type=int, help="longest wait of the oldest request for the target"
    )
    add_env_flag(
        window, "--tail-mark-ratio", default=2.0, type=float, help="tail-mark requests waiting this x P50 wait"
    )
    add_env_flag(
        window, "--max-queue", default=1024, type=positive_int, help="waiting requests before new ones get 429"
    )
    add_lane_flag(window)
    net = add_listen_flags(parser, serving="/v1, /metrics")
    add_env_flag(net, "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")
    return parser


def config_from_args(args: argparse.Namespace) -> GateConfig:
    """The checked configuration; ``ValueError`` naming the flag."""
    for flag, value in (("--upstream", args.upstream), ("--model-name", args.model_name)):
        if not value:
            raise ValueError(f"{flag} is required (or {env_name(flag)})")
    if not str(args.upstream).startswith(("http://", "https://")):
        raise ValueError(f"--upstream: expected an http:// or https:// URL, got {args.upstream!r}")
    window = window_from_flags(args.target_batch_size, args.hard_cap, args.max_wait_ms, args.tail_mark_ratio)
    lanes = tuple(parse_lane(spec, window) for spec in args.lane)
    names = [lane.name for lane in lanes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lane: lane(s) given twice: {', '.join(duplicates)}")
    if window.hard_cap > args.max_hard_cap:
        raise ValueError(
            f"--hard-cap {window.hard_cap} exceeds --max-hard-cap {args.max_hard_cap}, the engine's own cap"
        )
    for name, value in (("--connect-timeout-s", args.connect_timeout_s), ("--drain-timeout-s", args.drain_timeout_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    return GateConfig(
        upstream=args.upstream.rstrip("/"),
        model_name=args.model_name,
        window=window,
        lanes=lanes,
        limits=GateLimits(max_queue=args.max_queue, max_hard_cap=args.max_hard_cap),
        max_model_len=args.max_model_len,
        host=args.host,
        port=args.port,
        admin_port=args.admin_port,
        admin_token_file=args.admin_token_file,
        ready_file=args.ready_file,
        connect_timeout_s=args.connect_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        log_level=args.log_level,
        on_hang_up=args.on_hang_up,
        engine_metrics_path=args.engine_metrics or None,
    )


async def run_gate(
    config: GateConfig,
    on_ready: Callable[[RuntimeInfo, Gate], None] | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None), then drain: new requests
    get 503, those admitted or waiting finish (at most ``drain_timeout_s``), then both ports close."""
    loop = asyncio.get_running_loop()
    token, token_file = load_admin_token(config.admin_token_file)
    gate = Gate(
        config.model_name,
        config.window,
        {lane.name: lane for lane in config.lanes},
        config.limits,
        token,
        config.max_model_len,
    )
    own_stop = stop is None
    stop = stop or asyncio.Event()
    if own_stop:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    async with UpstreamSlots(
        config.upstream, config.limits.max_hard_cap + SPARE_SLOTS, config.connect_timeout_s
    ) as slots:
        serve_sock = bind_socket(config.host, config.port)
        admin_sock = bind_socket(config.host, config.admin_port)
        servers = [
            http_server(GateApp(gate, config.upstream, slots, config.on_hang_up, config.engine_metrics_path)),
            http_server(create_admin_app(gate, "batchpilot gate admin")),
        ]
        tasks = [
            asyncio.ensure_future(s.serve(sockets=[k])) for s, k in zip(servers, (serve_sock, admin_sock), strict=True)
        ]
        try:
            while not all(s.started for s in servers):
                if any(t.done() for t in tasks):
                    raise RuntimeError("an HTTP server stopped during start-up")
                await asyncio.sleep(0.01)
            info = RuntimeInfo(
                pid=os.getpid(),
                model=config.model_name,
                serve_url=url_of(config.host, serve_sock),
                admin_url=url_of(config.host, admin_sock),
                admin_token_file=str(token_file),
            )
            if config.ready_file is not None:
                write_ready_file(config.ready_file, info)
            logger.info(
                "ready",
                extra={"serve_url": info.serve_url, "upstream": config.upstream, "window": config.window.describe()},
            )
            if on_ready is not None:
                on_ready(info, gate)
            await stop.wait()
            gate.draining = True
            try:
                await asyncio.wait_for(gate.idle.wait(), config.drain_timeout_s)
            except TimeoutError:
                logger.warning(
                    "drain cut short",
                    extra={"waiting": gate.admission.num_waiting, "running": gate.admission.num_running},
                )
        finally:
            for server in servers:
                server.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)
            if own_stop:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
    return 0


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    """uvloop's when installed (uvicorn[standard] brings it; vLLM and SGLang serve on it): every chunk
    crosses the loop twice, and uvloop's transports halve what that costs."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        configure_logging(config.log_level)
        return _event_loop_runner()(run_gate(config))
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as error:
        print(f"batchpilot-gate: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
