"""Launching batchpilot runtimes from tests, the operator's integration tests and the demo.

Two ways, same result (a ``RuntimeInfo``: pid, serving URL, admin URL, admin token file):

- ``start_runtime_process``: ``batchpilot-runtime serve`` as a subprocess on free ports
  (``--port 0 --admin-port 0``); the runtime writes its ready file once both ports answer
  and the model is loaded, and that file is how its URLs are found. Use it when a test needs
  signals, a separate RSS, or several runtimes that must not share a GIL.
- ``start_runtime_thread``: the same runtime on a background thread of this process (no
  interpreter start-up, no second torch import): fastest for HTTP tests.

Both take the serve flags (as keyword arguments of ``ServeConfig`` for threads, as CLI
arguments for processes) and write the admin token to a file the caller can read.
Importing this module loads neither torch nor the web stack (only a thread runtime does).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.server.config import ServeConfig
from batchpilot_runtime.server.ready import RuntimeInfo

if TYPE_CHECKING:
    from batchpilot_runtime.server.runtime import RuntimeThread

DEFAULT_START_TIMEOUT_S = 180.0


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def write_token(directory: Path, token: str | None = None) -> tuple[str, Path]:
    token = token or secrets.token_urlsafe(24)
    path = directory / "admin-token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token, path


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class RuntimeProcess:
    """A ``batchpilot-runtime serve`` subprocess."""

    process: subprocess.Popen[bytes]
    info: RuntimeInfo
    token: str
    log_path: Path

    @property
    def serve_url(self) -> str:
        return self.info.serve_url

    @property
    def admin_url(self) -> str:
        return self.info.admin_url

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout_s: float = 60.0) -> int:
        return self.process.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (a drain), then SIGKILL if it has not exited in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(timeout=timeout_s)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def start_runtime_process(
    workdir: Path,
    *args: str,
    model_name: str = "tiny-test",
    token: str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
) -> RuntimeProcess:
    """Start ``batchpilot-runtime serve --preset tiny`` on free loopback ports and wait until ready.

    ``args`` are further serve flags (e.g. ``"--hard-cap", "4"``); logs go to ``workdir/NAME.log``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    token, token_path = write_token(workdir, token)
    ready_path = workdir / f"{model_name}.ready.json"
    ready_path.unlink(missing_ok=True)
    log_path = workdir / f"{model_name}.log"
    command = [
        sys.executable,
        "-m",
        "batchpilot_runtime.cli.main",
        "serve",
        "--model-name",
        model_name,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--admin-port",
        "0",
        "--admin-token-file",
        str(token_path),
        "--ready-file",
        str(ready_path),
        *args,
    ]
    if "--preset" not in args and "--checkpoint" not in args:
        command += ["--preset", "tiny"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(
                f"runtime exited with {process.returncode} before ready:\n{log_path.read_text()[-3000:]}"
            )
        return ready_path.exists()

    try:
        wait_until(ready, timeout_s, f"runtime {model_name} to write {ready_path}", interval_s=0.05)
    except BaseException:
        process.kill()
        process.wait()
        raise
    info = RuntimeInfo.read(ready_path)
    return RuntimeProcess(process, info, token, log_path)


@contextmanager
def runtime_process(workdir: Path, *args: str, **kwargs: Any) -> Iterator[RuntimeProcess]:
    runtime = start_runtime_process(workdir, *args, **kwargs)
    try:
        yield runtime
    finally:
        runtime.stop()


def make_serve_config(token_file: Path, **overrides: Any) -> ServeConfig:
    """A tiny-model ServeConfig on free loopback ports; window fields may be given flat
    (``target_batch_size=4``) or as ``window=Window(...)``."""
    window_fields = {
        k: overrides.pop(k)
        for k in ("target_batch_size", "hard_cap", "max_wait_ms", "tail_mark_ratio")
        if k in overrides
    }
    window = overrides.pop("window", None) or Window(
        **{"target_batch_size": 4, "hard_cap": 8, "max_wait_ms": 5, "tail_mark_ratio": 2.0, **window_fields}
    )
    settings: dict[str, Any] = {
        "model_name": "tiny-test",
        "preset": "tiny",
        "host": "127.0.0.1",
        "port": 0,
        "admin_port": 0,
        "admin_token_file": token_file,
        "kv_cache_tokens": 8192,
        "max_queue": 256,
        "seed": 0,
        "device": "cpu",
        "drain_timeout_s": 60.0,
    }
    settings.update(overrides)
    return ServeConfig(window=window, **settings)


@dataclass
class ThreadRuntime:
    """A runtime running on a thread of this process."""

    thread: RuntimeThread
    info: RuntimeInfo
    token: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def serve_url(self) -> str:
        return self.info.serve_url

    @property
    def admin_url(self) -> str:
        return self.info.admin_url

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def ctx(self) -> Any:
        """The runtime's ServingContext (engine, metrics, counters) for white-box checks."""
        return self.thread.runtime.ctx

    def stop(self, timeout_s: float = 60.0) -> int | None:
        return self.thread.stop(timeout_s)


def start_runtime_thread(workdir: Path, **overrides: Any) -> ThreadRuntime:
    from batchpilot_runtime.server.runtime import RuntimeThread  # torch and the web stack: only when used

    workdir.mkdir(parents=True, exist_ok=True)
    token, token_path = write_token(workdir)
    thread = RuntimeThread(make_serve_config(token_path, **overrides))
    info = thread.start(DEFAULT_START_TIMEOUT_S)
    return ThreadRuntime(thread, info, token)


@contextmanager
def runtime_thread(workdir: Path, **overrides: Any) -> Iterator[ThreadRuntime]:
    runtime = start_runtime_thread(workdir, **overrides)
    try:
        yield runtime
    finally:
        runtime.stop()


def parse_sse(lines: Sequence[str]) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``"[DONE]"`` kept as the string)."""
    import json

    payloads: list[Any] = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads
