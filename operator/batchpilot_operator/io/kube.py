"""The operator's own small Kubernetes client: credentials, status patches, Events, Secrets.

kopf watches and runs the handlers; the observation loop writes status and
Events itself (a kopf timer stops for good after a failed patch, one of kopf's
known failure modes, and kopf's own status writes merge into the handler's
result). Every call made here is listed in :mod:`batchpilot_operator.api.rbac`:
``batchprofiles`` list, ``batchprofiles/status`` patch, ``events`` create,
``secrets`` get.

Credentials come from the in-cluster service account, or from a kubeconfig
(token, client certificate, CA; exec plugins are not supported), and the same
:class:`KubeConfig` is handed to kopf through its login handler, so both use
one identity.
"""

from __future__ import annotations

import base64
import datetime
import os
import ssl
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml

from batchpilot_operator import API_VERSION, GROUP, KIND, PLURAL, VERSION
from batchpilot_operator.io.outbound import base_url

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class KubeConfig:
    server: str
    token: str | None = None
    ca_path: str | None = None
    ca_data: str | None = None  # PEM text
    cert_path: str | None = None
    key_path: str | None = None
    insecure: bool = False
    namespace: str = "default"

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return True
        if self.insecure:
            return False
        context = ssl.create_default_context(cafile=self.ca_path, cadata=self.ca_data)
        if self.cert_path and self.key_path:
            context.load_cert_chain(self.cert_path, self.key_path)
        return context


def _materialize(data_b64: str, suffix: str) -> str:
    """kubeconfig ``*-data`` fields are base64; ssl wants files for client certificates."""
    handle = tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False)  # noqa: SIM115 - kept for the process
    with handle:
        handle.write(base64.b64decode(data_b64))
    os.chmod(handle.name, 0o600)
    return handle.name


def load_kube_config(kubeconfig: Path | None = None, context: str | None = None) -> KubeConfig:
    """In-cluster when running in a pod (and no kubeconfig was named), else the kubeconfig file."""
    if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ and (SERVICE_ACCOUNT_DIR / "token").exists():
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        namespace_file = SERVICE_ACCOUNT_DIR / "namespace"
        return KubeConfig(
            server=base_url(host, int(port), "https"),  # an IPv6 cluster's service address goes in brackets
            token=(SERVICE_ACCOUNT_DIR / "token").read_text().strip(),
            ca_path=str(SERVICE_ACCOUNT_DIR / "ca.crt"),
            namespace=namespace_file.read_text().strip() if namespace_file.exists() else "default",
        )
    path = kubeconfig or Path(os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or Path.home() / ".kube/config")
    if not path.exists():
        raise FileNotFoundError(f"no kubeconfig at {path} and not running in a cluster")
    document = yaml.safe_load(path.read_text()) or {}
    context_name = context or document.get("current-context")
    contexts = {c["name"]: c.get("context", {}) for c in document.get("contexts") or []}
    if context_name not in contexts:
        raise ValueError(f"kubeconfig {path}: context {context_name!r} not found")
    ctx = contexts[context_name]
    clusters = {c["name"]: c.get("cluster", {}) for c in document.get("clusters") or []}
    users = {u["name"]: u.get("user", {}) or {} for u in document.get("users") or []}
    cluster = clusters.get(ctx.get("cluster"))
    if cluster is None or "server" not in cluster:
        raise ValueError(f"kubeconfig {path}: cluster {ctx.get('cluster')!r} has no server")
    user = users.get(ctx.get("user"), {})
    if "exec" in user or "auth-provider" in user:
        raise ValueError(f"kubeconfig {path}: user {ctx.get('user')!r} uses an exec/auth-provider plugin (unsupported)")
    token = user.get("token")
    if not token and user.get("tokenFile"):
        token = Path(user["tokenFile"]).read_text().strip()
    base = path.parent
    ca_data = (
        base64.b64decode(cluster["certificate-authority-data"]).decode()
        if cluster.get("certificate-authority-data")
        else None
    )
    ca_path = str(base / cluster["certificate-authority"]) if cluster.get("certificate-authority") else None
    cert_path = str(base / user["client-certificate"]) if user.get("client-certificate") else None
    key_path = str(base / user["client-key"]) if user.get("client-key") else None
    if user.get("client-certificate-data"):
        cert_path = _materialize(user["client-certificate-data"], ".crt")
    if user.get("client-key-data"):
        key_path = _materialize(user["client-key-data"], ".key")
    return KubeConfig(
        server=str(cluster["server"]).rstrip("/"),
        token=token,
        ca_path=ca_path,
        ca_data=ca_data,
        cert_path=cert_path,
        key_path=key_path,
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        namespace=ctx.get("namespace") or "default",
    )


def profile_path(namespace: str | None, name: str | None = None) -> str:
    path = f"/apis/{GROUP}/{VERSION}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{PLURAL}"
    return f"{path}/{name}" if name else path


class KubeClient:
    def __init__(self, config: KubeConfig, *, timeout_s: float = 10.0) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
        self._client = httpx.AsyncClient(
            base_url=config.server, headers=headers, verify=config.ssl_context(), timeout=timeout_s
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = await self._client.request(method, path, **kwargs)
        if response.status_code >= 300:
            try:
                message = str(response.json().get("message", response.text))
            except ValueError:
                message = response.text
            raise KubeError(response.status_code, message[:500])
        body = response.json() if response.content else {}
        return body if isinstance(body, dict) else {}

    async def patch_profile_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request(
            "PATCH",
            profile_path(namespace, name) + "/status",
            json={"status": dict(patch)},
            headers={"Content-Type": "application/merge-patch+json"},
        )

    async def list_profiles(self, namespace: str | None = None) -> list[dict[str, Any]]:
        body = await self._request("GET", profile_path(namespace))
        items = body.get("items") or []
        return [item for item in items if isinstance(item, dict)]

    async def get_secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One key of one Secret of ``namespace``. The profile model already holds names to the API's own
        patterns; quoting each path segment keeps any other name (``../other/secrets/x``) out of the path too."""
        for what, segment in (("namespace", namespace), ("Secret name", name)):
            if segment in ("", ".", ".."):
                raise ValueError(f"{what} {segment!r} is not a name")
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/secrets/{quote(name, safe='')}"
        body = await self._request("GET", path)
        data = body.get("data") or {}
        if key in data:
            return base64.b64decode(data[key]).decode().strip()
        string_data = body.get("stringData") or {}
        return str(string_data[key]).strip() if key in string_data else None

    async def create_event(
        self,
        namespace: str,
        involved: Mapping[str, Any],
        type_: str,
        reason: str,
        message: str,
        component: str = "batchpilot-operator",
    ) -> None:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        name = f"{involved.get('name', 'batchpilot')}.{uuid.uuid4().hex[:16]}"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": dict(involved),
            "type": type_,
            "reason": reason,
            "message": message,
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": os.environ.get("HOSTNAME", "batchpilot-operator"),
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._request("POST", f"/api/v1/namespaces/{namespace}/events", json=body)


class KubeSink:
    """The controller's Sink on the Kubernetes API."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    async def patch_status(self, ref: Any, patch: Mapping[str, Any]) -> None:
        await self.client.patch_profile_status(ref.namespace, ref.name, patch)

    async def event(self, ref: Any, type_: str, reason: str, message: str) -> None:
        involved = {"apiVersion": API_VERSION, "kind": KIND, "name": ref.name, "namespace": ref.namespace}
        if ref.uid:
            involved["uid"] = ref.uid
        await self.client.create_event(ref.namespace, involved, type_, reason, message)

    async def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        return await self.client.get_secret_value(namespace, name, key)
