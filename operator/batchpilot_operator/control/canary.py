"""The canary loop: a new window goes to the canary pods first, is judged against the others every
interval, then goes to every pod or is rolled back on the canaries.

The controller calls, per tick: :meth:`Canaries.collect` (per-pod latency of the profiles with a canary in
progress, one extra query for all of them, none when no canary runs), then per due profile
:meth:`Canaries.evaluate` before its plan (while a canary runs the policy holds: its observations mix
both windows), and :meth:`Canaries.start` when the plan (control/plan.py) starts one;
:meth:`Canaries.drop_unwanted` ends a canary whose spec no longer wants one, whatever the mode. A canary an
earlier operator left running is ended when its profile is adopted (:meth:`Canaries.adopt`) and reported at
its first decision (:meth:`Canaries.report_restart`). The rule itself is pure, in
:mod:`batchpilot_operator.tuning.canary`; which pods a canary starts on, which window each pod is pushed and
a window the policy proposes again after its canary rolled it back are the plan's
(:func:`~batchpilot_operator.control.plan.plan`, :func:`~batchpilot_operator.control.plan.push_groups`,
:func:`~batchpilot_operator.control.plan.screen`).

Invariants: ``record.loop.window`` stays the window of the baseline pods while a canary runs (so Synced
counts both groups and a new pod gets the baseline's window); the canary pods are chosen once, at the
start, and only leave the canary by going away; this module never numbers a window: an ended canary
hands the plan the window to put in force and the generation to number it past.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from batchpilot_operator.api.canary import CanaryStatus
from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.control.facts import ended_by_restart
from batchpilot_operator.control.plan import CanaryEvaluation, canary_wanted
from batchpilot_operator.control.records import PodRecord, ProfileRecord
from batchpilot_operator.control.status import rfc3339
from batchpilot_operator.io.outbound import base_url
from batchpilot_operator.tuning.canary import CanaryRun, State, Step, Verdict, advance, judge
from batchpilot_operator.tuning.model_metrics import ModelKey, ModelMetrics, to_observations
from batchpilot_runtime.contract.window import Window

log = logging.getLogger("batchpilot.operator")

# A window rolled back is not tried again for this many of the profile's intervals (the policy, which
# sees the same load, would propose it again at once).
REJECT_HOLD_INTERVALS = 10

EventQueue = Callable[[ProfileRecord, str, str, str], None]


def metrics_url(pod: PodRecord, spec: BatchProfileSpec) -> str | None:
    """Where a pod's /metrics is: the URL local mode gave, or its IP and the serving port."""
    if pod.metrics_url:
        return pod.metrics_url
    return f"{base_url(pod.ip, spec.runtime.serve_port)}/metrics" if pod.ip else None


def _pods_text(pods: Sequence[str]) -> str:
    return ", ".join(pods) if pods else "none"


