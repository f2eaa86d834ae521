"""Pushes of a profile's window to its pods, and what their results leave on the profile's record.

The syncer chooses which pods need a request (behind, failed, or not read back for ``resync_s``), finds
each pod's bearer token (a Secret cache, scoped by namespace), sends the requests concurrently and records
each :class:`PushResult`: the pod's state, a :class:`PodFailure` value for a failed pod (a refused window is
not retried until the window changes), clamps, counters and Events. It never chooses a window generation: a
conflict with a newer one is reported back (:func:`newest_conflict`) for the loop to number past it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence

from batchpilot_operator.control.conditions import PodFailure
from batchpilot_operator.control.records import PodRecord, ProfileRecord, Sink, TickReport, lanes_of
from batchpilot_operator.control.settings import Settings
from batchpilot_operator.io.opmetrics import OperatorMetrics
from batchpilot_operator.io.outbound import base_url
from batchpilot_operator.io.push import CONFLICT, REFUSED, UNAUTHORIZED, AdminClient, PodTarget, PushFailed, PushResult
from batchpilot_operator.io.token_secrets import SecretNotOptedIn
from batchpilot_runtime.contract.window import Window

log = logging.getLogger("batchpilot.operator")

SECRET_TTL_S = 60.0

EventQueue = Callable[[ProfileRecord, str, str, str], None]


def newest_conflict(results: Sequence[PushResult]) -> int | None:
    """The newest generation a pod answered a conflict with, None when no pod did."""
    return max((r.state.window.generation for r in results if r.outcome == CONFLICT and r.state), default=None)


class Syncer:
    def __init__(
        self,
        settings: Settings,
        admin: AdminClient,
        sink: Sink,
        metrics: OperatorMetrics,
        monotonic: Callable[[], float],
        queue_event: EventQueue,
    ) -> None:
        self.settings = settings
        self.admin = admin
        self.sink = sink
        self.metrics = metrics
        self._mono = monotonic
        self._queue_event = queue_event
        # (namespace, name, key) -> (read at, the token or None, why it is None)
        self._secret_cache: dict[tuple[str, str, str], tuple[float, str | None, str]] = {}

    async def push(
        self, record: ProfileRecord, pods: Sequence[PodRecord], window: Window
    ) -> tuple[list[PushResult], list[PushResult]]:
        """Sync the Ready ``pods`` that need it to ``window``: (results of the requests, pods no token may go to)."""
        jobs: list[Awaitable[PushResult]] = []
        not_sent: list[PushResult] = []  # pods no token may go to: no request at all
        now = self._mono()
        lanes = lanes_of(record.spec, window.generation) if record.spec is not None else None
        for pod in pods:
            if record.sync.refused.get(pod.key) == window.generation:
                continue  # refused before: never retried until the window changes
            state = record.sync.pod_states.get(pod.key)
            in_sync = state is not None and state.window.generation >= window.generation
            recently = now - record.sync.verified_s.get(pod.key, -math.inf) < self.settings.resync_s
            if in_sync and pod.key not in record.sync.pod_errors and recently:
                continue  # known in sync and checked recently: no request at all
            token, withheld = await self.token(record, pod)
            if withheld is not None:
                not_sent.append(PushResult(pod.key, UNAUTHORIZED, detail=withheld))
                continue
            target = self.target(record, pod, token)
            if target is None:
                continue
            # Behind (or never seen): PUT at once. In sync: read it back (a restart shows up here). Never seen
            # but the window is the one an earlier operator put in force: read first, as the pod most likely
            # holds it already (a GET instead of a PUT that would change nothing).
            adopted = state is None and window.generation == record.loop.adopted_generation
            jobs.append(self.admin.sync(target, window, lanes, verify=in_sync or adopted))
        return list(await asyncio.gather(*jobs)), not_sent

    async def repush(self, record: ProfileRecord, pods: Sequence[PodRecord], window: Window) -> list[PushResult]:
        """Push ``window`` to every one of ``pods`` again, without the checks of :meth:`push` (after a conflict)."""
        lanes = lanes_of(record.spec, window.generation) if record.spec is not None else None
        jobs: list[Awaitable[PushResult]] = []
        for pod in pods:
            target = self.target(record, pod, (await self.token(record, pod))[0])
            if target is not None:
                jobs.append(self.admin.sync(target, window, lanes))
        return list(await asyncio.gather(*jobs))

    def account(self, record: ProfileRecord, result: PushResult, report: TickReport) -> None:
        spec = record.spec
        model = spec.model if spec else ""
        labels = (record.ref.namespace, record.ref.name, model)
        if result.state is not None:
            record.sync.pod_states[result.pod] = result.state
            record.sync.verified_s[result.pod] = self._mono()
        if result.pushed:
            report.pushes += 1
            self.metrics.pushes.labels(*labels, "ok").inc()
        if result.ok:
            record.sync.pod_errors.pop(result.pod, None)
            if result.clamped is not None:
                record.sync.clamped[result.pod] = result.detail
                self._queue_event(record, "Warning", "WindowClamped", f"pod {result.pod}: {result.detail}")
            else:
                record.sync.clamped.pop(result.pod, None)
            return
        report.push_failures += 1
        self.metrics.pushes.labels(*labels, result.outcome).inc()
        self.metrics.push_errors.labels(*labels).inc()
        record.sync.pod_errors[result.pod] = PodFailure(result.outcome, result.detail)
        if result.outcome == REFUSED and record.loop.window is not None:
            record.sync.refused[result.pod] = record.loop.window.generation
        self._queue_event(record, "Warning", "PushFailed", f"pod {result.pod}: {result.outcome}: {result.detail}")

    async def read_pods(self, record: ProfileRecord, pods: Sequence[PodRecord]) -> None:
        """Recommend mode: only read what the pods run (for status), never write."""
        for pod in pods:
            if not pod.ready:
                continue
            token, withheld = await self.token(record, pod)
            if withheld is not None:
                record.sync.pod_errors[pod.key] = PodFailure(UNAUTHORIZED, withheld)
                continue
            target = self.target(record, pod, token)
            if target is None:
                continue
            try:
                record.sync.pod_states[pod.key] = await self.admin.get_state(target)
                record.sync.pod_errors.pop(pod.key, None)
            except PushFailed as error:
                record.sync.pod_errors[pod.key] = PodFailure(error.outcome, error.detail)

    async def token(self, record: ProfileRecord, pod: PodRecord) -> tuple[str | None, str | None]:
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
            if pod.namespace != record.ref.namespace:  # the registry never lets this happen; a Secret stays at home
                return None, (
                    f"not sent: the token of Secret {record.ref.namespace}/{ref.name} goes only to pods "
                    f"of namespace {record.ref.namespace!r}"
                )
            key = (record.ref.namespace, ref.name, ref.key)
            cached = self._secret_cache.get(key)
            if cached is None or self._mono() - cached[0] >= SECRET_TTL_S:
                try:
                    token = await self.sink.read_secret(record.ref.namespace, ref.name, ref.key)
                    problem = f"has no key {ref.key!r}"
                except SecretNotOptedIn as refused:
                    token, problem = None, str(refused)
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

    def target(self, record: ProfileRecord, pod: PodRecord, token: str | None) -> PodTarget | None:
        if pod.admin_url:
            return PodTarget(pod.key, pod.admin_url, token)
        if pod.ip and record.spec is not None:
            return PodTarget(pod.key, base_url(pod.ip, record.spec.runtime.admin_port), token)
        return None
