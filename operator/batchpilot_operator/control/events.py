"""Kubernetes Events of the profiles, posted in the background with a per-tick flood guard."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from batchpilot_operator.api.profile import RECOMMENDING, BatchProfileSpec
from batchpilot_operator.api.status import Decision
from batchpilot_operator.control.records import ProfileRecord, ProfileRef, Sink
from batchpilot_operator.control.status import rfc3339
from batchpilot_operator.io.opmetrics import OperatorMetrics
from batchpilot_operator.tuning import policy as policy_mod

log = logging.getLogger("batchpilot.operator")

MAX_MESSAGE_CHARS = 1024


class Events:
    """At most ``max_per_tick`` Events between two :meth:`new_tick` calls (1,000 failing profiles must not DoS
    the API server); a post that fails is logged, never raised."""

    def __init__(self, sink: Sink, max_per_tick: int) -> None:
        self.sink = sink
        self.max_per_tick = max_per_tick
        self._this_tick = 0
        self._pending: set[asyncio.Future[None]] = set()

    def new_tick(self) -> None:
        self._this_tick = 0

    def queue(self, record: ProfileRecord, type_: str, reason: str, message: str) -> None:
        if self._this_tick >= self.max_per_tick:
            return
        self._this_tick += 1
        task = asyncio.ensure_future(self._post(record.ref, type_, reason, message))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _post(self, ref: ProfileRef, type_: str, reason: str, message: str) -> None:
        try:
            await self.sink.event(ref, type_, reason, message[:MAX_MESSAGE_CHARS])
        except Exception as error:
            log.warning("posting Event %s for %s failed: %s", reason, ref.key, error)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Wait for Events still being posted; after ``timeout_s`` the rest are dropped (shutdown)."""
        pending = list(self._pending)
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)


def announce(
    record: ProfileRecord,
    spec: BatchProfileSpec,
    decision: policy_mod.Decision,
    now_s: float,
    metrics: OperatorMetrics,
    on_decision: Callable[[ProfileRecord, policy_mod.Decision], None] | None,
    queue_event: Callable[[ProfileRecord, str, str, str], None],
) -> None:
    """Record a decision in status, metrics, the log, ``on_decision`` and (when it is news) an Event."""
    direction: str = decision.direction
    if spec.mode in RECOMMENDING and decision.changed:
        direction = "recommend"
    previous = record.memory.last_decision
    if previous is None or (previous.direction, previous.reason) != (direction, decision.reason):
        # The same hold repeated is not news: keeping its first time keeps the status unchanged (no patch).
        record.memory.last_decision = Decision(time=rfc3339(now_s), direction=direction, reason=decision.reason)
    metrics.decisions.labels(record.ref.namespace, record.ref.name, spec.model, direction).inc()
    log.log(
        logging.INFO if direction != "hold" else logging.DEBUG,
        "decision %s: %s %s: %s",
        record.ref.key,
        direction,
        decision.window.describe(),
        decision.reason,
    )
    if on_decision is not None:
        on_decision(record, decision)
    if decision.changed or direction == "recommend" or decision.reason != record.memory.last_reason:
        # Holds that repeat the same reason are not re-posted: one Event per new reason, one per change.
        message = decision.reason
        if decision.changed and spec.mode not in RECOMMENDING:
            message = f"{decision.window.describe()}: {decision.reason}"
        elif direction == "recommend":
            message = f"recommend {decision.window.describe()}: {decision.reason}"
        queue_event(record, "Normal", f"Decision{direction.capitalize()}", message)
    record.memory.last_reason = decision.reason
