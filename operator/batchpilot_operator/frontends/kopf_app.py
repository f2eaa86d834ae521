"""``batchpilot-operator run``: the kopf operator around the shared :class:`Controller`.

kopf watches BatchProfiles and runtime pods and hands what it sees to the
controller; the controller's single loop does the observing, deciding,
pushing and status writing for every profile (see :mod:`.controller`).

- BatchProfile create/resume/update -> ``upsert_profile`` (resume restores the
  window in force from status, so a restarted operator continues, not resets);
  delete -> ``remove_profile`` (no finalizer: there is nothing to clean up).
- Pod events -> the pod index (namespace -> pods; profiles match by selector),
  and a pod that becomes Ready is pushed the current window at once.
- Liveness (kopf's probe endpoint) fails when the loop has not finished an
  iteration for a while, or when the BatchProfile watch is stuck: every
  ``watch_check_s`` the active replica lists BatchProfiles and compares their
  resourceVersions with those the watch delivered; a difference that survives
  two checks means the watch stream died silently. kopf's own
  ``inactivity_timeout`` reconnects dead streams; the check catches what that
  misses. It fails too while that listing has failed two checks in a row (the
  API server or its etcd down: the loop still iterates, pushes go on, but no
  status lands), and passes again at the first listing that answers.
- Peering: several replicas run, one is active. kopf pauses its watches on the
  replica with the lower priority; the loop reads the same peering object and
  pauses with it. The default priority is the start time, so during a rolling
  update the newer replica takes over and the older one pauses: never two.
- A paused replica (a standby) has no watch to check: kopf closed it, so every
  write of the active replica would look like a missed event, the kubelet would
  restart the standby, the restarted one would win the peering with its newer
  start time, and leadership would ping-pong. A standby's liveness is its loop
  iterating and its own peering keep-alive landing (its record in the peering
  object stays alive), which is what it needs to take over. Its first watch
  check comes a full ``watch_check_s`` after it becomes active, when kopf has
  resumed and re-listed.
- kopf's own state lives in annotations (the CRD's status schema has no room
  for ``status.kopf``), and kopf's per-handler Events are limited to warnings.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

import kopf

from batchpilot_operator import GROUP, PLURAL, VERSION
from batchpilot_operator.control.controller import Controller, PodRecord, Settings
from batchpilot_operator.frontends.run_options import RunOptions as RunOptions  # named here by its tests
from batchpilot_operator.io.kube import KubeClient, KubeConfig, KubeError, KubeSink, load_kube_config
from batchpilot_operator.io.opmetrics import OperatorMetrics
from batchpilot_operator.io.push import AdminClient

log = logging.getLogger("batchpilot.operator")

ANNOTATION_PREFIX = "batchpilot.dev"


def _pod_record(body: Mapping[str, Any]) -> PodRecord:
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions if isinstance(c, Mapping))
    ready = ready and not meta.get("deletionTimestamp") and status.get("phase", "Running") == "Running"
    return PodRecord(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name")),
        labels=dict(meta.get("labels") or {}),
        ip=status.get("podIP"),
        ready=bool(ready and status.get("podIP")),
        uid=meta.get("uid"),
    )


class PeeringGate:
    """Is this replica the active one? Reads kopf's peering object the way kopf does.

    Active when no live peer has the same or a higher priority, and this replica has been
    registered for ``settle_s`` (kopf pauses its handlers by the same rule). With peering
    ``required``, a missing peering object pauses this replica, as it pauses kopf.

    Also watches this replica's own keep-alive (kopf's, written every lifetime minus 5-10 s):
    :meth:`heartbeat_problem` names a record that a readable peering object has not held alive
    for longer than a grace period.
    """

    def __init__(
        self,
        client: KubeClient,
        *,
        name: str,
        namespace: str | None,
        identity: str,
        priority: int,
        settle_s: float = 3.0,
        required: bool = False,
    ) -> None:
        self.client, self.name, self.namespace = client, name, namespace
        self.identity, self.priority = identity, priority
        # A newcomer waits this long after registering before it acts, so that an older active replica
        # (which re-reads the peering object every check) has paused: never two active at once.
        self.settle_s = settle_s
        self.required = required
        self.timeout_s = 3.0
        self._registered_s: float | None = None
        self.active = True
        self.reason = "standalone"
        # Keep-alive bookkeeping (monotonic seconds): when the own record was last seen alive, or
        # when the first readable peering object was (so that kopf has a grace period to register).
        self.own_alive_s: float | None = None
        self.object_found = False  # the latest refresh read the peering object

    def _path(self) -> str:
        if self.namespace is None:
            return f"/apis/kopf.dev/v1/clusterkopfpeerings/{self.name}"
        return f"/apis/kopf.dev/v1/namespaces/{self.namespace}/kopfpeerings/{self.name}"

    async def refresh(self) -> bool:
        self.object_found = False
        plural = "clusterkopfpeerings" if self.namespace is None else "kopfpeerings"
        try:
            body = await self.client.get_custom_object(
                "kopf.dev", "v1", plural, self.name, self.namespace, timeout_s=self.timeout_s
            )
        except KubeError as error:
            if error.status == 404 and self.required:
                self.active, self.reason = False, f"peering required but {self._path()} is missing: paused, as kopf is"
                return False
            if error.status == 404:
                self.active, self.reason = True, "no peering object: standalone"
                return True
            # Not knowing whether another replica is active (no answer, or an error), this one must not act.
            self.active, self.reason = False, f"peering object unreadable ({error}): paused to be safe"
            return False
        self.object_found = True
        now = datetime.datetime.now(datetime.UTC)
        peers = body.get("status") or {}
        rivals = []
        for peer_id, info in peers.items():
            if peer_id == self.identity or not isinstance(info, Mapping):
                continue
            if _peer_alive(info, now) and int(info.get("priority", 0)) >= self.priority:
                rivals.append(f"{peer_id} (priority {info.get('priority')})")
        own = peers.get(self.identity)
        if self.own_alive_s is None or (isinstance(own, Mapping) and _peer_alive(own, now)):
            self.own_alive_s = time.monotonic()
        if self.identity not in peers:
            self.active, self.reason = False, "waiting for kopf to register this replica in the peering object"
            return False
        if self._registered_s is None:
            self._registered_s = time.monotonic()
        settled = time.monotonic() - self._registered_s >= self.settle_s
        self.active = not rivals and settled
        if rivals:
            self.reason = f"paused in favour of {', '.join(rivals)}"
        elif not settled:
            self.reason = "registered; letting older replicas see this one and pause first"
        else:
            self.reason = "active"
        return self.active

    def heartbeat_problem(self, now_s: float, grace_s: float) -> str | None:
        """Why this replica's keep-alive is missing, or None: its record has not been alive in the readable peering
        object for ``grace_s`` (monotonic ``now_s``). An unreadable or absent object says nothing about this
        replica and is no problem here."""
        if not self.object_found or self.own_alive_s is None:
            return None
        silent_s = now_s - self.own_alive_s
        if silent_s <= grace_s:
            return None
        return f"this replica's record in {self._path()} not alive for {silent_s:.0f} s (limit {grace_s:g} s)"


def _peer_alive(info: Mapping[str, Any], now: datetime.datetime) -> bool:
    """kopf's rule: a peer is alive until ``lastseen + lifetime``; a record it cannot parse is dead."""
    try:
        lastseen = datetime.datetime.fromisoformat(str(info.get("lastseen")))
        if lastseen.tzinfo is None:
            lastseen = lastseen.replace(tzinfo=datetime.UTC)
        return lastseen + datetime.timedelta(seconds=int(info.get("lifetime", 60))) > now
    except (TypeError, ValueError):
        return False


