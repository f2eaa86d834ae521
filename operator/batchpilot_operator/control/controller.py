"""The reconciler shared by ``run`` (kopf) and ``local``: profiles, pods, one loop for all.

The kopf handlers (or local mode's file loader) only tell the controller what
exists: :meth:`Controller.upsert_profile`, :meth:`Controller.upsert_pod` and
their removals. Everything else happens in :meth:`Controller.tick`, run by one
loop for all profiles:

1. pick the profiles whose interval is due (intervals are aligned on one grid,
   so profiles with the same interval are evaluated on the same tick and the
   grouped queries run once per interval, however many profiles there are);
2. collect every due model's metrics from the source in one call;
3. decide per profile and mode (adaptive: the policy; recommend: the policy,
   reported only; static: the spec's window); a window that changed goes to
   status at once, with the policy's memory that chose it (written ahead of the
   push, so that an operator killed before step 5 leaves a status its successor
   continues from: one more patch per window change, none per tick);
4. sync every ready pod of the due profiles (and of profiles with a pending
   push) to the window in force, concurrently;
5. build each profile's status, patch it when it changed, post Events, update
   the operator's own metrics.

Nothing one profile does can stop another: each step catches per profile. A
pod's failure (refused, 5xx, garbage, too slow, too long) is its PushResult, so
its profile's Synced condition names it; anything else one profile's sync or
status raises, a bug included, is logged with its traceback and lands on that
profile alone (Synced=False, reason PushFailed, and a Warning Event), while the
tick goes on for the others. Every outbound call has a deadline and a body cap
(push.py, scrape.py, promql.py), so a slow pod holds the tick for a bounded time
only. A status patch that fails leaves the last-written status as it was, so the
next tick's patch carries every field again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchpilot_operator.api.profile import (
    BatchProfileSpec,
    Decision,
    Friendliness,
    PodsStatus,
    ProfileError,
    TuningMode,
    WindowInForce,
    parse_spec,
)
from batchpilot_operator.control.status import (
    FALSE,
    TRUE,
    UNKNOWN,
    ConditionFact,
    StatusFacts,
    build_status,
    merge_patch,
    rfc3339,
)
from batchpilot_operator.control.status import apply_merge_patch as apply_patch
from batchpilot_operator.io.observe import (
    INTER_TOKEN,
    MetricsUnavailable,
    ModelKey,
    ModelMetrics,
    lookup,
    to_observations,
)
from batchpilot_operator.io.opmetrics import OperatorMetrics
from batchpilot_operator.io.outbound import base_url
from batchpilot_operator.io.push import (
    CONFLICT,
    ERROR,
    OK,
    REFUSED,
    UNAUTHORIZED,
    AdminClient,
    PodTarget,
    PushFailed,
    PushResult,
)
from batchpilot_operator.tuning import policy as policy_mod
from batchpilot_operator.tuning import policy_memo
from batchpilot_operator.tuning.observations import Observations, known
from batchpilot_runtime.contract.admin_api import LaneWindow, WindowState
from batchpilot_runtime.contract.window import Window

log = logging.getLogger("batchpilot.operator")


@dataclass(frozen=True)
class Settings:
    """Operator settings. ``interval_override_s`` replaces every profile's intervalSeconds (tests use
    sub-5-second intervals through it; the resource itself allows 5 s at least)."""

    tick_s: float = 1.0
    interval_override_s: float | None = None
    scrape_interval_s: float = 15.0
    default_token: str | None = None
    # The namespaces whose pods may receive default_token (the operator's own, fleet-wide token); a pod
    # elsewhere gets only its profile's Secret, or no request. Empty: default_token goes to no pod.
    default_token_namespaces: frozenset[str] = frozenset()
    stuck_after_s: float = 120.0  # liveness fails when no tick finished for this long
    max_events_per_tick: int = 200  # a flood guard: 1,000 failing profiles must not DoS the API server
    # A pod known to run the window in force is read back at most this often (0: every interval). Restarts
    # are caught sooner anyway in kopf mode: a restarted pod turns Ready again and is pushed at once.
    resync_s: float = 0.0


class MetricsSource(Protocol):
    async def collect(self, targets: Mapping[ModelKey, Sequence[str]]) -> dict[ModelKey, ModelMetrics]: ...


@dataclass(frozen=True)
class ProfileRef:
    namespace: str
    name: str
    uid: str | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class Sink(Protocol):
    """Where status, events and decisions go: the Kubernetes API, or local mode's printer."""

    async def patch_status(self, ref: ProfileRef, patch: Mapping[str, Any]) -> None: ...

    async def event(self, ref: ProfileRef, type_: str, reason: str, message: str) -> None: ...

    async def read_secret(self, namespace: str, name: str, key: str) -> str | None: ...


