"""Kubernetes Events of the profiles, posted in the background with a per-tick flood guard."""

from __future__ import annotations

import asyncio
import logging

from batchpilot_operator.control.records import ProfileRecord, ProfileRef, Sink

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
