"""A real Prometheus (Debian's package, ``scripts/system-deps.sh``) on a free loopback port.

The scrape config is generated: one job, static targets, each with its own
labels (``namespace`` as Kubernetes service discovery would add it), and a
short scrape interval so that tests see data within seconds.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ScrapeTarget:
    address: str  # host:port serving /metrics
    labels: Mapping[str, str]


@dataclass
class PrometheusProcess:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=5) as response:
            return json.loads(response.read())

    def active_targets(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/targets")["data"]["activeTargets"])

    def targets_up(self) -> bool:
        targets = self.active_targets()
        return bool(targets) and all(t.get("health") == "up" for t in targets)

    def query(self, expr: str) -> list[dict[str, Any]]:
        import urllib.parse

        return list(self.get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))["data"]["result"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def write_config(path: Path, targets: Sequence[ScrapeTarget], scrape_interval_s: float) -> None:
    config = {
        "global": {"scrape_interval": f"{scrape_interval_s:g}s", "evaluation_interval": f"{scrape_interval_s:g}s"},
        "scrape_configs": [
            {
                "job_name": "batchpilot-runtime",
                "scrape_interval": f"{scrape_interval_s:g}s",
                "scrape_timeout": f"{scrape_interval_s:g}s",
                "static_configs": [{"targets": [t.address], "labels": dict(t.labels)} for t in targets],
            }
        ],
    }
    path.write_text(yaml.safe_dump(config))


def start_prometheus(
    workdir: Path,
    targets: Sequence[ScrapeTarget],
    *,
    scrape_interval_s: float = 1.0,
    timeout_s: float = 60.0,
    port: int | None = None,
) -> PrometheusProcess:
    """Prometheus on ``port`` of 127.0.0.1 (a free one when None: give one only where its URL had to be
    known before it could start), ready to answer."""
    binary = prometheus_binary()
    if binary is None:
        raise FileNotFoundError("prometheus is not installed: run scripts/system-deps.sh (as root)")
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    write_config(config_path, targets, scrape_interval_s)
    port = port or _free_port()
    log_path = workdir / "prometheus.log"
    command = [
        binary,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
        "--log.level=warn",
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    prometheus = PrometheusProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{prometheus.url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return prometheus
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            prometheus.stop()
            raise TimeoutError(f"prometheus not ready after {timeout_s:g} s: {log_path.read_text()[-2000:]}")
        time.sleep(0.1)


@contextmanager
def prometheus_process(workdir: Path, targets: Sequence[ScrapeTarget], **kwargs: Any) -> Iterator[PrometheusProcess]:
    prometheus = start_prometheus(workdir, targets, **kwargs)
    try:
        yield prometheus
    finally:
        prometheus.stop()
