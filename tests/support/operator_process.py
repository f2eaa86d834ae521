"""``batchpilot-operator run`` as a subprocess, signed in with a kubeconfig of the test's choosing, and waiting on
conditions without fixed sleeps.

The kubeconfig is the test control plane's (tests/support/control_plane.py: the admin, or a ServiceAccount's
token) or the kmock emulator's (tests/integration/kmock_cluster.py wraps this class for it).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

OPTIONS_RUNNER = Path(__file__).with_name("operator_options.py")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port_on_all(hosts: list[str]) -> int:
    """A port free on every one of these loopback addresses (pods share ports on different IPs)."""
    for _ in range(50):
        port = free_port(hosts[0])
        try:
            for host in hosts:
                with socket.socket() as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no common free port on {hosts}")


async def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Poll a sync or async predicate until truthy (returned) or fail after ``timeout_s``. Never a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
        except (KeyError, IndexError, TypeError, StopIteration, ConnectionError, TimeoutError) as error:
            last_error = error
        except Exception as error:  # httpx errors of a busy server are transient while polling
            if type(error).__module__.split(".")[0] not in ("httpx", "httpcore"):
                raise
            last_error = error
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}" + (
                f" (last error: {last_error!r})" if last_error else ""))  # fmt: skip
        await asyncio.sleep(interval_s)


class OperatorProcess:
    """``batchpilot-operator run`` with ``kubeconfig``, its log in ``workdir/NAME.log``.

    ``args`` are the command's flags; ``options`` instead sets :class:`RunOptions` fields by name, for those
    the command does not expose (see ``operator_options.py``).
    """

    def __init__(
        self,
        workdir: Path,
        kubeconfig: Path,
        *args: str,
        name: str = "operator",
        options: Mapping[str, Any] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = kubeconfig
        self.liveness_port = free_port()
        self.metrics_port = free_port()
        self.log_path = workdir / f"{name}.log"
        liveness_url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        if options is None:
            command = [
                sys.executable, "-m", "batchpilot_operator.cli.main", "run", "--kubeconfig", str(kubeconfig),
                "--liveness", liveness_url, "--metrics-port", str(self.metrics_port), *args,
            ]  # fmt: skip
        elif args:
            raise ValueError("give the command's flags or RunOptions fields, not both")
        else:
            fields = {"kubeconfig": str(kubeconfig), "liveness": liveness_url,
                      "metrics_port": self.metrics_port, **options}  # fmt: skip
            command = [sys.executable, str(OPTIONS_RUNNER), json.dumps(fields)]
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "HOSTNAME": name}
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def metrics_text(self) -> str:
        async with httpx.AsyncClient() as client:
            return (await client.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=20)).text

    async def liveness(self) -> int:
        return (await self.liveness_response()).status_code

    async def liveness_response(self) -> httpx.Response:
        """The kopf health endpoint's answer: 200 with the probes' results, or 500."""
        async with httpx.AsyncClient() as client:
            return await client.get(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=5)

    def kill(self) -> None:
        """SIGKILL: a crashed replica, which leaves its peering record to expire."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)  # kopf waits on its peering record at exit; not under test
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
