"""The operator's own calls to the Kubernetes API (status patches, Events, Secrets), through the ``kubernetes`` client.

kopf watches and runs the handlers; the observation loop writes status and
Events itself (a kopf timer stops for good after a failed patch, one of kopf's
known failure modes, and kopf's own status writes merge into the handler's
result). Every call made here is listed in :mod:`batchpilot_operator.api.rbac`:
``batchprofiles`` list, ``batchprofiles/status`` patch, ``events`` create,
``secrets`` get, a get of kopf's peering object, and (``tuning.mode: restart``)
``deployments``/``statefulsets`` get and a server-side apply of one container's
args under the field manager ``batchpilot``.

Credentials are ``kubernetes.config``'s: the in-cluster service account when
running in a pod and no kubeconfig was named (its token re-read as it
rotates), else the kubeconfig (``$KUBECONFIG``'s files merged, or
``~/.kube/config``; the current or a named context), exec plugins included,
run again when their token expires. The same :class:`KubeConfig` is handed to
kopf through its login handler, so both use one identity.

The client is synchronous (urllib3): each call runs in this client's own small
thread pool, never on the event loop, with a total deadline and no retries
inside (the next tick is the retry; a retry would hold the thread past the
deadline). Failures arrive as :class:`KubeError`: the API's status and message,
or no status when no answer came.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import datetime
import functools
import json
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import urllib3
from kubernetes.client import (
    ApiClient,
    ApiException,
    AppsV1Api,
    Configuration,
    CoreV1Api,
    CoreV1Event,
    CustomObjectsApi,
    V1EventSource,
    V1ObjectMeta,
    V1ObjectReference,
)
from kubernetes.config import ConfigException, list_kube_config_contexts
from kubernetes.config import load_kube_config as load_kubeconfig_file
from kubernetes.config.incluster_config import InClusterConfigLoader

from batchpilot_operator import API_VERSION, GROUP, KIND, PLURAL, VERSION
from batchpilot_operator.io.token_secrets import ADMIN_TOKEN_LABEL, SecretNotOptedIn

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# The field manager of the restart path's server-side applies: what Argo CD's ignoreDifferences
# (managedFieldsManagers) and docs/engines.md name, so that GitOps can be told to leave these fields alone.
FIELD_MANAGER = "batchpilot"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
MAX_ERROR_CHARS = 500
T = TypeVar("T")


class KubeError(Exception):
    """A call that failed: ``status`` is the API's HTTP status, None when no answer came (refused, TLS, deadline)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status is not None else f"no answer: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class KubeConfig:
    """Where the API server is and who the operator is there, plus the namespace of the kubeconfig context
    (or of the service account). ``configuration``'s refresh hook renews expiring tokens."""

    configuration: Configuration
    namespace: str = "default"

    @classmethod
    def for_server(cls, server: str, *, token: str | None = None, namespace: str = "default") -> KubeConfig:
        """A bare server URL (an emulator, ``kubectl proxy``), with an optional bearer token."""
        configuration = _configuration()
        configuration.host = server.rstrip("/")
        if token:
            configuration.api_key["BearerToken"] = token
            configuration.api_key_prefix["BearerToken"] = "Bearer"
        return cls(configuration, namespace)

    @property
    def server(self) -> str:
        return str(self.configuration.host)

    def authorization(self) -> tuple[str | None, str | None]:
        """The Authorization header as (scheme, credentials), renewed first when it has expired (an exec plugin
        runs again, a rotated service-account token is re-read): what kopf's login handler hands to kopf."""
        header = self.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        if not header:
            return None, None
        scheme, _, credentials = header.partition(" ")
        return (scheme, credentials) if credentials else (None, scheme)


def _configuration() -> Configuration:
    configuration = Configuration()
    configuration.retries = False  # one attempt per call, inside its deadline (see the module docstring)
    return configuration