class Canaries:
    def __init__(self, queue_event: EventQueue) -> None:
        self._queue_event = queue_event
        self._pod_metrics: dict[str, dict[str, ModelMetrics]] = {}  # profile key -> pod key -> metrics
        self._error: str | None = None  # why this tick has no per-pod metrics

    # ---- per-pod metrics ------------------------------------------------------------------------------

    async def collect(
        self,
        source: object,
        records: Sequence[ProfileRecord],
        pods_of: Callable[[ProfileRecord], list[PodRecord]],
        match_by_model: bool,
    ) -> None:
        """The per-pod metrics of every profile of ``records`` with a canary in progress, in one call."""
        self._pod_metrics, self._error = {}, None
        running = [r for r in records if r.canary.run is not None and r.spec is not None]
        if not running:
            return
        collect_pods = getattr(source, "collect_pods", None)
        if collect_pods is None:
            self._error = "the metric source gives no per-pod figures"
            return
        targets: dict[ModelKey, dict[str, str]] = {}
        keys: dict[str, ModelKey] = {}
        for record in running:
            spec = record.spec
            if spec is None:  # filtered above; this narrows the type
                continue
            key = keys[record.ref.key] = ("" if match_by_model else record.ref.namespace, spec.model)
            for pod in pods_of(record):
                url = metrics_url(pod, spec)
                if pod.ready and url:
                    targets.setdefault(key, {})[pod.name] = url
        try:
            answers: dict[ModelKey, dict[str, ModelMetrics]] = await collect_pods(targets)
        except Exception as error:  # any source failure is this tick's missing data, never a pass
            self._error = f"per-pod metrics unavailable: {type(error).__name__}: {error}"
            return
        for record in running:
            namespace, model = keys[record.ref.key]
            by_name = answers.get((namespace, model)) or answers.get(("", model)) or {}
            self._pod_metrics[record.ref.key] = {p.key: by_name[p.name] for p in pods_of(record) if p.name in by_name}

    # ---- the run --------------------------------------------------------------------------------------

    def start(
        self, record: ProfileRecord, window: Window, chosen: Sequence[str], pods: Sequence[PodRecord], now_s: float
    ) -> None:
        """Start a canary of ``window`` on the ``chosen`` pods (the plan's, among the Ready ``pods``); the
        window in force stays the baseline's."""
        previous = record.loop.window
        if previous is None:
            raise ValueError(f"profile {record.ref.key} has no window in force to run a canary beside")
        record.canary.run = CanaryRun(window=window, previous=previous, pods=tuple(chosen), started_s=now_s)
        reason = f"{window.describe()} on {len(chosen)} of {sum(p.ready for p in pods)} pods first"
        record.canary.last = CanaryStatus(
            window=window, pods=[k.split("/", 1)[-1] for k in chosen], started_at=rfc3339(now_s),
            verdict="running", reason=reason,
        )  # fmt: skip
        self._queue_event(record, "Normal", "CanaryStarted", f"{reason}: {_pods_text(chosen)}")

    def adopt(self, record: ProfileRecord, status: Mapping[str, Any] | None) -> None:
        """A profile adopted with the status an earlier operator wrote: a canary it left running ends here,
        rolled back (see :func:`~batchpilot_operator.control.facts.ended_by_restart`); its Event waits for
        :meth:`report_restart`, as Events are posted from the loop."""
        ended = ended_by_restart(status)
        if ended is None:
            return
        record.canary.last = ended
        record.canary.restart_unreported = True

    def report_restart(self, record: ProfileRecord) -> None:
        """The Event of a canary :meth:`adopt` ended, once."""
        last = record.canary.last
        if not record.canary.restart_unreported or last is None:
            return
        record.canary.restart_unreported = False
        message = f"{last.window.describe()} rolled back: {last.reason}"
        self._queue_event(record, "Warning", "CanaryRolledBack", message)
        log.info("canary of %s rolled back: %s", record.ref.key, last.reason)

    def drop_unwanted(self, record: ProfileRecord) -> None:
        """End a canary whose spec no longer wants one (switched off, another mode or engine). The canary pods
        are sent the window in force; holding a newer generation, they answer with a conflict, and the loop
        numbers the window past it (as after any conflict)."""
        run = record.canary.run
        if run is None or canary_wanted(record.spec):
            return
        record.canary.run = None
        self._report(record, Step(run, "rolledBack", "tuning.canary was switched off, or the mode or engine changed"))

    def evaluate(self, record: ProfileRecord, pods: Sequence[PodRecord], now_s: float) -> CanaryEvaluation:
        """Judge the canary in progress on this tick's per-pod metrics; nothing when none runs."""
        run, spec = record.canary.run, record.spec
        if run is None or spec is None:
            return CanaryEvaluation()
        step = self._step(record, run, spec, pods, now_s)
        if step.state == "running":
            record.canary.run = step.run
            self._report(record, step)
            return CanaryEvaluation(
                hold_reason=f"Holding while the canary of generation {run.window.generation} runs on "
                f"{_pods_text(step.run.pods)}."
            )
        record.canary.run = None
        self._report(record, step)
        if step.state == "promoted":
            return CanaryEvaluation(f"Canary promoted: {step.reason}.", ended=run.window)
        record.canary.rejected = run.window
        record.canary.rejected_until_s = now_s + REJECT_HOLD_INTERVALS * spec.tuning.interval_seconds
        back = record.loop.window if record.loop.window is not None else run.previous
        return CanaryEvaluation(f"Canary rolled back: {step.reason}.", ended=back, past=run.window.generation)

    def _step(
        self, record: ProfileRecord, run: CanaryRun, spec: BatchProfileSpec, pods: Sequence[PodRecord], now_s: float
    ) -> Step:
        """The run after this tick: ended by what changed around it, or judged on the pods' figures."""
        if record.loop.window is None or record.loop.window.generation != run.previous.generation:
            return Step(run, "rolledBack", "the window in force changed during the canary (a new spec.window)")
        ready = {p.key for p in pods if p.ready}
        alive = tuple(k for k in run.pods if k in ready)
        failing = [k for k in alive if k in record.sync.pod_errors]
        if failing:
            failure = record.sync.pod_errors[failing[0]]
            return Step(run, "rolledBack", f"canary pod {failing[0]} failed: {failure.outcome}: {failure.detail}")
        if not alive:
            return Step(run, "rolledBack", "every canary pod went away before the canary passed")
        per_pod = self._pod_metrics.get(record.ref.key, {})
        latency_metric = spec.slo.latency_metric.value
        canary = {k: to_observations(m, latency_metric, now_s) for k, m in per_pod.items() if k in alive}
        baseline = {
            k: to_observations(m, latency_metric, now_s) for k, m in per_pod.items() if k in ready and k not in alive
        }
        verdict = Verdict("noData", self._error) if self._error else judge(spec.slo, canary, baseline)
        rate_window_s = max((m.window_s for k, m in per_pod.items() if k in alive), default=math.inf)
        return advance(
            replace(run, pods=alive),
            verdict,
            intervals=spec.tuning.canary.intervals,
            now_s=now_s,
            rate_window_s=rate_window_s,
        )

    def _report(self, record: ProfileRecord, step: Step) -> None:
        """status.canary, and an Event when the canary ends."""
        last = record.canary.last
        state: State = step.state
        names = [k.split("/", 1)[-1] for k in step.run.pods]
        if last is None:
            last = CanaryStatus(
                window=step.run.window, pods=names, started_at=rfc3339(step.run.started_s), verdict=state
            )
        record.canary.last = last.model_copy(
            update={"verdict": state, "reason": step.reason, "passed_intervals": step.run.passes, "pods": names}
        )
        window = step.run.window.describe()
        if state == "promoted":
            self._queue_event(record, "Normal", "CanaryPromoted", f"{window} to every pod: {step.reason}")
        elif state == "rolledBack":
            self._queue_event(record, "Warning", "CanaryRolledBack", f"{window} rolled back: {step.reason}")
            log.info("canary of %s rolled back: %s", record.ref.key, step.reason)