@dataclass(frozen=True)
class PodRecord:
    """A runtime pod as the controller needs it. Local mode fills the URLs and model directly."""

    namespace: str
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    ip: str | None = None
    ready: bool = False
    admin_url: str | None = None
    metrics_url: str | None = None
    model: str | None = None
    token: str | None = None
    uid: str | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class ProfileRecord:
    ref: ProfileRef
    generation: int | None
    spec: BatchProfileSpec | None
    error: str | None
    status_written: dict[str, Any] = field(default_factory=dict)
    window: Window | None = None
    policy_state: policy_mod.PolicyState = field(default_factory=policy_mod.PolicyState)
    last_slot: int | None = None
    push_pending: bool = True
    pod_states: dict[str, WindowState] = field(default_factory=dict)
    pod_errors: dict[str, str] = field(default_factory=dict)
    sync_error: str | None = None  # what the last sync of this profile raised (a bug), None when it ran through
    refused: dict[str, int] = field(default_factory=dict)
    clamped: dict[str, str] = field(default_factory=dict)
    last_decision: Decision | None = None
    last_reason: str | None = None
    recommended: Window | None = None
    observations: Observations | None = None
    metrics_fact: ConditionFact = field(default_factory=lambda: ConditionFact(UNKNOWN, "Pending", "no observation yet"))
    friendliness: Any = None
    invalid_reported_generation: int | None = None
    evaluations: int = 0
    pods_cache_key: tuple[int, int] | None = None
    verified_s: dict[str, float] = field(default_factory=dict)
    pods_cache: list[PodRecord] = field(default_factory=list)

    @property
    def model(self) -> str | None:
        return self.spec.model if self.spec else None


@dataclass
class TickReport:
    evaluated: int = 0
    changed: int = 0
    queries: int = 0
    pushes: int = 0
    push_failures: int = 0
    status_patches: int = 0
    status_failures: int = 0
    seconds: float = 0.0
    metrics_error: str | None = None


def lanes_of(spec: BatchProfileSpec, generation: int) -> list[LaneWindow] | None:
    if not spec.lanes:
        return None
    return [
        LaneWindow(
            name=lane.name, window=Window.from_fields(lane.window, generation), reserved_slots=lane.reserved_slots
        )
        for lane in spec.lanes
    ]


