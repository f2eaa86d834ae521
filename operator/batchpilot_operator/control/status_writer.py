"""Writing each profile's status: built from its facts, patched only where it changed.

Each profile's status is written on its own (one that cannot be built is logged and skipped), as a
JSON merge patch against what was last written, so that an unchanged status costs no API call.
``appliedAt`` is kept for as long as the window's generation is the same.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from batchpilot_operator.control.export import export_profile
from batchpilot_operator.control.records import ProfileRecord, Sink, TickReport
from batchpilot_operator.control.status import StatusFacts, build_status, merge_patch, rfc3339
from batchpilot_operator.control.status import apply_merge_patch as apply_patch
from batchpilot_operator.io.opmetrics import OperatorMetrics

log = logging.getLogger("batchpilot.operator")  # the controller's logger: one name for the loop's messages


class StatusWriter:
    """Patches profiles' statuses through ``sink``; the controller hands it how to read a profile's facts."""

    def __init__(
        self,
        sink: Sink,
        metrics: OperatorMetrics,
        facts: Callable[[ProfileRecord], StatusFacts],
        restart_status: Callable[[ProfileRecord], dict[str, Any] | None],
        queue_event: Callable[[ProfileRecord, str, str, str], None],
    ) -> None:
        self.sink = sink
        self.metrics = metrics
        self._facts = facts
        self._restart_status = restart_status
        self._queue_event = queue_event

    async def write(
        self, records: Sequence[ProfileRecord], now_s: float, report: TickReport, only: tuple[str, ...] | None = None
    ) -> None:
        """Write every profile's status (or only the fields ``only`` names) concurrently; one that cannot be
        built is logged and skipped."""
        await asyncio.gather(*(self._write_isolated(r, now_s, report, only) for r in records))

    async def _write_isolated(
        self, record: ProfileRecord, now_s: float, report: TickReport, only: tuple[str, ...] | None = None
    ) -> None:
        try:
            await self._write_one(record, now_s, report, only)
        except Exception:  # a bug in one profile's status: the others are still written
            log.exception("status of %s could not be built", record.ref.key)
            report.status_failures += 1

    async def _write_one(
        self, record: ProfileRecord, now_s: float, report: TickReport, only: tuple[str, ...] | None = None
    ) -> None:
        now_iso = rfc3339(now_s)
        facts = self._facts(record)
        if record.spec is None and record.status.invalid_reported_generation != record.generation:
            record.status.invalid_reported_generation = record.generation
            self._queue_event(record, "Warning", "InvalidSpec", record.error or "invalid spec")
        new_status = build_status(facts, record.status.written, now_iso)
        restart_status = self._restart_status(record)
        if restart_status is not None:
            new_status["restart"] = restart_status
        old_window = record.status.written.get("window")
        if (
            facts.window is not None
            and isinstance(old_window, Mapping)
            and old_window.get("generation") == (facts.window.generation)
        ):
            new_status["window"]["appliedAt"] = old_window.get("appliedAt") or now_iso
        elif "window" in new_status:
            new_status["window"]["appliedAt"] = now_iso
        written = record.status.written
        if only is not None:
            new_status = {k: v for k, v in new_status.items() if k in only}
            written = {k: v for k, v in written.items() if k in only}
        patch = merge_patch(written, new_status)
        export_profile(self.metrics, record, facts)
        if not patch:
            return
        try:
            await self.sink.patch_status(record.ref, patch)
        except Exception as error:
            report.status_failures += 1
            log.warning("status patch of %s failed (retried next tick): %s", record.ref.key, error)
            return
        report.status_patches += 1
        record.status.written = apply_patch(record.status.written, patch)
