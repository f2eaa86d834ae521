"""The demo's child processes: start, wait until ready, stop — always, and with a useful error.

Every child gets its own session (so a Ctrl-C in the terminal reaches only the demo, which
then stops its children in order) and, on Linux, a parent-death signal (so that even a
demo killed with SIGKILL takes them along). Its output goes to a log file in the demo's
folder; a failure names the child and quotes the end of that log.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

LOG_TAIL_LINES = 25
_PR_SET_PDEATHSIG = 1


class DemoError(RuntimeError):
    """Something the demo needs failed; the message names it and says where to look."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    """A loopback port free right now (for children that cannot report the one they bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    kept = text.rstrip("\n").splitlines()[-lines:]
    return "\n".join(kept) if kept else "(empty log)"


class Child:
    """One child process whose stdout and stderr go to ``log_path`` (or, with ``on_line``,
    through the callback and then into the log)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.on_line = on_line
        self.process: asyncio.subprocess.Process | None = None
        self.stopping = False  # set by stop(): an exit after that is expected, not a failure
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")  # a rerun into the same folder starts a fresh log
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if self.on_line else log,
                stderr=log,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as error:
            raise DemoError(f"{self.name}: cannot start {self.argv[0]}: {error}") from None
        finally:
            log.close()
        if self.on_line is not None:
            self._reader = asyncio.create_task(self._read_lines(), name=f"{self.name}-stdout")

    async def _read_lines(self) -> None:
        assert self.process is not None and self.process.stdout is not None  # set in start()
        with self.log_path.open("a") as log:
            while line := await self.process.stdout.readline():
                text = line.decode(errors="replace").rstrip("\n")
                log.write(text + "\n")
                log.flush()
                if self.on_line is not None:
                    self.on_line(text)

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    def failure(self, what: str) -> DemoError:
        code = self.returncode
        status = "still running" if code is None else f"exit code {code}"
        return DemoError(f"{self.name} {what} ({status}); last lines of {self.log_path}:\n{tail(self.log_path)}")

    def check_alive(self) -> None:
        if self.process is not None and self.process.returncode is not None and not self.stopping:
            raise self.failure("exited unexpectedly")

    async def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (a runtime drains on it), then SIGKILL to the whole group after ``timeout_s``."""
        process = self.process
        if process is None:
            return
        self.stopping = True
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._reader, 5.0)

    def kill_now(self) -> None:
        """Last resort when the event loop is gone: SIGKILL the child's process group."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)


async def wait_until(
    child: Child, ready: Callable[[], Awaitable[bool]], timeout_s: float, what: str, poll_s: float = 0.2
) -> None:
    """Poll ``ready`` until it says yes; fail naming ``child`` when it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        child.check_alive()
        if await ready():
            return
        if time.monotonic() >= deadline:
            raise child.failure(f"did not {what} within {timeout_s:g} s")
        await asyncio.sleep(poll_s)


@dataclass(frozen=True)
class RuntimeEndpoint:
    model: str
    serve_url: str
    admin_url: str
    token_file: Path

    @property
    def metrics_url(self) -> str:
        return f"{self.serve_url}/metrics"

    def operator_flag(self) -> str:
        return f"model={self.model},url={self.serve_url},admin={self.admin_url},token-file={self.token_file}"


def threads_per_runtime(runtimes: int, cpus: int | None) -> int:
    """torch threads for each of ``runtimes`` processes sharing ``cpus`` cores (None: unknown).

    More threads than cores between them oversubscribes OpenMP: on a 2-core host two runtimes at
    2 threads each made steps up to 30x slower than at 1.
    """
    return max(1, (cpus or 1) // max(1, runtimes))


def runtime_command(
    *,
    model: str,
    preset: str | None,
    window_flags: Sequence[str],
    kv_cache_tokens: int,
    token_file: Path,
    ready_file: Path,
    seed: int,
    threads: int,
    checkpoint: str | None = None,
) -> list[str]:
    """``serve`` on free ports, writing ``ready_file``; the model a ``preset`` or, instead, a ``checkpoint``."""
    source = ["--checkpoint", checkpoint] if checkpoint is not None else ["--preset", str(preset)]
    return [
        sys.executable,
        "-m",
        "batchpilot_runtime.cli.main",
        "serve",
        "--model-name",
        model,
        *source,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--admin-port",
        "0",
        "--admin-token-file",
        str(token_file),
        "--ready-file",
        str(ready_file),
        "--kv-cache-tokens",
        str(kv_cache_tokens),
        "--seed",
        str(seed),
        "--threads",
        str(threads),
        "--log-level",
        "warning",
        *window_flags,
    ]


def _read_ready_file(path: Path) -> dict[str, object] | None:
    """The runtime's ready file, or None while it is not written (it is replaced atomically)."""
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return info if isinstance(info, dict) else None


async def start_runtime(child: Child, ready_file: Path, timeout_s: float) -> RuntimeEndpoint:
    """Start a runtime on free ports and wait for its ready file (written once it serves)."""
    ready_file.unlink(missing_ok=True)  # noqa: ASYNC240 - a local file, instant
    await child.start()

    async def written() -> bool:
        return _read_ready_file(ready_file) is not None

    await wait_until(child, written, timeout_s, "become ready (load its model and open its ports)")
    info = _read_ready_file(ready_file) or {}
    return RuntimeEndpoint(
        model=str(info["model"]),
        serve_url=str(info["serve_url"]),
        admin_url=str(info["admin_url"]),
        token_file=Path(str(info["admin_token_file"])),
    )


def find_prometheus() -> str | None:
    return shutil.which("prometheus")


def prometheus_config(targets: Sequence[str], scrape_interval_s: float) -> str:
    """A scrape config for the runtimes' serving ports (``host:port``)."""
    listed = ", ".join(f'"{t}"' for t in targets)
    interval = f"{scrape_interval_s:g}s"
    return (
        "global:\n"
        f"  scrape_interval: {interval}\n"
        f"  evaluation_interval: {interval}\n"
        "scrape_configs:\n"
        "  - job_name: batchpilot-runtime\n"
        f"    scrape_interval: {interval}\n"
        f"    scrape_timeout: {interval}\n"
        f"    static_configs:\n      - targets: [{listed}]\n"
    )


def prometheus_command(binary: str, config_file: Path, data_dir: Path, port: int) -> list[str]:
    return [
        binary,
        f"--config.file={config_file}",
        f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1d",
        "--log.level=warn",
    ]


async def http_ok(client: httpx.AsyncClient, url: str) -> bool:
    try:
        response = await client.get(url, timeout=2.0)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def prometheus_has_scraped(client: httpx.AsyncClient, base_url: str, jobs: int) -> bool:
    """True once every runtime target has been scraped successfully at least once."""
    try:
        response = await client.get(f"{base_url}/api/v1/query", params={"query": "up"}, timeout=2.0)
        results = response.json()["data"]["result"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return sum(1 for r in results if r.get("value", [0, "0"])[1] == "1") >= jobs
