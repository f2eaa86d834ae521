"""The reconciler shared by ``run`` (kopf) and ``local``: profiles, pods, one loop for all.

The kopf handlers (or local mode's file loader) only tell the controller what
exists: :meth:`Controller.upsert_profile`, :meth:`Controller.upsert_pod` and
their removals. Everything else happens in :meth:`Controller.tick`, run by one
loop for all profiles:

1. pick the profiles whose interval is due (intervals are aligned on one grid,
   so profiles with the same interval are evaluated on the same tick and the
   grouped queries run once per interval, however many profiles there are);
2. collect every due model's metrics from the source in one call (:mod:`.collect`);
3. plan per profile (:func:`.plan.plan`, by mode: adaptive: the policy, or its
   canary; recommend and restart: the policy, reported only; static: the spec's
   window) and apply the plan to the record; a window that changed goes to
   status at once, with the policy's memory that chose it and the canary that
   tries it (written ahead of the push, so that an operator killed before step 5
   leaves a status its successor continues from: one more patch per window
   change, none per tick);
4. sync every ready pod of the due profiles (and of profiles with a pending
   push) to the window in force, concurrently, each by its mode's and engine's
   path (:mod:`.sync_paths`);
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

The jobs are split: :mod:`.registry` knows what exists and which pods a profile selects, :mod:`.collect`
gathers the tick's metrics, :mod:`.plan` decides each profile's tick as a pure function (and alone numbers
windows), :mod:`.sync_paths` brings the pods to the window by each mode's and engine's path (:mod:`.syncer`
pushes and records results), :mod:`.conditions` and :mod:`.facts` derive the status as pure functions,
:mod:`.export` sets the operator's own metrics. This module is the loop and the wiring: one profile's tick is
:meth:`Controller._decide` (observe, evaluate the canary, :func:`.plan.plan`, :meth:`Controller._apply`,
announce), then :meth:`Controller._sync_profile_isolated` (:meth:`.sync_paths.SyncPaths.sync`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from batchpilot_operator.api.profile import BatchProfileSpec, Friendliness, ProfileError, TuningMode, parse_spec
from batchpilot_operator.control import conditions
from batchpilot_operator.control.canary import Canaries
from batchpilot_operator.control.collect import collect
from batchpilot_operator.control.events import Events, announce
from batchpilot_operator.control.facts import status_facts
from batchpilot_operator.control.plan import CanaryEvaluation, Plan, plan, starting_window, window_for_spec
from batchpilot_operator.control.records import (
    MetricsSource,
    PodRecord,
    ProfileRecord,
    ProfileRef,
    Sink,
    TickReport,
    lanes_of,
    read_status_window,
)
from batchpilot_operator.control.registry import Registry
from batchpilot_operator.control.restart import RestartPath, Workloads
from batchpilot_operator.control.settings import Settings
from batchpilot_operator.control.sglang_sync import SGLangSync
from batchpilot_operator.control.status import (
    UNKNOWN,
    ConditionFact,
    StatusFacts,
)
from batchpilot_operator.control.status_writer import StatusWriter
from batchpilot_operator.control.sync_paths import SyncPaths
from batchpilot_operator.control.syncer import Syncer
from batchpilot_operator.io.opmetrics import OperatorMetrics
from batchpilot_operator.io.push import ERROR, OK, AdminClient
from batchpilot_operator.io.sglang import SGLangClient
from batchpilot_operator.tuning import policy as policy_mod
from batchpilot_operator.tuning import policy_memo
from batchpilot_operator.tuning.model_metrics import ModelKey, ModelMetrics, lookup, to_observations
from batchpilot_operator.tuning.observations import Observations
from batchpilot_runtime.contract.window import Window

log = logging.getLogger("batchpilot.operator")


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
        sglang: SGLangClient | None = None,
        workloads: Workloads | None = None,
    ) -> None:
        self._settings = settings
        self.source = source
        self.admin = admin
        self.sink = sink
        self.metrics = metrics or OperatorMetrics()
        self._wall = wall_clock
        self._mono = monotonic
        self.on_decision = on_decision
        self.registry = Registry(match_by_model=match_by_model)
        self.profiles = self.registry.profiles  # the registry's own dicts, read by the front ends
        self.pods = self.registry.pods
        self.events = Events(sink, settings.max_events_per_tick)
        self.syncer = Syncer(settings, admin, sink, self.metrics, monotonic, self._queue_event)
        self.sglang = SGLangSync(sglang or SGLangClient(timeout_s=admin.timeout_s))
        self.restart = RestartPath(workloads, self._queue_event)  # tuning.mode restart (control/restart.py)
        self.canaries = Canaries(self._queue_event)
        self.sync_paths = SyncPaths(self.syncer, self.sglang, self.restart, self.pods_of, wall_clock)
        # Looked up at call time (not bound now): a replaced ``facts`` (tests, subclasses) is the one used.
        self.status_writer = StatusWriter(
            sink, self.metrics, lambda record: self.facts(record), self.restart.status_of, self._queue_event
        )
        self.last_tick_started_s: float | None = None
        self.last_tick_finished_s: float | None = None
        self.ticks = 0
        self.last_report = TickReport()
        self._tick_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._started_s = 0.0

    @property
    def settings(self) -> Settings:
        return self._settings

    @settings.setter
    def settings(self, value: Settings) -> None:
        """New settings reach the syncer and the Event guard too."""
        self._settings = self.syncer.settings = value
        self.events.max_per_tick = value.max_events_per_tick

    @property
    def match_by_model(self) -> bool:
        """Local mode: a profile selects the pods that serve its model, in any namespace."""
        return self.registry.match_by_model

    @match_by_model.setter
    def match_by_model(self, value: bool) -> None:
        self.registry.match_by_model = value  # set before the first pod or profile: the indexes are keyed by it

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
        old_index_key = self.registry.index_key(record) if record is not None else None
        old_spec = record.spec if record is not None else None
        if record is None:
            record = ProfileRecord(ref=ref, generation=generation, spec=parsed, error=error)
            record.status.written = dict(status or {})
            # Adopted from an earlier operator's status: its window in force (and generation), its policy's
            # memory (the cooldown included), and the end of any canary it left running.
            record.loop.window = self._window_from_status(ref, status)
            record.loop.adopted_generation = record.loop.window.generation if record.loop.window else None
            record.memory.policy_state = self._policy_from_status(ref, status, parsed, generation)
            self.canaries.adopt(record, status)
        else:
            record.ref, record.generation, record.spec, record.error = ref, generation, parsed, error
            if status is not None:
                record.status.written = dict(status)
            if parsed is not None and parsed != old_spec:
                # The same rule as for a memory restored across a spec change: a restart changes nothing.
                record.memory.policy_state = policy_memo.carry_over(record.memory.policy_state, parsed)
        if parsed is not None:
            record.loop.window = window_for_spec(parsed, old_spec, record.loop.window, record.status.written)
        self.registry.put_profile(record, old_index_key)
        record.loop.push_pending = True
        self.metrics.profiles_managed.set(len(self.profiles))
        self._wake.set()
        return record

    @staticmethod
    def _window_from_status(ref: ProfileRef, status: Mapping[str, Any] | None) -> Window | None:
        """The window in force kept in status by an earlier operator; one that does not validate is dropped,
        and the log says what was wrong with it (the spec's window is then numbered past none)."""
        read = read_status_window(status)
        if read.problem is not None:
            log.warning("profile %s: window in status not used: %s", ref.key, read.problem)
        return read.window

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
        record = self.registry.pop_profile(f"{namespace}/{name}")
        self.restart.forget(f"{namespace}/{name}")
        if record is not None and record.spec is not None:
            self.metrics.forget_profile(namespace, name, record.spec.model)
        self.metrics.profiles_managed.set(len(self.profiles))

    def upsert_pod(self, pod: PodRecord) -> list[ProfileRecord]:
        """Record a pod; returns the profiles that must push to it now (it is Ready and not known synced)."""
        before = self.registry.put_pod(pod)
        restarted = before is not None and before.uid != pod.uid
        became_ready = pod.ready and (before is None or not before.ready or restarted or before.ip != pod.ip)
        if not became_ready:
            return []
        matching = self.registry.profiles_selecting(pod)
        for record in matching:
            record.sync.forget(pod.key)
        return matching

    def remove_pod(self, namespace: str, name: str) -> None:
        pod = self.registry.pop_pod(namespace, name)
        if pod is None:
            return
        for record in self.profiles.values():
            record.sync.forget(pod.key)

    def pods_of(self, record: ProfileRecord) -> list[PodRecord]:
        """The profile's pods, sorted (see :meth:`Registry.pods_of`)."""
        return self.registry.pods_of(record)

    @staticmethod
    def _ensure_window(record: ProfileRecord) -> None:
        """Put the spec's starting window in force where none is, or (static mode) where its fields changed
        (:func:`.plan.starting_window`)."""
        if record.spec is not None:
            record.loop.window = starting_window(record.spec, record.loop.window, record.status.written)

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
        self.events.new_tick()

        # 1. Which profiles are due (aligned slots: floor(now / interval)).
        due: list[ProfileRecord] = []
        for record in self.profiles.values():
            if record.spec is None:
                continue
            slot = math.floor(started / self._interval_s(record))
            if record.loop.last_slot != slot:
                record.loop.last_slot = slot
                due.append(record)

        # 2. One collection for every due model.
        metrics, report.metrics_error = await collect(
            self.source, due, self.pods_of, self.match_by_model, self.metrics, self._mono, report
        )
        await self.canaries.collect(self.source, due, self.pods_of, self.match_by_model)

        # 3. Decide.
        windows_before = {r.ref.key: r.loop.window for r in due}
        canaries_before = {r.ref.key: r.canary.run for r in due}
        for record in due:
            try:
                self._decide(record, metrics, report.metrics_error, now_s, report)
            except Exception as error:
                log.exception("decision for %s failed", record.ref.key)
                record.memory.metrics_fact = ConditionFact(
                    UNKNOWN, "DecisionFailed", f"{type(error).__name__}: {error}"
                )
        report.evaluated = len(due)
        # A canary that starts is written ahead of its push too: a successor ends it and keeps the cooldown.
        changed = [
            r
            for r in due
            if (r.loop.window is not None and r.loop.window != windows_before[r.ref.key])
            or (r.canary.run is not None and canaries_before[r.ref.key] is None)
        ]
        if changed:
            await self._write_statuses(changed, now_s, report, only=("window", "policy", "canary"))

        # 4. Push (due profiles, and any with a pending push: new profiles, spec changes, new pods).
        to_sync = {r.ref.key: r for r in due}
        to_sync.update({r.ref.key: r for r in self.profiles.values() if r.loop.push_pending and r.spec is not None})
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
        """One due profile's tick: observe, evaluate its canary, plan (:func:`.plan.plan`), apply, announce."""
        spec = record.spec
        if spec is None:
            return
        obs = self._observe(record, spec, metrics, metrics_error, now_s)
        self._ensure_window(record)
        self.canaries.report_restart(record)
        self.canaries.drop_unwanted(record)
        if record.loop.window is None:
            return
        pods = self.pods_of(record)
        canary = CanaryEvaluation()
        if spec.mode == TuningMode.ADAPTIVE:  # while a canary runs the policy holds: judge it first
            canary = self.canaries.evaluate(record, pods, now_s)
        planned = plan(record, obs, now_s, canary, [p.key for p in pods if p.ready])
        self._apply(record, planned, pods, now_s, report)
        decision = planned.decision
        if decision.friendliness is not None and spec.batch_friendliness == Friendliness.AUTO:
            record.memory.friendliness = decision.friendliness.to_status()
        announce(record, spec, decision, now_s, self.metrics, self.on_decision, self._queue_event)

    def _observe(
        self,
        record: ProfileRecord,
        spec: BatchProfileSpec,
        metrics: Mapping[ModelKey, ModelMetrics],
        metrics_error: str | None,
        now_s: float,
    ) -> Observations:
        """The profile's observations this tick, kept on its record with the MetricsAvailable fact."""
        latency_metric = spec.slo.latency_metric.value
        namespace = "" if self.match_by_model else record.ref.namespace
        model_metrics = None if metrics_error else lookup(metrics, namespace, spec.model)
        obs = to_observations(model_metrics, latency_metric, now_s)
        record.memory.observations = obs
        record.memory.evaluations += 1
        record.memory.metrics_fact = conditions.metrics_fact(
            metrics_error,
            model_metrics.window_s if model_metrics is not None else None,
            obs,
            model=spec.model,
            namespace=record.ref.namespace,
            latency_metric=latency_metric,
        )
        return obs

    def _apply(
        self, record: ProfileRecord, planned: Plan, pods: Sequence[PodRecord], now_s: float, report: TickReport
    ) -> None:
        """Put ``planned`` on the record: the window in force, the policy's memory, the recommendation, the
        canary it starts. The pods follow in the tick's step 4 (every due profile is synced)."""
        if planned.canary_pods:
            self.canaries.start(record, planned.decision.window, planned.canary_pods, pods, now_s)
        record.loop.window = planned.window
        record.memory.policy_state = planned.decision.state
        if planned.recommends:
            record.memory.recommended = planned.recommended
        report.changed += planned.changed

    # ---- pushes -------------------------------------------------------------------------------------

    async def _sync_profiles(self, records: Sequence[ProfileRecord], report: TickReport) -> None:
        """Sync every profile concurrently; what one profile's sync raises stays that profile's."""
        await asyncio.gather(*(self._sync_profile_isolated(r, report) for r in records))

    async def _sync_profile_isolated(self, record: ProfileRecord, report: TickReport) -> None:
        """One profile's sync path (:meth:`.sync_paths.SyncPaths.sync`); its push is no longer pending
        however it ended (a failed one is tried again at the next due tick)."""
        try:
            await self.sync_paths.sync(record, report)
        except Exception as error:  # a bug in one profile's sync: its status says so, the others go on
            log.exception("sync of %s failed", record.ref.key)
            text = f"{type(error).__name__}: {error}"
            report.push_failures += 1
            if record.sync.error != text:  # one Event per new error, not one per tick
                self._queue_event(record, "Warning", "PushFailed", f"sync failed: {text}")
            record.sync.error = text
        else:
            record.sync.error = None
        finally:
            record.loop.push_pending = False

    async def sync_now(self, records: Sequence[ProfileRecord]) -> None:
        """Push at once (a pod just became Ready), outside the interval."""
        async with self._tick_lock:
            report = TickReport()
            await self._sync_profiles(records, report)
            await self._write_statuses(records, self._wall(), report)

    # ---- status and events --------------------------------------------------------------------------

    def _queue_event(self, record: ProfileRecord, type_: str, reason: str, message: str) -> None:
        self.events.queue(record, type_, reason, message)

    async def drain_events(self, timeout_s: float | None = None) -> None:
        """Wait for Events still being posted; after ``timeout_s`` the rest are dropped (shutdown)."""
        await self.events.drain(timeout_s)

    def facts(self, record: ProfileRecord) -> StatusFacts:
        return self.restart.amend(record, status_facts(record, self.pods_of(record)))

    async def _write_statuses(
        self, records: Sequence[ProfileRecord], now_s: float, report: TickReport, only: tuple[str, ...] | None = None
    ) -> None:
        await self.status_writer.write(records, now_s, report, only)


__all__ = [
    "ERROR",
    "OK",
    "Controller",
    "MetricsSource",
    "PodRecord",
    "ProfileRecord",
    "ProfileRef",
    "Settings",
    "Sink",
    "StatusFacts",
    "TickReport",
    "lanes_of",
]
