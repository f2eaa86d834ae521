"""Running llama.cpp's ``llama-server`` from tests and benchmarks, with the SmolLM2-135M-Instruct GGUF.

The binary is the one ``make llama-server`` (``scripts/llama-server.sh``) builds once per machine into
a cache outside the clone: ``$BATCHPILOT_LLAMA_SERVER`` when set (``make test`` sets it), else the
path the script prints with ``--path``. A missing binary is an error that says to run
``make llama-server``, never a skip: CI must run these tests.

- ``start_llama_server``: the server on a free loopback port (``--port 0``; the port is read from its
  log line ``listening on http://...``), with ``--metrics``, started when its ``/health`` answers 200
  (it answers 503 while the model loads).
- ``llamacpp_metrics``: one scrape of its ``llamacpp:*`` families, as numbers by name. Each scrape
  resets the two throughput gauges (``prompt_tokens_seconds``, ``predicted_tokens_seconds``: averaged
  between two scrapes), which nothing here reads; the counters and ``requests_processing`` (slots not
  idle) are unaffected.
- ``MetricsSampler``: scrapes on a thread while a test drives load, keeping every
  ``requests_processing`` it saw. llama-server answers a scrape from its task loop, between two decode
  calls, so a sample is the count at a step boundary.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_runtime.model.sources import named_model_path
from tests.integration.runtime_process import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "llama-server.sh"
BINARY_ENV = "BATCHPILOT_LLAMA_SERVER"
SMOLLM2 = "smollm2-135m-instruct"
START_TIMEOUT_S = 120.0  # loading a 90 MB GGUF; a guard, not a measured time
STOP_TIMEOUT_S = 30.0
_LISTENING = re.compile(r"listening on (http://[0-9.]+:[0-9]+)")


class LlamaServerMissing(RuntimeError):
    """The llama-server binary is not built (or not where ``$BATCHPILOT_LLAMA_SERVER`` says)."""


def llama_server_binary() -> Path:
    """The built llama-server; ``LlamaServerMissing`` saying to run ``make llama-server`` otherwise."""
    named = os.environ.get(BINARY_ENV)
    if named:
        path = Path(named)
        if not os.access(path, os.X_OK):
            raise LlamaServerMissing(f"${BINARY_ENV}={named} is not an executable; run `make llama-server`")
        return path
    found = subprocess.run([str(BUILD_SCRIPT), "--path"], capture_output=True, text=True, check=False)
    if found.returncode != 0:
        raise LlamaServerMissing(
            f"llama-server is not built: run `make llama-server` (once per machine; `make test` does): "
            f"{found.stderr.strip()}"
        )
    return Path(found.stdout.strip().splitlines()[-1])


def smollm2_gguf() -> Path:
    return named_model_path(SMOLLM2)


@dataclass
class LlamaServer:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    args: tuple[str, ...]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(timeout=STOP_TIMEOUT_S)


def llama_server_args(
    parallel: int, ctx_size: int, threads: int = 1, batch_size: int | None = None, extra: Sequence[str] = ()
) -> list[str]:
    """The flags the tests and the benchmark start it with (the model and the address are added)."""
    args = ["--metrics", "--threads", str(threads), "--parallel", str(parallel), "--ctx-size", str(ctx_size)]
    if batch_size is not None:
        args += ["--batch-size", str(batch_size), "--ubatch-size", str(batch_size)]
    return [*args, *extra]


def start_llama_server(workdir: Path, args: Sequence[str], name: str = "llama-server") -> LlamaServer:
    """llama-server with the SmolLM2 GGUF and ``args`` on a free loopback port, once ``/health`` is 200."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    command = [
        str(llama_server_binary()),
        "--model",
        str(smollm2_gguf()),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--no-webui",
        *args,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def listening() -> str | None:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        found = _LISTENING.search(log_path.read_text(errors="replace"))
        return found.group(1) if found else None

    def healthy(url: str) -> bool:
        listening()  # raises if it exited
        try:
            return httpx.get(url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        url = wait_until(listening, START_TIMEOUT_S, "llama-server to listen", interval_s=0.05)
        wait_until(lambda: healthy(url), START_TIMEOUT_S, "llama-server's /health", interval_s=0.05)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return LlamaServer(process, url, log_path, tuple(args))


@contextmanager
def llama_server(workdir: Path, args: Sequence[str], name: str = "llama-server") -> Iterator[LlamaServer]:
    server = start_llama_server(workdir, args, name)
    try:
        yield server
    finally:
        server.stop()


def llamacpp_metrics(url: str, client: httpx.Client | None = None) -> dict[str, float]:
    """One scrape of ``/metrics``: each ``llamacpp:*`` sample's value by name, prefix dropped."""
    response = (client or httpx).get(url + "/metrics", timeout=30.0)
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.startswith("llamacpp:") and not sample.labels:
                values[sample.name.removeprefix("llamacpp:")] = float(sample.value)
    return values


@dataclass
class MetricsSampler:
    """Scrapes ``url``'s metrics on a thread until stopped; ``processing`` and ``deferred``: every
    ``requests_processing`` and ``requests_deferred`` seen, in order."""

    url: str
    interval_s: float = 0.02
    processing: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> MetricsSampler:
        self._thread = threading.Thread(target=self._run, name="llamacpp-metrics", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                values = llamacpp_metrics(self.url, client)
                self.processing.append(int(values["requests_processing"]))
                self.deferred.append(int(values["requests_deferred"]))
                self._stop.wait(self.interval_s)