class Controller:
    def __init__(
        self,
        settings: Settings,
        source: MetricsSource | None,
        admin: AdminClient,
        sink: Sink,
        *,
        metrics: OperatorMetrics | None = None,
        match_by_model: bool = False,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        on_decision: Callable[[ProfileRecord, policy_mod.Decision], None] | None = None,
    ) -> None:
        self.settings = settings
        self.source = source
        self.admin = admin
        self.sink = sink
        self.metrics = metrics or OperatorMetrics()
        self.match_by_model = match_by_model
        self._wall = wall_clock
        self._mono = monotonic
        self.on_decision = on_decision
        self.profiles: dict[str, ProfileRecord] = {}
        self.pods: dict[str, dict[str, PodRecord]] = {}  # namespace -> pod name -> pod (the pod index)
        self.last_tick_started_s: float | None = None
        self.last_tick_finished_s: float | None = None
        self.ticks = 0
        self.last_report = TickReport()
        # (namespace, name, key) -> (read at, the token or None, why it is None)
        self._secret_cache: dict[tuple[str, str, str], tuple[float, str | None, str]] = {}
        self._tick_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._events_this_tick = 0
        self._pods_version = 0
        self._label_index: dict[tuple[str, str, str], dict[str, PodRecord]] = {}
        self._profile_index: dict[tuple[str, str, str], set[str]] = {}
        self._profiles_unindexed: set[str] = set()
        self._pending_events: set[asyncio.Future[None]] = set()
        self._started_s = 0.0

    # ---- what exists --------------------------------------------------------------------------------

    def upsert_profile(
        self,
        namespace: str,
        name: str,
        spec: Any,
        *,
        generation: int | None = None,
        status: Mapping[str, Any] | None = None,
        uid: str | None = None,
    ) -> ProfileRecord:
        """Add or update a profile from its (unvalidated) spec mapping. An invalid spec is kept, with its error."""
        ref = ProfileRef(namespace, name, uid)
        try:
            parsed: BatchProfileSpec | None = parse_spec(spec)
            error = None
        except ProfileError as problem:
            parsed, error = None, str(problem)
        record = self.profiles.get(ref.key)
        old_index_key = self._profile_index_key(record) if record is not None else None
        if record is None:
            record = ProfileRecord(ref=ref, generation=generation, spec=parsed, error=error)
            record.status_written = dict(status or {})
            record.window = _window_from_status(status)
            record.policy_state = self._policy_from_status(ref, status, parsed, generation)
            self.profiles[ref.key] = record
        else:
            old_spec = record.spec
            record.ref, record.generation, record.spec, record.error = ref, generation, parsed, error
            if status is not None:
                record.status_written = dict(status)
            if parsed is not None and old_spec is not None and parsed.window != old_spec.window:
                record.window = None  # a new starting window: reset to it on the next push
            if parsed is not None and old_spec is not None and parsed.lanes != old_spec.lanes and record.window:
                record.window = record.window.with_generation(record.window.generation + 1)
            if parsed is not None and parsed != old_spec:
                # The same rule as for a memory restored across a spec change: a restart changes nothing.
                record.policy_state = policy_memo.carry_over(record.policy_state, parsed)
        if parsed is not None:
            self._ensure_window(record)
        self._reindex_profile(record, old_index_key)
        record.push_pending = True
        self.metrics.profiles_managed.set(len(self.profiles))
        self._wake.set()
        return record

    def _policy_from_status(
        self, ref: ProfileRef, status: Mapping[str, Any] | None, spec: BatchProfileSpec | None, generation: int | None
    ) -> policy_mod.PolicyState:
        """The policy's memory kept in status by an earlier operator, or a fresh one (said once, in the log)."""
        restored = policy_memo.restore(status, spec, generation, self._wall())
        if restored.problem is not None:
            log.warning("profile %s: policy memory in status not used, starting afresh: %s", ref.key, restored.problem)
        elif restored.carried_over:
            log.info("profile %s: policy memory from status carried over to generation %s", ref.key, generation)
        return restored.state

    def remove_profile(self, namespace: str, name: str) -> None:
        record = self.profiles.pop(f"{namespace}/{name}", None)
        if record is not None:
            key = self._profile_index_key(record)
            if key is not None:
                self._profile_index.get(key, set()).discard(record.ref.key)
            self._profiles_unindexed.discard(record.ref.key)
        if record is not None and record.spec is not None:
            self.metrics.forget_profile(namespace, name, record.spec.model)
        self.metrics.profiles_managed.set(len(self.profiles))

    def upsert_pod(self, pod: PodRecord) -> list[ProfileRecord]:
        """Record a pod; returns the profiles that must push to it now (it is Ready and not known synced)."""
        before = self.pods.get(pod.namespace, {}).get(pod.name)
        if before is not None:
            self._unindex(before)
        self.pods.setdefault(pod.namespace, {})[pod.name] = pod
        self._index(pod)
        if before != pod:
            self._pods_version += 1
        restarted = before is not None and before.uid != pod.uid
        became_ready = pod.ready and (before is None or not before.ready or restarted or before.ip != pod.ip)
        if not became_ready:
            return []
        matching = [r for r in self._candidate_profiles(pod) if r.spec is not None and self._selects(r, pod)]
        for record in matching:
            record.pod_states.pop(pod.key, None)
            record.refused.pop(pod.key, None)
        return matching

    def remove_pod(self, namespace: str, name: str) -> None:
        pod = self.pods.get(namespace, {}).pop(name, None)
        if pod is None:
            return
        self._unindex(pod)
        self._pods_version += 1
        for record in self.profiles.values():
            record.pod_states.pop(pod.key, None)
            record.pod_errors.pop(pod.key, None)
            record.refused.pop(pod.key, None)

    def _profile_index_key(self, record: ProfileRecord) -> tuple[str, str, str] | None:
        spec = record.spec
        if spec is None:
            return None
        if self.match_by_model:
            return ("", "", spec.model)
        if spec.selector.match_labels:
            key, value = next(iter(spec.selector.match_labels.items()))
            return (record.ref.namespace, key, value)
        return None  # matchExpressions only: checked against every pod

    def _reindex_profile(self, record: ProfileRecord, old_key: tuple[str, str, str] | None) -> None:
        if old_key is not None:
            self._profile_index.get(old_key, set()).discard(record.ref.key)
        self._profiles_unindexed.discard(record.ref.key)
        if record.spec is None:
            return
        new_key = self._profile_index_key(record)
        if new_key is None:
            self._profiles_unindexed.add(record.ref.key)
        else:
            self._profile_index.setdefault(new_key, set()).add(record.ref.key)

    def _candidate_profiles(self, pod: PodRecord) -> list[ProfileRecord]:
        """Profiles that may select this pod, from the profile index (not every profile)."""
        keys = set(self._profiles_unindexed)
        for index_key in self._index_keys(pod):
            keys |= self._profile_index.get(index_key, set())
        return [self.profiles[k] for k in sorted(keys) if k in self.profiles]

    # The pod index: (namespace, label key, label value) -> pods, and model -> pods in local mode, so that
    # finding a profile's pods costs its own pods, not all pods (1,000 profiles x 4,000 pods otherwise).
    def _index_keys(self, pod: PodRecord) -> list[tuple[str, str, str]]:
        if self.match_by_model:
            return [("", "", pod.model or "")]
        return [(pod.namespace, key, value) for key, value in pod.labels.items()]

    def _index(self, pod: PodRecord) -> None:
        for key in self._index_keys(pod):
            self._label_index.setdefault(key, {})[pod.key] = pod

    def _unindex(self, pod: PodRecord) -> None:
        for key in self._index_keys(pod):
            self._label_index.get(key, {}).pop(pod.key, None)

    def _selects(self, record: ProfileRecord, pod: PodRecord) -> bool:
        if record.spec is None:
            return False
        if self.match_by_model:
            return pod.model == record.spec.model
        return pod.namespace == record.ref.namespace and record.spec.selector.matches(dict(pod.labels))

    def pods_of(self, record: ProfileRecord) -> list[PodRecord]:
        """The profile's pods, sorted; cached until a pod or the profile's selector changes."""
        spec = record.spec
        if spec is None:
            return []
        cache_key = (self._pods_version, id(spec))
        if record.pods_cache_key == cache_key:
            return record.pods_cache
        candidates: list[PodRecord]
        if self.match_by_model:
            candidates = list(self._label_index.get(("", "", spec.model), {}).values())
        elif spec.selector.match_labels:
            key, value = next(iter(spec.selector.match_labels.items()))
            candidates = list(self._label_index.get((record.ref.namespace, key, value), {}).values())
        else:
            candidates = list(self.pods.get(record.ref.namespace, {}).values())
        record.pods_cache = sorted((p for p in candidates if self._selects(record, p)), key=lambda p: p.key)
        record.pods_cache_key = cache_key
        return record.pods_cache

    # ---- windows ------------------------------------------------------------------------------------

    def _ensure_window(self, record: ProfileRecord) -> None:
        spec = record.spec
        if spec is None:
            return
        if spec.tuning.mode == TuningMode.STATIC:
            current = record.window
            if current is None or not current.fields_equal(spec.window):
                generation = (current.generation + 1) if current else 1
                record.window = Window.from_fields(spec.window, generation)
            return
        if record.window is None:
            previous = _window_from_status(record.status_written)
            generation = previous.generation + 1 if previous else 1
            record.window = Window.from_fields(spec.window, generation)

    def _interval_s(self, record: ProfileRecord) -> float:
        if self.settings.interval_override_s is not None:
            return self.settings.interval_override_s
        return float(record.spec.tuning.interval_seconds) if record.spec else 15.0

    # ---- the loop -----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``tick_s`` (or at once when a profile changes) until ``stop`` is set."""
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # the loop must survive anything one tick does
                log.exception("tick failed")
            self._wake.clear()
            wake = asyncio.ensure_future(self._wake.wait())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({wake, stopping}, timeout=self.settings.tick_s, return_when=asyncio.FIRST_COMPLETED)
            for task in (wake, stopping):
                task.cancel()

    def health(self) -> tuple[bool, str]:
        """Liveness: False when the loop has not finished a tick for ``stuck_after_s``."""
        now = self._mono()
        reference = self.last_tick_finished_s or self._started_s
        age = now - reference
        if age > self.settings.stuck_after_s:
            return False, f"no tick finished for {age:.0f} s (limit {self.settings.stuck_after_s:g} s)"
        return True, f"last tick {age:.1f} s ago"

    def start_clock(self) -> None:
        self._started_s = self._mono()

    async def tick(self) -> TickReport:
        async with self._tick_lock:
            return await self._tick()

    async def _tick(self) -> TickReport:
        started = self._mono()
        if not self._started_s:
            self._started_s = started
        self.last_tick_started_s = started
        now_s = self._wall()
        report = TickReport()
        self._events_this_tick = 0

        # 1. Which profiles are due (aligned slots: floor(now / interval)).
        due: list[ProfileRecord] = []
        for record in self.profiles.values():
            if record.spec is None:
                continue
            slot = math.floor(started / self._interval_s(record))
            if record.last_slot != slot:
                record.last_slot = slot
                due.append(record)

        # 2. One collection for every due model.
        metrics: dict[ModelKey, ModelMetrics] = {}
        metrics_error: str | None = None
        if due and self.source is not None:
            targets: dict[ModelKey, list[str]] = {}
            for record in due:
                urls = [
                    p.metrics_url or f"{base_url(p.ip, record.spec.runtime.serve_port)}/metrics"  # type: ignore[arg-type,union-attr]
                    for p in self.pods_of(record)
                    if p.ready and (p.metrics_url or p.ip)
                ]
                key = (record.ref.namespace if not self.match_by_model else "", record.spec.model)  # type: ignore[union-attr]
                targets.setdefault(key, []).extend(urls)
            collect_started = self._mono()
            try:
                metrics = await self.source.collect(targets)
            except MetricsUnavailable as error:
                metrics_error = str(error)
                self.metrics.query_errors.labels(query="all").inc()
            except Exception as error:  # a source bug must not stop the loop
                metrics_error = f"{type(error).__name__}: {error}"
                self.metrics.query_errors.labels(query="all").inc()
            self.metrics.query_seconds.labels(query="all").observe(self._mono() - collect_started)
            report.queries = getattr(getattr(self.source, "last_stats", None), "queries", 0)
        elif due:
            metrics_error = "no metric source configured"
        report.metrics_error = metrics_error

        # 3. Decide.
        windows_before = {r.ref.key: r.window for r in due}
        for record in due:
            try:
                self._decide(record, metrics, metrics_error, now_s, report)
            except Exception as error:
                log.exception("decision for %s failed", record.ref.key)
                record.metrics_fact = ConditionFact(UNKNOWN, "DecisionFailed", f"{type(error).__name__}: {error}")
        report.evaluated = len(due)
        changed = [r for r in due if r.window is not None and r.window != windows_before[r.ref.key]]
        if changed:
            await self._write_statuses(changed, now_s, report, only=("window", "policy"))

        # 4. Push (due profiles, and any with a pending push: new profiles, spec changes, new pods).
        to_sync = {r.ref.key: r for r in due}
        to_sync.update({r.ref.key: r for r in self.profiles.values() if r.push_pending and r.spec is not None})
        await self._sync_profiles(list(to_sync.values()), report)

        # 5. Status, events, metrics.
        touched = {r.ref.key: r for r in [*due, *to_sync.values()]}
        touched.update({r.ref.key: r for r in self.profiles.values() if r.spec is None})
        await self._write_statuses(list(touched.values()), now_s, report)
        report.seconds = self._mono() - started
        self.metrics.tick_seconds.observe(report.seconds)
        self.last_tick_finished_s = self._mono()
        self.ticks += 1
        self.last_report = report
        return report

    def _decide(
        self,
        record: ProfileRecord,
        metrics: Mapping[ModelKey, ModelMetrics],
        metrics_error: str | None,
        now_s: float,
        report: TickReport,
    ) -> None:
        spec = record.spec
        if spec is None:
            return
        latency_metric = spec.slo.latency_metric.value
        namespace = "" if self.match_by_model else record.ref.namespace
        model_metrics = None if metrics_error else lookup(metrics, namespace, spec.model)
        obs = to_observations(model_metrics, latency_metric, now_s)
        record.observations = obs
        record.evaluations += 1
        if metrics_error:
            record.metrics_fact = ConditionFact(FALSE, "MetricsUnavailable", metrics_error)
        elif model_metrics is None:
            record.metrics_fact = ConditionFact(
                FALSE, "NoSeries", f"no series for model {spec.model!r} in namespace {record.ref.namespace!r}"
            )
        elif not known(obs.p99_s):
            record.metrics_fact = ConditionFact(
                FALSE, "NoData", f"no {latency_metric} observations in the last {model_metrics.window_s:.0f} s"
            )
        else:
            record.metrics_fact = ConditionFact(
                TRUE, "MetricsAvailable", f"P99 from {obs.samples:.0f} requests over {model_metrics.window_s:.0f} s"
            )

        self._ensure_window(record)
        window = record.window
        if window is None:
            return
        if spec.tuning.mode == TuningMode.STATIC:
            decision = policy_mod.Decision(
                window, "hold", "Static mode: the spec's window is pushed as it is.", record.policy_state
            )
        elif spec.tuning.mode == TuningMode.RECOMMEND:
            in_force = self._pods_window(record) or window
            decision = policy_mod.decide(spec, in_force, obs, record.policy_state, now_s)
            record.policy_state = decision.state
            record.recommended = decision.window if decision.changed else None
        else:
            decision = policy_mod.decide(spec, window, obs, record.policy_state, now_s)
            record.policy_state = decision.state
            if decision.changed:
                record.window = decision.window
                record.push_pending = True
                report.changed += 1
        if decision.friendliness is not None and spec.batch_friendliness == Friendliness.AUTO:
            record.friendliness = decision.friendliness.to_status()
        direction: str = decision.direction
        if spec.tuning.mode == TuningMode.RECOMMEND and decision.changed:
            direction = "recommend"
        previous = record.last_decision
        if previous is None or (previous.direction, previous.reason) != (direction, decision.reason):
            # The same hold repeated is not news: keeping its first time keeps the status unchanged (no patch).
            record.last_decision = Decision(time=rfc3339(now_s), direction=direction, reason=decision.reason)
        self.metrics.decisions.labels(record.ref.namespace, record.ref.name, spec.model, direction).inc()
        log.log(
            logging.INFO if direction != "hold" else logging.DEBUG,
            "decision %s: %s %s: %s",
            record.ref.key,
            direction,
            decision.window.describe(),
            decision.reason,
        )
        if self.on_decision is not None:
            self.on_decision(record, decision)
        if decision.changed or direction == "recommend" or decision.reason != record.last_reason:
            # Holds that repeat the same reason are not re-posted: one Event per new reason, one per change.
            message = decision.reason
            if decision.changed and spec.tuning.mode != TuningMode.RECOMMEND:
                message = f"{decision.window.describe()}: {decision.reason}"
            elif direction == "recommend":
                message = f"recommend {decision.window.describe()}: {decision.reason}"
            self._queue_event(record, "Normal", f"Decision{direction.capitalize()}", message)
        record.last_reason = decision.reason

    def _pods_window(self, record: ProfileRecord) -> Window | None:
        for state in record.pod_states.values():
            return state.window
        return None

    # ---- pushes -------------------------------------------------------------------------------------

    async def _token(self, record: ProfileRecord, pod: PodRecord) -> tuple[str | None, str | None]:
        """``(token, None)``: the bearer token for this pod, None for none; ``(None, why)``: a token this pod must
        not receive, so no request goes to it.

        In order: the pod's own token (local mode: given on the command line); the profile's Secret, always read
        in the profile's namespace and sent only to a pod of that namespace; the operator's own token, sent only
        to pods of ``default_token_namespaces``.
        """
        if pod.token:
            return pod.token, None
        spec = record.spec
        if spec is not None and spec.runtime.admin_token_secret is not None:
            ref = spec.runtime.admin_token_secret
            if pod.namespace != record.ref.namespace:  # _selects never lets this happen; a Secret stays at home
                return None, (
                    f"not sent: the token of Secret {record.ref.namespace}/{ref.name} goes only to pods "
                    f"of namespace {record.ref.namespace!r}"
                )
            key = (record.ref.namespace, ref.name, ref.key)
            cached = self._secret_cache.get(key)
            if cached is None or self._mono() - cached[0] >= 60.0:
                try:
                    token = await self.sink.read_secret(record.ref.namespace, ref.name, ref.key)
                    problem = f"has no key {ref.key!r}"
                except Exception as error:
                    log.warning("reading Secret %s/%s failed: %s", record.ref.namespace, ref.name, error)
                    token, problem = (cached[1] if cached else None), f"could not be read: {error}"
                cached = self._secret_cache[key] = (self._mono(), token, problem)
            if cached[1] is None:  # no token is no reason to send a request without one (or with another)
                return None, f"not sent: Secret {record.ref.namespace}/{ref.name} {cached[2]}"
            return cached[1], None
        if self.settings.default_token is None:
            return None, None
        if pod.namespace in self.settings.default_token_namespaces:
            return self.settings.default_token, None
        allowed = ", ".join(sorted(self.settings.default_token_namespaces)) or "none"
        return None, (
            f"not sent: the operator's admin token goes only to pods in namespaces {allowed}, not "
            f"{pod.namespace!r}; name a Secret of namespace {pod.namespace!r} in spec.runtime.adminTokenSecret"
        )

    def _target(self, record: ProfileRecord, pod: PodRecord, token: str | None) -> PodTarget | None:
        if pod.admin_url:
            return PodTarget(pod.key, pod.admin_url, token)
        if pod.ip and record.spec is not None:
            return PodTarget(pod.key, base_url(pod.ip, record.spec.runtime.admin_port), token)
        return None

    async def _sync_profiles(self, records: Sequence[ProfileRecord], report: TickReport) -> None:
        """Sync every profile concurrently; what one profile's sync raises stays that profile's."""
        await asyncio.gather(*(self._sync_profile_isolated(r, report) for r in records))

    async def _sync_profile_isolated(self, record: ProfileRecord, report: TickReport) -> None:
        try:
            await self._sync_profile(record, report)
        except Exception as error:  # a bug in one profile's sync: its status says so, the others go on
            log.exception("sync of %s failed", record.ref.key)
            text = f"{type(error).__name__}: {error}"
            report.push_failures += 1
            record.push_pending = False  # the next due tick tries again, as after a failed push
            if record.sync_error != text:  # one Event per new error, not one per tick
                self._queue_event(record, "Warning", "PushFailed", f"sync failed: {text}")
            record.sync_error = text
        else:
            record.sync_error = None

    async def sync_now(self, records: Sequence[ProfileRecord]) -> None:
        """Push at once (a pod just became Ready), outside the interval."""
        async with self._tick_lock:
            report = TickReport()
            await self._sync_profiles(records, report)
            await self._write_statuses(records, self._wall(), report)

    async def _sync_profile(self, record: ProfileRecord, report: TickReport) -> None:
        spec, window = record.spec, record.window
        if spec is None or window is None or spec.tuning.mode == TuningMode.RECOMMEND:
            if spec is not None and spec.tuning.mode == TuningMode.RECOMMEND:
                await self._read_pods(record)
            record.push_pending = False
            return
        pods = [p for p in self.pods_of(record) if p.ready]
        jobs: list[Awaitable[PushResult]] = []
        not_sent: list[PushResult] = []  # pods no token may go to: no request at all
        now = self._mono()
        lanes = lanes_of(spec, window.generation)
        for pod in pods:
            if record.refused.get(pod.key) == window.generation:
                continue  # refused before: never retried until the window changes
            state = record.pod_states.get(pod.key)
            in_sync = state is not None and state.window.generation >= window.generation
            recently = now - record.verified_s.get(pod.key, -math.inf) < self.settings.resync_s
            if in_sync and pod.key not in record.pod_errors and recently:
                continue  # known in sync and checked recently: no request at all
            token, withheld = await self._token(record, pod)
            if withheld is not None:
                not_sent.append(PushResult(pod.key, UNAUTHORIZED, detail=withheld))
                continue
            target = self._target(record, pod, token)
            if target is None:
                continue
            # Behind (or never seen): PUT at once. In sync: read it back (a restart shows up here).
            jobs.append(self.admin.sync(target, window, lanes, verify=in_sync))
        results = list(await asyncio.gather(*jobs))
        newest = max((r.state.window.generation for r in results if r.outcome == CONFLICT and r.state), default=None)
        if newest is not None and newest >= window.generation:
            # Some pod holds a newer generation (an earlier operator, a lost status): move past it, push again.
            record.window = window.with_generation(newest + 1)
            retry_names = {r.pod for r in results if r.outcome == CONFLICT}
            retry_jobs: list[Awaitable[PushResult]] = []
            for pod in pods:
                if pod.key not in retry_names:
                    continue
                target = self._target(record, pod, (await self._token(record, pod))[0])
                if target is not None:
                    retry_jobs.append(self.admin.sync(target, record.window, lanes_of(spec, record.window.generation)))
            retried = await asyncio.gather(*retry_jobs)
            results = [r for r in results if r.pod not in retry_names] + list(retried)
        for result in results + not_sent:
            self._account(record, result, report)
        # Failed pods are not retried before the next interval (sync already retried with backoff);
        # being level-triggered, the next due tick finds them behind and pushes again.
        record.push_pending = False

    async def _read_pods(self, record: ProfileRecord) -> None:
        """Recommend mode: only read what the pods run (for status), never write."""
        for pod in self.pods_of(record):
            if not pod.ready:
                continue
            token, withheld = await self._token(record, pod)
            if withheld is not None:
                record.pod_errors[pod.key] = f"{UNAUTHORIZED}: {withheld}"
                continue
            target = self._target(record, pod, token)
            if target is None:
                continue
            try:
                record.pod_states[pod.key] = await self.admin.get_state(target)
                record.pod_errors.pop(pod.key, None)
            except PushFailed as error:
                record.pod_errors[pod.key] = f"{error.outcome}: {error.detail}"

    def _account(self, record: ProfileRecord, result: PushResult, report: TickReport) -> None:
        spec = record.spec
        model = spec.model if spec else ""
        labels = (record.ref.namespace, record.ref.name, model)
        if result.state is not None:
            record.pod_states[result.pod] = result.state
            record.verified_s[result.pod] = self._mono()
        if result.pushed:
            report.pushes += 1
            self.metrics.pushes.labels(*labels, "ok").inc()
        if result.ok:
            record.pod_errors.pop(result.pod, None)
            if result.clamped is not None:
                record.clamped[result.pod] = result.detail
                self._queue_event(record, "Warning", "WindowClamped", f"pod {result.pod}: {result.detail}")
            else:
                record.clamped.pop(result.pod, None)
            return
        report.push_failures += 1
        self.metrics.pushes.labels(*labels, result.outcome).inc()
        self.metrics.push_errors.labels(*labels).inc()
        record.pod_errors[result.pod] = f"{result.outcome}: {result.detail}"
        if result.outcome == REFUSED and record.window is not None:
            record.refused[result.pod] = record.window.generation
        self._queue_event(record, "Warning", "PushFailed", f"pod {result.pod}: {result.outcome}: {result.detail}")

    # ---- status and events --------------------------------------------------------------------------

    def _queue_event(self, record: ProfileRecord, type_: str, reason: str, message: str) -> None:
        if self._events_this_tick >= self.settings.max_events_per_tick:
            return
        self._events_this_tick += 1
        task = asyncio.ensure_future(self._post_event(record.ref, type_, reason, message))
        self._pending_events.add(task)
        task.add_done_callback(self._pending_events.discard)

    async def _post_event(self, ref: ProfileRef, type_: str, reason: str, message: str) -> None:
        try:
            await self.sink.event(ref, type_, reason, message[:1024])
        except Exception as error:
            log.warning("posting Event %s for %s failed: %s", reason, ref.key, error)

    async def drain_events(self, timeout_s: float | None = None) -> None:
        """Wait for Events still being posted; after ``timeout_s`` the rest are dropped (shutdown)."""
        pending = list(self._pending_events)
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)

    def facts(self, record: ProfileRecord) -> StatusFacts:
        spec = record.spec
        if spec is None:
            invalid = ConditionFact(FALSE, "InvalidSpec", record.error or "invalid spec")
            return StatusFacts(
                generation=record.generation,
                ready=invalid,
                synced=ConditionFact(UNKNOWN, "InvalidSpec", "nothing is pushed for an invalid spec"),
                metrics_available=ConditionFact(UNKNOWN, "InvalidSpec", "not observed"),
                slo_met=ConditionFact(UNKNOWN, "InvalidSpec", "not observed"),
                policy=policy_memo.to_status(record.policy_state, record.generation),
            )
        pods = self.pods_of(record)
        ready = [p for p in pods if p.ready]
        window = record.window
        recommend = spec.tuning.mode == TuningMode.RECOMMEND
        if recommend:
            shown = self._pods_window(record)
            synced_pods = [p for p in ready if p.key in record.pod_states]
        else:
            shown = window
            synced_pods = [
                p
                for p in ready
                if window is not None
                and (state := record.pod_states.get(p.key)) is not None
                and state.window.generation >= window.generation
                and p.key not in record.pod_errors
            ]
        pods_status = PodsStatus(
            total=len(pods), ready=len(ready), synced=len(synced_pods), summary=f"{len(synced_pods)}/{len(ready)}"
        )
        errors = [
            f"{pod}: {error}" for pod, error in sorted(record.pod_errors.items()) if pod in {p.key for p in ready}
        ]
        if not ready:
            synced = ConditionFact(FALSE, "NoReadyPods", f"no Ready pod matches the selector of model {spec.model!r}")
        elif record.sync_error is not None:
            synced = ConditionFact(FALSE, "PushFailed", f"sync failed: {record.sync_error}"[:4000])
        elif recommend:
            synced = ConditionFact(TRUE, "RecommendOnly", "recommend mode: the operator never pushes")
        elif errors:
            refused = any(": refused:" in e for e in errors)
            synced = ConditionFact(FALSE, "PushRefused" if refused else "PushFailed", "; ".join(errors)[:4000])
        elif len(synced_pods) < len(ready):
            synced = ConditionFact(FALSE, "Pending", f"{len(synced_pods)} of {len(ready)} Ready pods run the window")
        else:
            clamps = "; ".join(f"{p}: {d}" for p, d in sorted(record.clamped.items()))
            synced = ConditionFact(
                TRUE,
                "Clamped" if clamps else "Synced",
                clamps or f"{len(ready)} Ready pods run generation {window.generation if window else 0}",
            )
        obs = record.observations
        slo_met = _slo_fact(spec, obs)
        if synced.status == TRUE:
            ready_fact = ConditionFact(TRUE, "Ready", synced.message)
        else:
            ready_fact = ConditionFact(FALSE, synced.reason, synced.message)
        observed = obs.to_status() if obs is not None else None
        return StatusFacts(
            generation=record.generation,
            window=WindowInForce(**shown.model_dump(), applied_at=None) if shown is not None else None,
            observed=observed,
            pods=pods_status,
            last_decision=record.last_decision,
            recommended_window=record.recommended,
            friendliness=record.friendliness,
            policy=policy_memo.to_status(record.policy_state, record.generation),
            ready=ready_fact,
            synced=synced,
            metrics_available=record.metrics_fact,
            slo_met=slo_met,
        )

    async def _write_statuses(
        self, records: Sequence[ProfileRecord], now_s: float, report: TickReport, only: tuple[str, ...] | None = None
    ) -> None:
        """Write every profile's status (or only the fields ``only`` names) concurrently; one that cannot be
        built is logged and skipped."""
        await asyncio.gather(*(self._write_status_isolated(r, now_s, report, only) for r in records))

    async def _write_status_isolated(
        self, record: ProfileRecord, now_s: float, report: TickReport, only: tuple[str, ...] | None = None
    ) -> None:
        try:
            await self._write_status(record, now_s, report, only)
        except Exception:  # a bug in one profile's status: the others are still written
            log.exception("status of %s could not be built", record.ref.key)
            report.status_failures += 1

    async def _write_status(
        self, record: ProfileRecord, now_s: float, report: TickReport, only: tuple[str, ...] | None = None
    ) -> None:
        now_iso = rfc3339(now_s)
        facts = self.facts(record)
        if record.spec is None and record.invalid_reported_generation != record.generation:
            record.invalid_reported_generation = record.generation
            self._queue_event(record, "Warning", "InvalidSpec", record.error or "invalid spec")
        new_status = build_status(facts, record.status_written, now_iso)
        old_window = record.status_written.get("window")
        if (
            facts.window is not None
            and isinstance(old_window, Mapping)
            and old_window.get("generation") == (facts.window.generation)
        ):
            new_status["window"]["appliedAt"] = old_window.get("appliedAt") or now_iso
        elif "window" in new_status:
            new_status["window"]["appliedAt"] = now_iso
        written = record.status_written
        if only is not None:
            new_status = {k: v for k, v in new_status.items() if k in only}
            written = {k: v for k, v in written.items() if k in only}
        patch = merge_patch(written, new_status)
        self._export(record, facts)
        if not patch:
            return
        try:
            await self.sink.patch_status(record.ref, patch)
        except Exception as error:
            report.status_failures += 1
            log.warning("status patch of %s failed (retried next tick): %s", record.ref.key, error)
            return
        report.status_patches += 1
        record.status_written = apply_patch(record.status_written, patch)

    def _export(self, record: ProfileRecord, facts: StatusFacts) -> None:
        spec = record.spec
        if spec is None:
            return
        labels = (record.ref.namespace, record.ref.name, spec.model)
        if facts.pods is not None:
            for state, value in (
                ("total", facts.pods.total),
                ("ready", facts.pods.ready),
                ("synced", facts.pods.synced),
            ):
                self.metrics.profile_pods.labels(*labels, state).set(value)
        for name, fact in (
            ("Ready", facts.ready),
            ("Synced", facts.synced),
            ("MetricsAvailable", facts.metrics_available),
            ("SLOMet", facts.slo_met),
        ):
            self.metrics.profile_condition.labels(*labels, name).set({TRUE: 1.0, FALSE: 0.0}.get(fact.status, -1.0))
        metric = spec.slo.latency_metric.value
        if spec.slo.p99_ms is not None:
            self.metrics.slo_seconds.labels(*labels, metric, "0.99").set(spec.slo.p99_ms / 1000)
        if spec.slo.p999_ms is not None:
            self.metrics.slo_seconds.labels(*labels, metric, "0.999").set(spec.slo.p999_ms / 1000)
        if spec.slo.inter_token_p99_ms is not None:
            self.metrics.slo_seconds.labels(*labels, INTER_TOKEN, "0.99").set(spec.slo.inter_token_p99_ms / 1000)
        if record.window is not None:
            self.metrics.window_target.labels(*labels).set(record.window.target_batch_size)
            self.metrics.window_cap.labels(*labels).set(record.window.hard_cap)
            self.metrics.window_wait.labels(*labels).set(record.window.max_wait_ms / 1000)
            self.metrics.window_generation.labels(*labels).set(record.window.generation)
            self.metrics.window_budget.labels(*labels).set(record.window.max_prefill_tokens or 0)


