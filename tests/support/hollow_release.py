"""A chart release on the test control plane, its processes run as hollow nodes would run them.

The e2e tests (tests/e2e/) ``helm install`` charts/batchpilot, then run what it deploys on this machine
(tests/support/hollow.py says how a pod is played without a kubelet):

- :func:`start_runtime`: one runtime Pod of a model's Deployment, at a loopback address of its own,
  running ``batchpilot-runtime`` with that container's args, and created and reported Ready on the server
  once it serves;
- :func:`start_operator`: ``batchpilot-operator run`` with the operator Deployment's args, signed in with a
  TokenRequest token of the chart's ServiceAccount (only the chart's RBAC binds it), its probe and metrics
  on free local ports.

Each piece is separate, so that a test can do its own work between them (measure a runtime before the
operator acts on it, start a Prometheus that scrapes the pods).
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.deploy.tools import helm_path
from tests.deploy.tools import run as run_tool
from tests.integration.runtime_process import wait_until
from tests.support.control_plane import ControlPlane
from tests.support.hollow import (
    container_command,
    container_env,
    free_loopback_ip,
    hollow_pod,
    service_account_kubeconfig,
)
from tests.support.operator_process import free_port

SERVE_PORT, ADMIN_PORT = 8080, 8081  # the chart's defaults: every runtime pod's ports
RUNTIME_START_TIMEOUT_S = 180.0


def helm(plane: ControlPlane, *args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_tool([helm_path(), "--kubeconfig", plane.kubeconfig, *args], timeout_s=300, check=check)


def start_process(
    command: Sequence[str], log: Path, env: Mapping[str, str], *, append: bool = False
) -> subprocess.Popen[bytes]:
    with log.open("ab" if append else "wb") as sink:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **env})


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def admin_token_file(plane: ControlPlane, namespace: str, secret: str, path: Path) -> Path:
    """The chart's admin-token Secret's ``token``, written as its volume would mount it in a pod."""
    data = plane.get("secret", secret, namespace=namespace)["data"]
    path.write_text(base64.b64decode(data["token"]).decode())
    path.chmod(0o600)
    return path


@dataclass
class HollowRuntime:
    """A runtime pod: its name on the server, its address, and the process serving there."""

    pod: str
    ip: str
    process: subprocess.Popen[bytes]
    log: Path
    command: list[str]
    env: dict[str, str]

    @property
    def serve_url(self) -> str:
        return f"http://{self.ip}:{SERVE_PORT}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.ip}:{ADMIN_PORT}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def restart(self) -> None:
        """The container restarted, as a kubelet restarts one: the same command at the same address (so its
        start-up window again, at generation 0), the Pod kept; returns once it serves."""
        stop_process(self.process)
        self.process = start_process(self.command, self.log, self.env, append=True)
        _wait_serving(self.process, self.ip, self.log)


def _wait_serving(process: subprocess.Popen[bytes], ip: str, log: Path) -> None:
    def serving() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the runtime exited:\n{log.read_text()[-3000:]}")
        try:
            # /health, not /healthz: liveness passes while the model loads, and the admin API answers 503 until it
            # has (seen once in CI: the window read right after a restart was refused as "loading").
            return httpx.get(f"http://{ip}:{SERVE_PORT}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(serving, RUNTIME_START_TIMEOUT_S, f"the hollow runtime at {ip} to serve", interval_s=0.2)


def start_runtime(
    plane: ControlPlane,
    namespace: str,
    deployment: str,
    token_file: Path,
    log: Path,
    *,
    replace: Mapping[str, str] | None = None,
) -> HollowRuntime:
    """A Pod of ``deployment`` serving at a free loopback address: the ``runtime`` container's args run
    there (with ``replace``'s flags changed too), and the Pod is created and reported Ready once it serves."""
    ip = free_loopback_ip([SERVE_PORT, ADMIN_PORT])
    spec = plane.get("deployment", deployment, namespace=namespace)["spec"]["template"]["spec"]
    args = container_command(
        spec, "runtime", env={}, replace={"--host": ip, "--admin-token-file": str(token_file), **(replace or {})}
    )
    command = [sys.executable, "-m", "batchpilot_runtime.cli.main", *args]
    env = container_env(spec, "runtime")
    process = start_process(command, log, env)
    try:
        _wait_serving(process, ip, log)
        pod = hollow_pod(plane, namespace, deployment, ip)
    except BaseException:
        stop_process(process)
        raise
    return HollowRuntime(pod["metadata"]["name"], ip, process, log, command, env)


@dataclass
class HollowOperator:
    """``batchpilot-operator run`` as the chart deploys it, with its ServiceAccount's kubeconfig."""

    process: subprocess.Popen[bytes]
    log: Path
    kubeconfig: Path
    liveness_url: str  # kopf's health endpoint
    metrics_url: str  # the operator's own /metrics

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> None:
        """Fails, with the end of its log, when the operator has exited."""
        assert self.process.poll() is None, f"the operator exited:\n{self.text()[-4000:]}"

    def refused(self, since: int = 0) -> list[str]:
        """Lines of its log (from character ``since``) that tell of a request the API server refused (403)."""
        lines = self.text()[since:].splitlines()
        return [line for line in lines if " 403" in line or "Forbidden" in line or "forbidden" in line]


def start_operator(
    plane: ControlPlane,
    namespace: str,
    deployment: str,
    token_file: Path,
    work: Path,
    *flags: str,
    name: str = "operator-0",
) -> HollowOperator:
    """The ``operator`` container of ``deployment`` as pod ``name``: its args (then ``flags``), its env, a
    TokenRequest token of its ServiceAccount; its log is ``work/NAME.log``."""
    spec = plane.get("deployment", deployment, namespace=namespace)["spec"]["template"]["spec"]
    kubeconfig = service_account_kubeconfig(plane, namespace, spec["serviceAccountName"], work / f"{name}.kubeconfig")
    liveness_url = f"http://127.0.0.1:{free_port()}/healthz"
    metrics_port = free_port()
    args = container_command(
        spec,
        "operator",
        env={"POD_NAMESPACE": namespace, "POD_NAME": name},
        replace={
            "--liveness": liveness_url,
            "--metrics-port": str(metrics_port),
            "--admin-token-file": str(token_file),
        },
    )
    command = [sys.executable, "-m", "batchpilot_operator.cli.main", *args, "--kubeconfig", str(kubeconfig), *flags]
    env: dict[str, Any] = {
        **container_env(spec, "operator"),
        "POD_NAMESPACE": namespace,
        "HOSTNAME": name,
        "HOME": str(work),
    }
    log = work / f"{name}.log"
    process = start_process(command, log, env)
    return HollowOperator(process, log, kubeconfig, liveness_url, f"http://127.0.0.1:{metrics_port}/metrics")
