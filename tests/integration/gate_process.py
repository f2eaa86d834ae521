"""Running ``batchpilot-gate`` and an upstream stand-in from tests, each on its own thread and loop.

- ``gate_thread``: ``run_gate`` in this process (its ``Gate`` object is at hand for white-box checks).
- ``StandIn``: an OpenAI-shaped upstream that counts the requests in flight, records the count each
  request saw when it arrived and each body; it streams ``max_tokens`` SSE events, or answers whole,
  and can hold every request until the test lets it go (``release``), so a test decides when slots
  free up.
  A request leaves the count before the upstream sends its last bytes, so a gate (which frees its
  slot only after those bytes) can never let the next request in while the stand-in still counts it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.gate.admission import GateLimits
from batchpilot_runtime.gate.cli import GateConfig, run_gate
from batchpilot_runtime.gate.service import Gate
from batchpilot_runtime.server.listen import bind_socket, http_server, url_of
from batchpilot_runtime.server.ready import RuntimeInfo
from tests.integration.runtime_process import write_token

START_TIMEOUT_S = 60.0


class LoopThread:
    """An asyncio loop on a daemon thread, for servers the test talks to over HTTP."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Any, timeout_s: float = START_TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)


class StandIn:
    """The upstream stand-in's ASGI app and its counters (read from the test thread; written on its loop)."""

    def __init__(self, hold: bool = False, token_delay_s: float = 0.0) -> None:
        self.hold = hold
        self.token_delay_s = token_delay_s
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrivals: list[int] = []  # in-flight count each request saw on arrival (itself included)
        self.finished = 0
        self.disconnected = 0
        self.bodies: list[bytes] = []  # each request's body as it arrived
        self._permits: asyncio.Semaphore | None = None

    def release(self, loop_thread: LoopThread, count: int) -> None:
        """Let ``count`` held requests finish (from the test thread)."""

        def let_go() -> None:
            assert self._permits is not None
            for _ in range(count):
                self._permits.release()

        loop_thread.call(let_go)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await _answer(send, 200, b"", "text/plain")
            return
        if scope["path"] == "/v1/models":
            await _answer(send, 200, json.dumps({"object": "list", "data": [{"id": "stand-in"}]}).encode())
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        request = json.loads(body)
        if self._permits is None:
            self._permits = asyncio.Semaphore(0)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.arrivals.append(self.in_flight)
        counted = True
        try:
            if self.hold and not await _unless_disconnected(self._permits.acquire(), receive):
                self.disconnected += 1
                return
            tokens = int(request.get("max_tokens", 4))
            if not request.get("stream"):
                await asyncio.sleep(self.token_delay_s * tokens)
                text = "x" * tokens
                answer = {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                }
                answer["usage"] = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
                self.in_flight -= 1
                counted = False
                await _answer(send, 200, json.dumps(answer).encode())
                self.finished += 1
                return
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for index in range(tokens):
                chunk = {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": f"t{index} ", "finish_reason": None}],
                }
                await send(
                    {"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True}
                )
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
            if (request.get("stream_options") or {}).get("include_usage"):  # as vLLM and SGLang end it
                usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
                last = {"object": "text_completion", "choices": [], "usage": usage}
                await send(
                    {"type": "http.response.body", "body": f"data: {json.dumps(last)}\n\n".encode(), "more_body": True}
                )
            self.in_flight -= 1
            counted = False
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            self.finished += 1
        finally:
            if counted:
                self.in_flight -= 1


async def _unless_disconnected(wait: Any, receive: Any) -> bool:
    """Await ``wait`` unless the client disconnects first (False then)."""
    waited = asyncio.ensure_future(wait)
    gone = asyncio.ensure_future(_disconnect(receive))
    done, _ = await asyncio.wait({waited, gone}, return_when=asyncio.FIRST_COMPLETED)
    for task in (waited, gone):
        if task not in done:
            task.cancel()
    return waited in done


async def _disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _answer(send: Any, status: int, body: bytes, content_type: str = "application/json") -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def upstream_thread(app: Any) -> Iterator[tuple[str, LoopThread]]:
    """Serve ``app`` on a free loopback port; yields its URL and the loop thread."""
    loop_thread = LoopThread("upstream")
    sock = bind_socket("127.0.0.1", 0)
    server = http_server(app)
    task = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop_thread.loop)
    try:
        while not server.started:
            if task.done():
                task.result()
            threading.Event().wait(0.01)
        yield url_of("127.0.0.1", sock), loop_thread
    finally:
        server.should_exit = True
        task.result(30.0)
        loop_thread.close()


@dataclass
class GateThread:
    info: RuntimeInfo
    gate: Gate
    token: str
    loop_thread: LoopThread

    @property
    def serve_url(self) -> str:
        return self.info.serve_url

    @property
    def admin_url(self) -> str:
        return self.info.admin_url

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@contextmanager
def gate_thread(workdir: Path, upstream: str, window: Window, **settings: Any) -> Iterator[GateThread]:
    """``run_gate`` in front of ``upstream`` on free loopback ports; ``settings``: ``GateConfig`` fields
    and ``max_queue``/``max_hard_cap`` (its ``GateLimits``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    token, token_path = write_token(workdir)
    limits = GateLimits(max_queue=settings.pop("max_queue", 64), max_hard_cap=settings.pop("max_hard_cap", 64))
    config = GateConfig(
        upstream=upstream,
        model_name=settings.pop("model_name", "tiny-test"),
        window=window,
        limits=limits,
        port=0,
        admin_port=0,
        admin_token_file=token_path,
        drain_timeout_s=30.0,
        **settings,
    )
    loop_thread = LoopThread("gate")
    ready: dict[str, Any] = {}
    started = threading.Event()
    stop = loop_thread.run(_event())

    def on_ready(info: RuntimeInfo, gate: Gate) -> None:
        ready.update(info=info, gate=gate)
        started.set()

    task = asyncio.run_coroutine_threadsafe(run_gate(config, on_ready, stop), loop_thread.loop)
    deadline_s = time.monotonic() + START_TIMEOUT_S
    try:
        while not started.wait(0.05):
            if task.done():
                task.result()  # raises what stopped the gate during start-up
                raise RuntimeError("the gate stopped during start-up")
            if time.monotonic() > deadline_s:
                raise TimeoutError("the gate did not start")
        yield GateThread(ready["info"], ready["gate"], token, loop_thread)
    finally:
        loop_thread.call(stop.set)
        task.result(60.0)
        loop_thread.close()


async def _event() -> asyncio.Event:
    return asyncio.Event()