def _slo_fact(spec: BatchProfileSpec, obs: Observations | None) -> ConditionFact:
    """The SLOMet condition: False when any objective of the SLO is over, unknown with no data for any."""
    slo = spec.slo
    over = None if obs is None else policy_mod.slo_over(spec, obs)
    if obs is None or over is None:
        return ConditionFact(UNKNOWN, "NoData", "no latency data")
    parts: list[str] = []
    if slo.p99_ms is not None and not math.isnan(policy_mod.latency_ratio(spec, obs)):
        parts.append(
            f"P99 {obs.p99_s * 1000:.0f} ms vs SLO {slo.p99_ms:g} ms" + (" (top bucket)" if obs.p99_saturated else "")
        )
    p999_over = slo.p999_ms is not None and (
        obs.p999_saturated or (known(obs.p999_s) and obs.p999_s * 1000 > slo.p999_ms)
    )
    if slo.inter_token_p99_ms is not None and not math.isnan(policy_mod.itl_ratio(spec, obs)):
        parts.append(f"inter-token P99 {obs.itl_p99_s * 1000:.0f} ms vs {slo.inter_token_p99_ms:g} ms")
    text = "; ".join(parts)
    if over or p999_over:
        return ConditionFact(FALSE, "SLOMissed", text + (" (P99.9 over)" if p999_over and not over else ""))
    return ConditionFact(TRUE, "SLOMet", text)


def _window_from_status(status: Mapping[str, Any] | None) -> Window | None:
    if not status or not isinstance(status.get("window"), Mapping):
        return None
    try:
        raw = {k: v for k, v in status["window"].items() if k != "appliedAt"}
        return Window.model_validate(raw)
    except Exception:
        return None


__all__ = ["ERROR", "OK", "Controller", "PodRecord", "ProfileRecord", "ProfileRef", "Settings", "Sink", "TickReport"]