def load_kube_config(
    kubeconfig: Path | None = None,
    context: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeConfig:
    """In-cluster when running in a pod (and no kubeconfig was named), else the kubeconfig file(s)."""
    environ = os.environ if environ is None else environ
    if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in environ and (service_account_dir / "token").exists():
        return _in_cluster(environ, service_account_dir)
    return _from_kubeconfig(kubeconfig, context, environ)


def _in_cluster(environ: Mapping[str, str], account: Path) -> KubeConfig:
    configuration = _configuration()
    loader = InClusterConfigLoader(  # type: ignore[no-untyped-call]
        token_filename=str(account / "token"),
        cert_filename=str(account / "ca.crt"),
        environ={"KUBERNETES_SERVICE_PORT": "443", **environ},
    )
    try:
        loader.load_and_set(configuration)  # type: ignore[no-untyped-call]
    except ConfigException as error:
        raise ValueError(f"in-cluster credentials in {account}: {error}") from error
    namespace_file = account / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.exists() else ""
    return KubeConfig(configuration, namespace or "default")


def _from_kubeconfig(kubeconfig: Path | None, context: str | None, environ: Mapping[str, str]) -> KubeConfig:
    # $KUBECONFIG is read here, at call time: the library's default was fixed when it was imported.
    paths = (
        str(kubeconfig) if kubeconfig is not None else environ.get("KUBECONFIG") or str(Path.home() / ".kube/config")
    )
    if not any(Path(path).expanduser().exists() for path in paths.split(os.pathsep) if path):
        raise FileNotFoundError(f"no kubeconfig at {paths} and not running in a cluster")
    configuration = _configuration()
    configuration.host = ""
    try:
        contexts, current = list_kube_config_contexts(config_file=paths)  # type: ignore[no-untyped-call]
        name = context or current["name"]
        chosen = next((c for c in contexts if c.get("name") == name), None)
        if chosen is None:
            raise ValueError(f"kubeconfig {paths}: context {name!r} not found")
        load_kubeconfig_file(  # type: ignore[no-untyped-call]
            config_file=paths, context=name, client_configuration=configuration, persist_config=False
        )
    except ConfigException as error:
        raise ValueError(f"kubeconfig {paths}: {error}") from error
    if not configuration.host:
        raise ValueError(f"kubeconfig {paths}: the cluster of context {name!r} has no server")
    return KubeConfig(configuration, (chosen.get("context") or {}).get("namespace") or "default")


def _api_error(error: ApiException) -> KubeError:
    """The API's Status message when the body is one, else the body or the reason, as the callers log it."""
    message = str(error.body or error.reason or "")
    try:
        body = json.loads(message)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        message = str(body["message"])
    # Status 0: the client's own failures (TLS, a request it cannot build); no answer came.
    return KubeError(error.status or None, message[:MAX_ERROR_CHARS])


def _json_body(response: Any) -> dict[str, Any]:
    """The JSON object of an unread urllib3 response (``_preload_content=False``), its connection released."""
    try:
        body = json.loads(response.data or b"{}")
    finally:
        response.release_conn()
    return body if isinstance(body, dict) else {}


class KubeClient:
    """The operator's calls, each run in a worker thread with a total deadline of ``timeout_s``."""

    def __init__(self, config: KubeConfig, *, timeout_s: float = 10.0, max_concurrency: int = 8) -> None:
        self.config = config
        self.timeout_s = timeout_s
        self._api = ApiClient(config.configuration)
        self._core = CoreV1Api(self._api)
        self._custom = CustomObjectsApi(self._api)
        self._apps = AppsV1Api(self._api)
        # Events are posted concurrently; this bounds the threads (and connections) they take.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="kube")

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._api.close()  # type: ignore[no-untyped-call]

    async def _call(self, method: Callable[..., T], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> T:
        call = functools.partial(method, *args, _request_timeout=timeout_s or self.timeout_s, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        except ApiException as error:
            raise _api_error(error) from error
        except urllib3.exceptions.HTTPError as error:
            raise KubeError(None, f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]) from error

    async def patch_profile_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386: ``None`` deletes a key) of the status subresource."""
        body = await self._call(
            self._custom.patch_namespaced_custom_object_status,
            GROUP, VERSION, namespace, PLURAL, name, {"status": dict(patch)},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        return body if isinstance(body, dict) else {}

    async def list_profiles(self, namespace: str | None = None) -> list[dict[str, Any]]:
        if namespace:
            body = await self._call(self._custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL)
        else:
            body = await self._call(self._custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
        items = body.get("items") if isinstance(body, dict) else None
        return [item for item in items or [] if isinstance(item, dict)]

    async def get_custom_object(
        self, group: str, version: str, plural: str, name: str, namespace: str | None = None, *, timeout_s: float
    ) -> dict[str, Any]:
        """One custom object, cluster-scoped when ``namespace`` is None (kopf's peering objects)."""
        if namespace is None:
            body = await self._call(
                self._custom.get_cluster_custom_object, group, version, plural, name, timeout_s=timeout_s
            )
        else:
            body = await self._call(
                self._custom.get_namespaced_custom_object, group, version, namespace, plural, name, timeout_s=timeout_s
            )
        return body if isinstance(body, dict) else {}

    async def get_secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One key of one Secret of ``namespace``. The profile model already holds names to the API's own
        patterns; the client quotes each path segment, which keeps any other name (``../other/secrets/x``) out
        of the path too, but a whole segment of ``.`` or ``..`` would still move it."""
        for what, segment in (("namespace", namespace), ("Secret name", name)):
            if segment in ("", ".", ".."):
                raise ValueError(f"{what} {segment!r} is not a name")
        secret = await self._call(self._core.read_namespaced_secret, name, namespace)
        if ((secret.metadata and secret.metadata.labels) or {}).get(ADMIN_TOKEN_LABEL) != "true":
            raise SecretNotOptedIn(namespace, name)
        data = secret.data or {}
        if key in data:
            return base64.b64decode(data[key]).decode().strip()
        string_data = secret.string_data or {}
        return str(string_data[key]).strip() if key in string_data else None

    async def read_workload(self, namespace: str, kind: str, name: str) -> dict[str, Any]:
        """A Deployment or StatefulSet as the API returns it (JSON, no client model in between)."""
        read = {"Deployment": self._apps.read_namespaced_deployment,
                "StatefulSet": self._apps.read_namespaced_stateful_set}.get(kind)  # fmt: skip
        if read is None:
            raise ValueError(f"workload kind {kind!r} is not one of {', '.join(WORKLOAD_KINDS)}")
        return _json_body(await self._call(read, name, namespace, _preload_content=False))

    async def apply_container_args(
        self, namespace: str, kind: str, name: str, container: str, args: list[str]
    ) -> dict[str, Any]:
        """Server-side apply of one container's ``args`` under :data:`FIELD_MANAGER`, forced: the args were
        another manager's (kubectl, Argo CD, Flux), and this takes them over, so that GitOps tools told to
        ignore this manager's fields stop reverting them. Nothing else of the workload is in the apply, so
        nothing else becomes the operator's. A change of the pod template rolls the workload."""
        patch = {"Deployment": self._apps.patch_namespaced_deployment,
                 "StatefulSet": self._apps.patch_namespaced_stateful_set}.get(kind)  # fmt: skip
        if patch is None:
            raise ValueError(f"workload kind {kind!r} is not one of {', '.join(WORKLOAD_KINDS)}")
        body = {
            "apiVersion": "apps/v1",
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"template": {"spec": {"containers": [{"name": container, "args": list(args)}]}}},
        }
        response = await self._call(
            patch, name, namespace, body, field_manager=FIELD_MANAGER, force=True,
            _content_type="application/apply-patch+yaml", _preload_content=False,
        )  # fmt: skip
        return _json_body(response)

    async def create_event(
        self,
        namespace: str,
        involved: V1ObjectReference,
        type_: str,
        reason: str,
        message: str,
        component: str = "batchpilot-operator",
    ) -> None:
        """A core/v1 Event; its own time, since the API server keeps what it is given."""
        now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        event = CoreV1Event(
            metadata=V1ObjectMeta(name=f"{involved.name or 'batchpilot'}.{uuid.uuid4().hex[:16]}", namespace=namespace),
            involved_object=involved,
            type=type_,
            reason=reason,
            message=message,
            source=V1EventSource(component=component),
            reporting_component=component,
            reporting_instance=os.environ.get("HOSTNAME", "batchpilot-operator"),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        await self._call(self._core.create_namespaced_event, namespace, event)


class KubeSink:
    """The controller's Sink on the Kubernetes API."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    async def patch_status(self, ref: Any, patch: Mapping[str, Any]) -> None:
        await self.client.patch_profile_status(ref.namespace, ref.name, patch)

    async def event(self, ref: Any, type_: str, reason: str, message: str) -> None:
        involved = V1ObjectReference(
            api_version=API_VERSION, kind=KIND, name=ref.name, namespace=ref.namespace, uid=ref.uid or None
        )
        await self.client.create_event(ref.namespace, involved, type_, reason, message)

    async def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        return await self.client.get_secret_value(namespace, name, key)
