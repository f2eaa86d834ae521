"""A real Kubernetes control plane for the tests: kube-apiserver v1.37.2 and etcd on loopback.

The binaries are the ones ``make control-plane`` (``scripts/build-control-plane.sh``) builds once per
machine into a cache outside the clone: the folder ``$BATCHPILOT_CONTROL_PLANE`` names when set
(``make test`` sets it), else the one the script prints with ``--path``. A missing binary is an error
that says to run ``make control-plane``, never a skip: CI must run these tests.

``scripts/control-plane.sh`` starts and stops it (the same script a developer runs by hand):
RBAC on, client certificates, service-account token signing, no kubelet, no controller manager.
One control plane serves a whole pytest session (the ``control_plane`` fixture in
``tests/conftest.py``); each test works in namespaces of its own (:meth:`ControlPlane.namespace`),
because without a controller manager a deleted namespace is never emptied.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.deploy.tools import kubectl_path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "control-plane.sh"
CRD_FILE = REPO_ROOT / "crds" / "batchpilot.dev_batchprofiles.yaml"
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-control-plane.sh"
BINARIES_ENV = "BATCHPILOT_CONTROL_PLANE"
KUBERNETES_VERSION = "v1.37.2"
UP_TIMEOUT_S = 300.0  # a guard: the first start on two busy cores takes about 10 s


class ControlPlaneMissing(RuntimeError):
    """kube-apiserver or etcd is not built (or not where ``$BATCHPILOT_CONTROL_PLANE`` says)."""


def control_plane_binaries() -> Path:
    """The folder holding the built ``kube-apiserver`` and ``etcd``; ``ControlPlaneMissing`` otherwise."""
    named = os.environ.get(BINARIES_ENV)
    if named:
        folder = Path(named)
        missing = [name for name in ("kube-apiserver", "etcd") if not os.access(folder / name, os.X_OK)]
        if missing:
            raise ControlPlaneMissing(
                f"${BINARIES_ENV}={named} has no executable {' or '.join(missing)}; run `make control-plane`"
            )
        return folder
    found = subprocess.run([str(BUILD_SCRIPT), "--path"], capture_output=True, text=True, check=False)
    if found.returncode != 0:
        raise ControlPlaneMissing(
            "kube-apiserver and etcd are not built: run `make control-plane` (once per machine; `make test` "
            f"does): {found.stderr.strip()}"
        )
    return Path(found.stdout.strip().splitlines()[-1])


class KubectlError(AssertionError):
    """kubectl exited non-zero; the message carries the command and its output."""

    def __init__(self, args: Sequence[str], result: subprocess.CompletedProcess[str]) -> None:
        self.returncode = result.returncode
        self.stdout = result.stdout
        self.stderr = result.stderr
        super().__init__(f"kubectl {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")


@dataclass
class ControlPlane:
    """A running control plane: its folder (certificates, logs, ``kubeconfig``) and ways to use it."""

    directory: Path
    binaries: Path

    @property
    def kubeconfig(self) -> Path:
        return self.directory / "kubeconfig"

    @property
    def server(self) -> str:
        config = yaml.safe_load(self.kubeconfig.read_text())
        return str(config["clusters"][0]["cluster"]["server"])

    @property
    def ca_file(self) -> Path:
        return self.directory / "certs" / "ca.crt"

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), BINARIES_ENV: str(self.binaries)}

    def script(self, *args: str, timeout_s: float = UP_TIMEOUT_S) -> str:
        result = subprocess.run(
            [str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout_s, env=self.env(), check=False
        )
        if result.returncode != 0:
            raise AssertionError(f"control-plane.sh {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
        return result.stdout

    def up(self) -> None:
        self.script("up", str(self.directory))

    def down(self) -> None:
        self.script("down", str(self.directory), timeout_s=60)

    def stop(self, component: str) -> None:
        """Stop ``kube-apiserver`` or ``etcd`` alone; :meth:`start` brings it back on its port."""
        self.script("stop", component, str(self.directory), timeout_s=60)

    def start(self, component: str) -> None:
        self.script("start", component, str(self.directory))

    def kubectl(
        self,
        *args: str,
        stdin: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout_s: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        command = [str(kubectl_path()), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args]
        result = subprocess.run(
            command, input=stdin, capture_output=True, text=True, timeout=timeout_s, env=self.env(), check=False
        )
        if check and result.returncode != 0:
            raise KubectlError(args, result)
        return result

    def get(self, *args: str, namespace: str | None = None) -> dict[str, Any]:
        ns = ["--namespace", namespace] if namespace else []
        loaded: dict[str, Any] = json.loads(self.kubectl("get", *ns, *args, "-o", "json").stdout)
        return loaded

    def apply(
        self, manifest: dict[str, Any] | str, *extra: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.kubectl(
            "apply", "--server-side", "--field-manager=tests", "-f", "-", *extra, stdin=text, check=check
        )

    def _admin_tls(self) -> ssl.SSLContext:
        certs = self.directory / "certs"
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(str(certs / "admin.crt"), str(certs / "admin.key"))
        return context

    def client(self, timeout_s: float = 10) -> httpx.Client:
        """An HTTP client of the API server, signed in as the admin: for polling that ``kubectl`` (a process a
        call) would make slow on a busy host."""
        return httpx.Client(base_url=self.server, verify=self._admin_tls(), timeout=timeout_s)

    def async_client(self, timeout_s: float = 10) -> httpx.AsyncClient:
        """:meth:`client` for asyncio."""
        return httpx.AsyncClient(base_url=self.server, verify=self._admin_tls(), timeout=timeout_s)

    def install_crd(self) -> None:
        """The committed BatchProfile CRD, applied server-side and Established (the chart installs the same)."""
        self.kubectl("apply", "--server-side", "--field-manager=tests", "-f", str(CRD_FILE))
        self.kubectl("wait", "--for=condition=Established", "crd/batchprofiles.batchpilot.dev", "--timeout=60s")

    def install_kopf_peering_crd(self) -> None:
        """kopf's namespaced KopfPeering CRD, as the chart installs it (charts/batchpilot/templates/peering.yaml),
        Established. Tests that install the chart delete kopf's CRDs first, as a fresh cluster has none."""
        crd = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "kopfpeerings.kopf.dev"},
            "spec": {
                "group": "kopf.dev",
                "scope": "Namespaced",
                "names": {"kind": "KopfPeering", "plural": "kopfpeerings", "singular": "kopfpeering"},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                    }
                ],
            },
        }
        self.apply(crd)
        self.kubectl("wait", "--for=condition=Established", "crd/kopfpeerings.kopf.dev", "--timeout=60s")

    def namespace(self, prefix: str = "t") -> str:
        """A new namespace of this test's own (never deleted: nothing would empty it)."""
        name = f"{prefix}-{secrets.token_hex(3)}"
        self.kubectl("create", "namespace", name)
        return name

    def log(self, component: str) -> str:
        return (self.directory / f"{component}.log").read_text(errors="replace")
