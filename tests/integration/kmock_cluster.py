"""kmock's Kubernetes emulator, extended into enough of an API server for kopf, the operator and kubectl.

What kmock 0.8's ``KubernetesEmulator`` lacks and this adds:

- ``metadata.resourceVersion`` set on create and bumped on every write (one
  cluster-wide counter, as etcd's revision), and ``409 Conflict`` for a patch
  that names a stale resourceVersion (optimistic concurrency);
- ``metadata.generation``: 1 on create, bumped when ``spec`` changes;
- ``uid``, ``creationTimestamp``, and ``generateName`` on create;
- list responses with ``kind: <Kind>List``, ``apiVersion`` and the current
  resourceVersion;
- the status subresource: ``PATCH .../status`` changes only ``status``, and a
  patch of the main resource leaves ``status`` alone (for resources that
  declare the subresource);
- discovery for the resources kopf, kubectl and the operator use (BatchProfiles,
  pods, events, secrets, namespaces, CRDs, kopf peerings);
- helpers to create pods with IPs and flip their readiness, and to inject
  failures (one-shot 409s on status patches, watch streams that go silent).

Deployments, StatefulSets and server-side apply are not emulated: the restart path's tests run on the
test control plane (tests/apiserver/test_restart_path.py), whose field ownership is the real one. What
stays on this emulator is what a real server will not do on demand; each such test says what it injects.

Watches stream whatever kmock streams (existing objects, then the event bus);
``timeoutSeconds`` is ignored, so kopf's client-side watch timeouts apply.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import kmock
from kmock._internal import dicts, rendering

from batchpilot_operator import GROUP, KIND, PLURAL, SINGULAR, VERSION
from tests.support import operator_process
from tests.support.factories import make_manifest
from tests.support.operator_process import free_port as free_port
from tests.support.operator_process import free_port_on_all as free_port_on_all
from tests.support.operator_process import wait_for as wait_for

PROFILES = f"{GROUP}/{VERSION}/{PLURAL}"
PODS = "v1/pods"
EVENTS = "v1/events"
SECRETS = "v1/secrets"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class KubeCluster(kmock.KubernetesEmulator):
    _revision: int = attrs.field(default=100, init=False)
    _status_subresources: set[Any] = attrs.field(factory=set, init=False)
    fail_status_patches: int = attrs.field(default=0, init=False)  # answer this many status patches with 409
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    # Per resource: how many times its open watch streams were silenced, and how many streams were opened.
    _watch_silencings: dict[Any, int] = attrs.field(factory=dict, init=False)
    watches_opened: dict[Any, int] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        info = kmock.ResourceInfo
        all_verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
        self.declare(PROFILES, info(kind=KIND, singular=SINGULAR, namespaced=True, shortnames={"bp"},
                                    verbs=all_verbs, subresources={"status"}))  # fmt: skip
        self.declare(PODS, info(kind="Pod", singular="pod", namespaced=True, verbs=all_verbs, subresources={"status"}))
        self.declare(EVENTS, info(kind="Event", singular="event", namespaced=True, verbs=all_verbs))
        self.declare(SECRETS, info(kind="Secret", singular="secret", namespaced=True, verbs=all_verbs))
        self.declare("v1/namespaces", info(kind="Namespace", singular="namespace", namespaced=False, verbs=all_verbs))
        self.declare("v1/configmaps", info(kind="ConfigMap", singular="configmap", namespaced=True, verbs=all_verbs))
        self.declare(
            "apiextensions.k8s.io/v1/customresourcedefinitions",
            info(kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False,
                 verbs=all_verbs),
        )  # fmt: skip
        self.declare("kopf.dev/v1/kopfpeerings", info(kind="KopfPeering", singular="kopfpeering", namespaced=True,
                                                      verbs=all_verbs))  # fmt: skip
        self.declare("kopf.dev/v1/clusterkopfpeerings",
                     info(kind="ClusterKopfPeering", singular="clusterkopfpeering", namespaced=False, verbs=all_verbs))  # fmt: skip

    def declare(self, resource: str, info: kmock.ResourceInfo) -> None:
        self.resources[resource] = info
        if "status" in info.subresources:
            self._status_subresources.add(kmock.resource(resource))

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    # ---- writes ---------------------------------------------------------------------------------------

    def _current(self, request: rendering.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return dict(self.objects[key].raw)
        return None

    def _prepare_create(self, request: rendering.Request) -> rendering.Request:
        data = copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["resourceVersion"] = self._next_revision()
        meta["generation"] = 1
        if request.resource == kmock.resource(PROFILES):
            data.pop("status", None)  # the API server ignores status on create when the subresource exists
        return attrs.evolve(request, data=data)

    def _prepare_update(self, request: rendering.Request) -> rendering.Request:
        current = self._current(request)
        if current is None:
            raise kmock.KubernetesObjectNotFoundError()
        if not isinstance(request.data, Mapping):
            return request  # JSON patches: passed through unchanged
        patch = copy.deepcopy(dict(request.data))
        wanted_version = (patch.get("metadata") or {}).get("resourceVersion")
        current_version = current.get("metadata", {}).get("resourceVersion")
        if wanted_version is not None and str(wanted_version) != str(current_version):
            raise kmock.KubernetesError(
                status=409,
                reason="Conflict",
                message=f"the object has been modified (resourceVersion {current_version})",
            )
        if request.subresource == "status":
            if self.fail_status_patches > 0:
                self.fail_status_patches -= 1
                raise kmock.KubernetesError(status=409, reason="Conflict", message="injected conflict on status")
            patch = {"status": patch.get("status")}
        elif request.resource in self._status_subresources:
            patch.pop("status", None)
        meta = patch.setdefault("metadata", {})
        meta["resourceVersion"] = self._next_revision()
        after = dicts.patch_dict(copy.deepcopy(current), patch)
        if after.get("spec") != current.get("spec"):
            meta["generation"] = int(current.get("metadata", {}).get("generation") or 1) + 1
        return attrs.evolve(request, data=patch)

    async def _handle(self, request: rendering.Request) -> Any:
        # kmock logs every request for assertions and matches each new one against that log, which makes
        # a long operator run quadratic; these tests assert on objects, so only a short tail is kept.
        if len(self._requests) > 400:
            del self._requests[:-50]
        for payload in self._payloads:
            if len(payload._requests) > 400:
                del payload._requests[:-50]
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            async with self._write_lock:
                original = request
                if request.action == kmock.action.CREATE:
                    request = self._prepare_create(request)
                else:
                    request = self._prepare_update(request)
                self._relog(original, request)
                return await super()._handle(request)
        return await super()._handle(request)

    def _relog(self, original: rendering.Request, rewritten: rendering.Request) -> None:
        """kmock's views filter by membership in the root's request log: log the rewritten request instead
        (searched from the end, where it was just appended: O(1), not O(all requests so far))."""
        for index in range(len(self._requests) - 1, -1, -1):
            if self._requests[index] is original:
                self._requests[index] = rewritten
                break

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        resource = request.resource
        self.watches_opened[resource] = self.watches_opened.get(resource, 0) + 1
        silencings = self._watch_silencings.get(resource, 0)
        async for payload in super()._serve_watch(request):
            if self._watch_silencings.get(resource, 0) != silencings:
                await asyncio.Event().wait()  # silenced: the connection stays open, nothing more is sent
            yield payload

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        # kmock repeats a resource's short names on its subresources, which kubectl then warns about.
        payload = await super()._serve_version(request)
        for resource in payload.get("resources", []) if isinstance(payload, dict) else []:
            if "/" in resource.get("name", ""):
                resource["shortNames"] = []
                resource["verbs"] = ["get", "patch", "update"]
        return payload

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_list(request)
        assert isinstance(payload, dict)
        info = self.resources[request.resource] if request.resource is not None else None
        kind = getattr(info, "kind", None) or "Object"
        group_version = (
            f"{request.resource.group}/{request.resource.version}"
            if request.resource is not None and request.resource.group
            else "v1"
        )
        payload["kind"] = f"{kind}List"
        payload["apiVersion"] = group_version
        payload["metadata"] = {"resourceVersion": str(self._revision)}
        return payload

    # ---- helpers for tests ----------------------------------------------------------------------------

    @staticmethod
    def kubeconfig(path: Path, server: str) -> Path:
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
            f"clusters:\n- name: kmock\n  cluster:\n    server: {server}\n"
            "contexts:\n- name: kmock\n  context:\n    cluster: kmock\n    user: kmock\n    namespace: default\n"
            "users:\n- name: kmock\n  user:\n    token: kmock-token\n"
        )
        return path

    def objects_of(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        res = kmock.resource(resource)
        return [
            dict(obj.raw)
            for (r, ns, _), obj in list(self.objects.items())
            if r == res and not obj.deleted and (namespace is None or ns == namespace)
        ]

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            return dict(self.objects[key].raw)
        return None

    def silence_watches(self, resource: str) -> None:
        """Every watch stream of ``resource`` open now stops sending and keeps its connection open, as a stream
        that a proxy or a dead API server replica drops silently. Streams opened later are served normally."""
        key = kmock.resource(resource)
        self._watch_silencings[key] = self._watch_silencings.get(key, 0) + 1

    def watch_count(self, resource: str) -> int:
        """Watch streams of ``resource`` opened so far (a reconnect opens a new one)."""
        return self.watches_opened.get(kmock.resource(resource), 0)

    def events_for(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return [e for e in self.objects_of(EVENTS, namespace) if (e.get("involvedObject") or {}).get("name") == name]


def profile_body(namespace: str, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    return make_manifest(spec, name=name, namespace=namespace)


def pod_body(namespace: str, name: str, labels: Mapping[str, str], ip: str, *, ready: bool) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {"containers": [{"name": "runtime", "image": "batchpilot-runtime"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


@asynccontextmanager
async def running_cluster() -> AsyncIterator[tuple[KubeCluster, str]]:
    """A started emulator and its base URL."""
    async with KubeCluster() as cluster, kmock.Server(cluster) as server:
        yield cluster, str(server.url).rstrip("/")


# ---- the operator as a subprocess, and waiting on conditions (tests/support/operator_process.py) -----------


class OperatorProcess(operator_process.OperatorProcess):
    """``batchpilot-operator run`` against the emulator (a kubeconfig naming ``server_url``), its log in a file."""

    def __init__(
        self,
        workdir: Path,
        server_url: str,
        *args: str,
        name: str = "operator",
        options: Mapping[str, Any] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        kubeconfig = KubeCluster.kubeconfig(workdir / "kubeconfig", server_url)
        super().__init__(workdir, kubeconfig, *args, name=name, options=options)
