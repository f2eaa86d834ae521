"""Hollow nodes: what a kubelet would do, done by the test, on a control plane without one.

There is no kubelet, controller manager or scheduler beside the test control plane
(tests/support/control_plane.py): a Deployment gets no ReplicaSet and no Pod, and no container
runs. So a test does it itself, from what the chart put on the server:

- :func:`hollow_pod` creates the Pod a Deployment's template describes and sets its status
  through the status subresource (``podIP`` a loopback address of the test's choosing, phase
  Running, Ready), as a kubelet would report it;
- :func:`container_command` turns the container's own args into a local command line: the listen
  address becomes that pod IP, files a volume would mount become local files, ``$(VAR)`` is expanded
  from the container's env as the kubelet expands it;
- :func:`service_account_kubeconfig` signs in as a ServiceAccount with a token from the TokenRequest
  API (``kubectl create token``), as a projected token volume gives a pod one.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.support.control_plane import ControlPlane


def free_loopback_ip(ports: Sequence[int]) -> str:
    """A 127.0.0.X (X >= 2) on which every one of ``ports`` is free: one hollow pod's address."""
    for _ in range(200):
        ip = f"127.0.{random.randint(0, 255)}.{random.randint(2, 254)}"
        try:
            for port in ports:
                with socket.socket() as sock:
                    sock.bind((ip, port))
        except OSError:
            continue
        return ip
    raise RuntimeError(f"no loopback address has ports {list(ports)} free")


def service_account_kubeconfig(plane: ControlPlane, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig that signs in as ``namespace/account`` with a TokenRequest token (one hour)."""
    token = plane.kubectl("create", "token", account, "--namespace", namespace, "--duration=1h").stdout.strip()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": plane.server, "certificate-authority": str(plane.ca_file)}}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": account, "namespace": namespace}}],
        "current-context": "c",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def hollow_pod(plane: ControlPlane, namespace: str, deployment: str, ip: str, *, ready: bool = True) -> dict[str, Any]:
    """The Pod of ``deployment``'s template, created and reported Running at ``ip``; returns it as stored."""
    template = plane.get("deployment", deployment, namespace=namespace)["spec"]["template"]
    name = f"{deployment}-{secrets.token_hex(3)}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": name, "namespace": namespace},
        "spec": template["spec"],
    }
    plane.kubectl("create", "-f", "-", stdin=json.dumps(pod))
    set_pod_status(plane, namespace, name, ip, ready=ready)
    return plane.get("pod", name, namespace=namespace)


def set_pod_status(plane: ControlPlane, namespace: str, name: str, ip: str, *, ready: bool) -> None:
    """Report the pod as a kubelet does, through the status subresource."""
    flag = "True" if ready else "False"
    status = {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "hostIP": "127.0.0.1",
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": flag},
            {"type": "Ready", "status": flag},
            {"type": "PodScheduled", "status": "True"},
        ],
    }
    plane.kubectl(
        "patch", "pod", name, "--namespace", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


def container_command(
    pod_spec: Mapping[str, Any],
    container: str,
    *,
    env: Mapping[str, str],
    replace: Mapping[str, str],
) -> list[str]:
    """``container``'s args as a local command line: ``$(VAR)`` expanded from its env (literal values and
    the names in ``env``, which stand for fieldRefs), then each ``--flag=`` whose flag is in ``replace``
    given that value instead (a listen address, a file a volume would mount)."""
    spec = next(c for c in pod_spec["containers"] if c["name"] == container)
    values = {e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}
    values.update(env)
    args = []
    for arg in spec.get("args", []):
        arg = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values.get(m[1], m[0]), arg)
        flag, equals, _ = arg.partition("=")
        args.append(f"{flag}={replace[flag]}" if equals and flag in replace else arg)
    return args


def container_env(pod_spec: Mapping[str, Any], container: str) -> dict[str, str]:
    """The container's literal env values (fieldRefs and Secret refs are the caller's to supply)."""
    spec = next(c for c in pod_spec["containers"] if c["name"] == container)
    return {e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}
