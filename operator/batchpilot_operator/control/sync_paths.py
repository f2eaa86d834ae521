"""The sync paths: how a profile's window in force reaches its pods, one small path per mode and engine.

:meth:`SyncPaths.sync` runs the path :func:`~batchpilot_operator.control.plan.sync_path` names: restart
mode's (control/restart.py), recommend mode's read of the pods, SGLang's live settings
(control/sglang_sync.py), or the admin API's push (:meth:`SyncPaths.push`), the canary's window to its pods
and the window in force to the others (:func:`~batchpilot_operator.control.plan.push_groups`). A pod holding a
newer generation is pushed again past it, numbered by :func:`~batchpilot_operator.control.plan.past_conflict`.
Every outcome lands on the profile's record and the tick's report.
"""

from __future__ import annotations

from collections.abc import Callable

from batchpilot_operator.control.plan import SyncPath, past_conflict, push_groups, sync_path
from batchpilot_operator.control.records import PodRecord, ProfileRecord, TickReport
from batchpilot_operator.control.restart import RestartPath
from batchpilot_operator.control.sglang_sync import SGLangSync
from batchpilot_operator.control.syncer import Syncer, newest_conflict
from batchpilot_operator.io.push import CONFLICT, PushResult
from batchpilot_runtime.contract.window import Window


class SyncPaths:
    def __init__(
        self,
        syncer: Syncer,
        sglang: SGLangSync,
        restart: RestartPath,
        pods_of: Callable[[ProfileRecord], list[PodRecord]],
        wall_clock: Callable[[], float],
    ) -> None:
        self.syncer = syncer
        self.sglang = sglang
        self.restart = restart
        self._pods_of = pods_of
        self._wall = wall_clock

    async def sync(self, record: ProfileRecord, report: TickReport) -> None:
        """Bring ``record``'s pods to its window in force by its mode's and engine's path."""
        path, window = sync_path(record.spec, record.loop.window), record.loop.window
        if path == SyncPath.RESTART:
            await self.restart.sync(record, self._wall())
        elif path == SyncPath.READ:  # batchpilot's runtime and the gate answer GET /admin/window
            await self.syncer.read_pods(record, self._pods_of(record))
        elif path == SyncPath.SGLANG and window is not None:
            await self.sglang.sync(record, [p for p in self._pods_of(record) if p.ready], window)
        elif path == SyncPath.PUSH and window is not None:
            await self.push(record, [p for p in self._pods_of(record) if p.ready], window, report)

    async def push(self, record: ProfileRecord, pods: list[PodRecord], window: Window, report: TickReport) -> None:
        """The admin API's path: each of the Ready ``pods`` its window, a conflict pushed again past it."""
        results: list[PushResult] = []
        not_sent: list[PushResult] = []
        for group, group_window in push_groups(record, pods, window):  # canary pods: its window
            sent, withheld = await self.syncer.push(record, group, group_window)
            results.extend(sent)
            not_sent.extend(withheld)
        renumbered = past_conflict(window, newest_conflict(results))
        if renumbered is not None:
            # Some pod holds a newer generation (an earlier operator, a lost status): move past it, push again.
            record.loop.window = renumbered
            retry_names = {r.pod for r in results if r.outcome == CONFLICT}
            retried = await self.syncer.repush(record, [p for p in pods if p.key in retry_names], renumbered)
            results = [r for r in results if r.pod not in retry_names] + retried
        # Failed pods are not retried before the next interval (sync already retried with backoff);
        # being level-triggered, the next due tick finds them behind and pushes again.
        for result in results + not_sent:
            self.syncer.account(record, result, report)
