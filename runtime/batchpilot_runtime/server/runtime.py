"""One runtime process: the engine, the serving port and the admin port on one event loop.

Lifecycle: bind both ports -> serve health (not ready) while the model loads -> ready ->
on SIGTERM/SIGINT (or ``request_drain``) drain: readiness false, new completions 503,
accepted ones finish, the engine stops, both servers close -> exit code 0.

Another process finds a runtime through its ready file (``--ready-file``): a JSON object
written atomically once both ports answer and the model is loaded (see ``RuntimeInfo``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import cast

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE
from batchpilot_runtime.server.admin import create_admin_app
from batchpilot_runtime.server.app import create_serving_app
from batchpilot_runtime.server.config import ServeConfig
from batchpilot_runtime.server.context import LoadedModel, ServingContext, TextCodec
from batchpilot_runtime.server.listen import QuietServer, bind_socket, http_server, load_admin_token, url_of
from batchpilot_runtime.server.metrics import MetricsExporter
from batchpilot_runtime.server.ready import RuntimeInfo, write_ready_file
from batchpilot_runtime.server.step_log import StepLogObserver

logger = logging.getLogger("batchpilot.runtime")


def build_loaded_model(config: ServeConfig, metrics: MetricsExporter) -> LoadedModel:
    """Build the engine (torch; slow) and wrap it for the async server. Runs in a worker thread."""
    import torch

    from batchpilot_runtime.engine.async_engine import AsyncEngine
    from batchpilot_runtime.engine.engine import Engine

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    step_log = None if config.step_log is None else StepLogObserver(metrics, config.step_log)
    engine = Engine.build(
        model_name=config.model_name,
        window=config.window,
        preset=config.preset,
        checkpoint=config.checkpoint,
        kv_cache_tokens=config.kv_cache_tokens,
        lanes={lane.name: lane for lane in config.lanes} or None,
        batching=config.batching,
        max_queue=config.max_queue,
        max_prefill_tokens_per_step=config.max_prefill_tokens,
        max_model_len=config.max_model_len,
        seed=config.seed,
        device=config.device,
        dtype=config.dtype,
        batch_invariant=config.batch_invariant,
        observer=metrics if step_log is None else step_log,
    )
    async_engine = AsyncEngine(engine, stall_timeout_s=config.engine_stall_timeout_s)
    return LoadedModel(
        engine=async_engine,
        tokenizer=cast(TextCodec, engine.tokenizer),
        max_model_len=engine.max_model_len,
        on_stop=None if step_log is None else step_log.close,
    )


class Runtime:
    def __init__(
        self,
        config: ServeConfig,
        build: Callable[[ServeConfig, MetricsExporter], LoadedModel] = build_loaded_model,
    ) -> None:
        self.config = config
        self._build = build
        token, self.admin_token_file = load_admin_token(config.admin_token_file)
        self.metrics = MetricsExporter(config.model_name, [DEFAULT_LANE, *(lane.name for lane in config.lanes)])
        self.ctx = ServingContext(model_name=config.model_name, metrics=self.metrics, admin_token=token)
        self.info: RuntimeInfo | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested: asyncio.Event | None = None
        self._force: asyncio.Event | None = None

    def request_drain(self) -> None:
        """Start draining; safe from any thread and from a signal handler. A second call forces exit."""
        loop, drain, force = self._loop, self._drain_requested, self._force
        if loop is None or drain is None or force is None:
            return
        loop.call_soon_threadsafe(force.set if drain.is_set() else drain.set)

    async def serve(self, on_ready: Callable[[RuntimeInfo], None] | None = None, handle_signals: bool = True) -> int:
        """Run until drained; returns the process exit code."""
        config = self.config
        self._loop = asyncio.get_running_loop()
        self._drain_requested = asyncio.Event()
        self._force = force = asyncio.Event()
        serve_sock = bind_socket(config.host, config.port)
        admin_sock = bind_socket(config.host, config.admin_port)
        servers = [http_server(create_serving_app(self.ctx)), http_server(create_admin_app(self.ctx))]
        tasks = [
            asyncio.ensure_future(s.serve(sockets=[sock]))
            for s, sock in zip(servers, (serve_sock, admin_sock), strict=True)
        ]
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self.request_drain)
        exit_code = 0
        try:
            # 1. Load the model while /healthz answers and /readyz says "model loading".
            loaded = await self._load(self._drain_requested)
            # 2. Ready: both servers listening, engine running.
            await self._announce_ready(servers, tasks, serve_sock, admin_sock, on_ready)
            # 3. Serve until asked to stop, then drain.
            await self._drain_requested.wait()
            await self._drain(loaded, force)
        except Exception:
            logger.exception("runtime failed")
            exit_code = 1
            if self.ctx.loaded is not None:
                await self.ctx.loaded.engine.shutdown(drain=False)
        finally:
            if self.ctx.loaded is not None and self.ctx.loaded.on_stop is not None:
                self.ctx.loaded.on_stop()
            self.ctx.draining = True
            for server in servers:
                server.should_exit = True
                server.force_exit = force.is_set() or exit_code != 0
            await asyncio.gather(*tasks, return_exceptions=True)
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self._loop.remove_signal_handler(sig)
            logger.info("stopped", extra={"exit_code": exit_code})
        return exit_code

    async def _load(self, drain_requested: asyncio.Event) -> LoadedModel:
        """Builds the model in a thread (a stop request waits for it), starts its engine and publishes it."""
        config = self.config
        logger.info(
            "loading model",
            extra={
                "model": config.model_name,
                "preset": config.preset,
                "checkpoint": str(config.checkpoint) if config.checkpoint else None,
            },
        )
        load_task = asyncio.ensure_future(asyncio.to_thread(self._build, config, self.metrics))
        stop_wait = asyncio.ensure_future(drain_requested.wait())
        await asyncio.wait({load_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not load_task.done():
            logger.info("stop requested while loading; waiting for the load to finish")
        loaded = await load_task
        await loaded.engine.start()
        self.ctx.loaded = loaded
        self.metrics.watch_engine(loaded.engine.health)
        self.ctx.window_changed(loaded.engine.window_state())
        return loaded

    async def _announce_ready(
        self,
        servers: list[QuietServer],
        tasks: list[asyncio.Task[None]],
        serve_sock: socket.socket,
        admin_sock: socket.socket,
        on_ready: Callable[[RuntimeInfo], None] | None,
    ) -> None:
        """Waits until both servers listen, then sets ``info``, writes the ready file and calls ``on_ready``."""
        config = self.config
        while not all(s.started for s in servers):
            if any(t.done() for t in tasks):
                raise RuntimeError("an HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        self.info = RuntimeInfo(
            pid=os.getpid(),
            model=config.model_name,
            serve_url=url_of(config.host, serve_sock),
            admin_url=url_of(config.host, admin_sock),
            admin_token_file=str(self.admin_token_file),
        )
        if config.ready_file is not None:
            write_ready_file(config.ready_file, self.info)
        logger.info(
            "ready",
            extra={
                "serve_url": self.info.serve_url,
                "admin_url": self.info.admin_url,
                "admin_token_file": self.info.admin_token_file,
                "window": config.window.describe(),
            },
        )
        if on_ready is not None:
            on_ready(self.info)

    async def _drain(self, loaded: LoadedModel, force: asyncio.Event) -> None:
        self.ctx.draining = True
        logger.info("draining", extra={"inflight_requests": self.ctx.inflight_requests})
        waits = {asyncio.ensure_future(self.ctx.no_inflight.wait()), asyncio.ensure_future(force.wait())}
        await asyncio.wait(waits, timeout=self.config.drain_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        forced = force.is_set()
        if self.ctx.inflight_requests > 0:
            logger.warning("drain cut short", extra={"inflight_requests": self.ctx.inflight_requests, "forced": forced})
        await loaded.engine.shutdown(drain=not forced)
        logger.info("drained")


class RuntimeThread:
    """A runtime on its own event loop in a background thread (tests, the demo): ``start()`` returns
    once it is ready; ``stop()`` drains it like SIGTERM would."""

    def __init__(
        self, config: ServeConfig, build: Callable[[ServeConfig, MetricsExporter], LoadedModel] = build_loaded_model
    ) -> None:
        self.runtime = Runtime(config, build)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"runtime-{config.model_name}", daemon=True)
        self.exit_code: int | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.exit_code = asyncio.run(
                self.runtime.serve(on_ready=lambda _info: self._ready.set(), handle_signals=False)
            )
        except BaseException as error:  # surfaced by start()
            self._error = error
        finally:
            self._ready.set()

    def start(self, timeout_s: float = 120.0) -> RuntimeInfo:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"runtime not ready within {timeout_s} s")
        if self.runtime.info is None:
            raise RuntimeError(f"runtime failed to start (exit code {self.exit_code})") from self._error
        return self.runtime.info

    def stop(self, timeout_s: float = 60.0) -> int | None:
        self.runtime.request_drain()
        self._thread.join(timeout_s)
        return self.exit_code