class OperatorApp:
    """Everything one ``run`` holds: the controller, its clients, the kopf registry."""

    def __init__(self, options: RunOptions, kube_config: KubeConfig | None = None) -> None:
        self.options = options
        self.kube_config = kube_config or load_kube_config(options.kubeconfig, options.context)
        self.kube = KubeClient(self.kube_config)
        self.metrics = OperatorMetrics()
        token = options.admin_token_file.read_text().strip() if options.admin_token_file else None
        source = None
        if options.prometheus_url:
            from batchpilot_operator.io.promql import PrometheusSource

            source = PrometheusSource(
                options.prometheus_url,
                scrape_interval_s=options.scrape_interval_s,
                interval_s=options.interval_override_s or 15.0,
                timeout_s=options.query_timeout_s,
            )
        self.source = source
        self.admin = AdminClient(
            timeout_s=options.push_timeout_s, retries=options.push_retries, concurrency=options.push_concurrency
        )
        self.controller = Controller(
            Settings(
                tick_s=options.tick_s,
                interval_override_s=options.interval_override_s,
                scrape_interval_s=options.scrape_interval_s,
                default_token=token,
                default_token_namespaces=frozenset(
                    options.admin_token_namespaces or options.namespaces or [self.kube_config.namespace]
                ),
                stuck_after_s=options.stuck_after_s,
                resync_s=options.resync_s,
            ),
            source,
            self.admin,
            KubeSink(self.kube),
            metrics=self.metrics,
            workloads=self.kube,
        )
        self.identity = f"batchpilot-{uuid.uuid4().hex[:12]}"
        self.priority = options.priority if options.priority is not None else int(time.time() * 1000) % 2**31
        peering_namespace = None if not options.namespaces else options.namespaces[0]
        self.gate = PeeringGate(
            self.kube,
            name=options.peering_name,
            namespace=peering_namespace,
            identity=self.identity,
            priority=self.priority,
            settle_s=max(2.0 * options.peering_check_s, 1.0) + 1.0,
            required=options.peering == "required",
        )
        self.seen_versions: dict[str, str] = {}  # profile key -> resourceVersion the watch delivered
        self.watch_suspects: dict[str, str] = {}
        self.watch_stuck: str | None = None  # only ever set while this replica is active
        # The watch check's listing failing twice in a row (the API server or its etcd down): liveness fails,
        # saying so, until a listing answers again.
        self.api_failures = 0
        self.api_unreachable: str | None = None
        self._last_watch_check_s = time.monotonic()
        self._watch_paused = False  # paused by peering at the latest watch step
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.registry = kopf.OperatorRegistry()
        self._register()

    # ---- kopf handlers ----------------------------------------------------------------------------

    def _register(self) -> None:
        """Register every handler, in this order: startup, cleanup and login; profiles; pods; the probe."""
        self._register_lifecycle()
        self._register_profiles()
        self._register_pods_and_probe()

    def _register_lifecycle(self) -> None:
        """Startup (kopf's settings, the loop, the metrics server), cleanup, and login with the operator's kube config."""
        registry = self.registry
        controller = self.controller
        options = self.options

        @kopf.on.startup(registry=registry)
        async def configure(settings: Any, **_: Any) -> None:
            settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
            settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
                prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
            )
            settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
            settings.posting.level = logging.WARNING
            settings.watching.server_timeout = options.watch_server_timeout_s
            settings.watching.client_timeout = options.watch_client_timeout_s
            settings.watching.inactivity_timeout = options.watch_inactivity_timeout_s
            settings.watching.connect_timeout = 10
            settings.networking.request_timeout = 30
            settings.peering.clusterwide = not options.namespaces
            settings.peering.name = options.peering_name
            settings.peering.lifetime = options.peering_lifetime_s
            logging.getLogger("httpx").setLevel(logging.WARNING)
            logging.getLogger("httpcore").setLevel(logging.WARNING)
            if not options.verbose:
                logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # one line per handler call otherwise
            controller.start_clock()
            self._tasks.append(asyncio.create_task(self._loop(), name="batchpilot-loop"))
            self.metrics.serve(options.metrics_port)
            log.info(
                "batchpilot operator started: identity %s, priority %d, prometheus %s",
                self.identity,
                self.priority,
                options.prometheus_url or "none",
            )

        @kopf.on.cleanup(registry=registry)
        async def cleanup(**_: Any) -> None:
            await self.aclose()

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> Any:
            # kopf calls this again after a 401: an expired exec-plugin or service-account token is renewed here.
            config = self.kube_config
            scheme, token = config.authorization()
            client = config.configuration
            return kopf.ConnectionInfo(
                server=config.server,
                scheme=scheme,
                token=token,
                ca_path=client.ssl_ca_cert,
                certificate_path=client.cert_file,
                private_key_path=client.key_file,
                insecure=not client.verify_ssl,
                default_namespace=config.namespace,
            )

    def _register_profiles(self) -> None:
        """BatchProfile create/resume/update and delete, and the raw watch events that the watch check compares."""
        registry = self.registry
        controller = self.controller

        def upsert(
            *, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, namespace: str | None, name: str, **_: Any
        ) -> None:
            namespace = namespace or "default"
            controller.upsert_profile(
                namespace,
                name,
                dict(spec),
                generation=meta.get("generation"),
                status=dict(status) if status else None,
                uid=meta.get("uid"),
            )
            log.info("profile %s/%s (generation %s) registered", namespace, name, meta.get("generation"))

        for on in (kopf.on.create, kopf.on.resume, kopf.on.update):
            on(GROUP, VERSION, PLURAL, registry=registry, id=f"profile-{on.__name__}")(upsert)

        @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry, optional=True, id="profile-delete")
        def forget(*, namespace: str | None, name: str, **_: Any) -> None:
            namespace = namespace or "default"
            controller.remove_profile(namespace, name)
            self.seen_versions.pop(f"{namespace}/{name}", None)

        @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="profile-watch")
        def watched(*, event: kopf.RawEvent, meta: kopf.Meta, namespace: str | None, name: str, **_: Any) -> None:
            key = f"{namespace or 'default'}/{name}"
            if event.get("type") == "DELETED":
                self.seen_versions.pop(key, None)
            elif meta.get("resourceVersion"):
                self.seen_versions[key] = str(meta.get("resourceVersion"))
                record = controller.profiles.get(key)
                status = (event.get("object") or {}).get("status")
                if record is not None and isinstance(status, Mapping) and not record.status.written:
                    record.status.written = dict(status)

    def _register_pods_and_probe(self) -> None:
        """The pod index (a pod that turns Ready is pushed the window at once) and the liveness probe."""
        registry = self.registry
        controller = self.controller
        options = self.options
        pod_labels: dict[str, str] | None = dict(options.pod_labels) if options.pod_labels else None

        @kopf.on.event("", "v1", "pods", registry=registry, id="pod-index", labels=pod_labels)
        async def pod_event(*, event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
            record = _pod_record(body)
            if event.get("type") == "DELETED":
                controller.remove_pod(record.namespace, record.name)
                return
            to_push = controller.upsert_pod(record)
            if to_push and self.gate.active:
                log.info("pod %s is Ready: pushing %d profile(s)", record.key, len(to_push))
                await controller.sync_now(to_push)

        @kopf.on.probe(registry=registry, id="loop")
        def loop_alive(**_: Any) -> str:
            healthy, why = controller.health()
            if not healthy:
                raise kopf.PermanentError(f"observation loop stuck: {why}")
            if self.watch_stuck:
                raise kopf.PermanentError(f"BatchProfile watch stuck: {self.watch_stuck}")
            if self.api_unreachable:
                raise kopf.PermanentError(f"API server unreachable: {self.api_unreachable}")
            if options.peering != "off":
                # Two lifetimes without a keep-alive landing: one for the record to expire, one more to be sure.
                problem = self.gate.heartbeat_problem(time.monotonic(), grace_s=float(options.peering_lifetime_s))
                if problem:
                    raise kopf.PermanentError(f"peering keep-alive missing: {problem}")
            return why if self.gate.active else f"standby ({self.gate.reason}); {why}"

    # ---- the loop ---------------------------------------------------------------------------------

    async def _loop(self) -> None:
        last_gate_check = -math.inf
        while not self._stop.is_set():
            try:
                # 1. Peering: is this replica the active one?
                if self.options.peering != "off" and time.monotonic() - last_gate_check >= self.options.peering_check_s:
                    last_gate_check = time.monotonic()
                    await self.gate.refresh()
                # 2. The tick, or (paused) only the proof that the loop still iterates.
                if self.gate.active:
                    await self.controller.tick()
                else:
                    log.debug("inactive: %s", self.gate.reason)
                    self.controller.last_tick_finished_s = time.monotonic()
                # 3. The watch check, on the active replica only.
                await self._watch_step()
            except Exception:
                log.exception("operator loop iteration failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self.options.tick_s)

    async def _watch_step(self) -> None:
        """Check the watch every ``watch_check_s`` while active. While paused by peering, kopf has closed its
        watches: forget every suspicion, and restart the period, so that the first check after resuming comes a
        full period later (kopf re-lists meanwhile) and a verdict needs two more."""
        now_s = time.monotonic()
        due = now_s - self._last_watch_check_s >= self.options.watch_check_s
        if not self.gate.active:
            if self.watch_stuck:
                log.info("paused by peering: the BatchProfile watch is kopf's to resume, not stuck")
            self.watch_suspects, self.watch_stuck = {}, None
            self._watch_paused = True
            if due:
                self.metrics.watch_checks.labels("standby").inc()
                self._last_watch_check_s = now_s
        elif self._watch_paused:
            self._watch_paused = False
            self._last_watch_check_s = now_s
        elif due:
            self._last_watch_check_s = now_s
            try:
                await self._check_watch()
            except KubeError as error:
                self.api_failures += 1
                if self.api_failures >= 2:
                    if not self.api_unreachable:
                        log.warning("the API server failed %d watch checks in a row; liveness fails", self.api_failures)
                    self.api_unreachable = f"{self.api_failures} watch checks in a row failed: {error}"
                raise
            if self.api_unreachable:
                log.info("the API server answers again after %d failed watch checks", self.api_failures)
            self.api_failures, self.api_unreachable = 0, None

    async def _check_watch(self) -> None:
        """Compare the API's resourceVersions with the watch's; a gap that lasts two checks is a dead watch."""
        listed: dict[str, str] = {}
        namespaces: list[str | None] = list(self.options.namespaces) or [None]
        try:
            for namespace in namespaces:
                for item in await self.kube.list_profiles(namespace):
                    meta = item.get("metadata") or {}
                    listed[f"{meta.get('namespace')}/{meta.get('name')}"] = str(meta.get("resourceVersion"))
        except KubeError:
            self.metrics.watch_checks.labels("error").inc()
            raise
        behind = {k: v for k, v in listed.items() if self.seen_versions.get(k) != v}
        persistent = {k: v for k, v in behind.items() if self.watch_suspects.get(k) == v}
        self.watch_suspects = behind
        was_stuck = self.watch_stuck
        self.watch_stuck = (
            f"{len(persistent)} profile(s) changed without a watch event, e.g. {next(iter(persistent))}"
            if persistent
            else None
        )
        self.metrics.watch_checks.labels("stuck" if persistent else "behind" if behind else "in_sync").inc()
        if self.watch_stuck and not was_stuck:
            log.warning("BatchProfile watch stuck: %s; liveness fails until it catches up", self.watch_stuck)
        elif was_stuck and not self.watch_stuck:
            log.info("BatchProfile watch caught up")

    async def aclose(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.controller.drain_events(timeout_s=2.0)
        await self.admin.aclose()
        await self.controller.sglang.client.aclose()
        await self.kube.aclose()
        if self.source is not None:
            self.source.close()

    async def run(self, stop_flag: asyncio.Event | None = None) -> None:
        peering = self.options.peering
        await kopf.operator(
            registry=self.registry,
            clusterwide=not self.options.namespaces,
            namespaces=self.options.namespaces,
            standalone=True if peering == "off" else None,
            priority=self.priority,
            # A peering name makes kopf's peering mandatory; "auto" sets the name in the startup handler instead.
            peering_name=self.options.peering_name if peering == "required" else None,
            liveness_endpoint=self.options.liveness,
            identity=self.identity,  # type: ignore[arg-type]
            stop_flag=stop_flag,
        )
