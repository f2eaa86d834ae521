"""Scrape every runtime's ``/metrics`` every second or two and keep the snapshots.

The snapshots are the demo's raw record: the live view reads the latest ones, and each
phase's figures are differences between the snapshots taken at its start and its end
(:func:`Collector.scrape_now` marks those instants exactly).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping

import httpx

from batchpilot_operator.demo.series import Snapshot, snapshot_from_exposition


class Collector:
    def __init__(
        self,
        metrics_urls: Mapping[str, str],
        interval_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 5.0,
    ) -> None:
        self.metrics_urls = dict(metrics_urls)  # model -> /metrics URL
        self.interval_s = interval_s
        self._clock = clock
        self._client = httpx.AsyncClient(timeout=timeout_s)
        self.snapshots: dict[str, list[Snapshot]] = {model: [] for model in metrics_urls}
        self.failures: dict[str, str] = {}  # model -> last scrape error, cleared by a good scrape
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def _scrape_one(self, model: str, url: str) -> Snapshot | None:
        try:
            response = await self._client.get(url)
            response.raise_for_status()
        except httpx.HTTPError as error:
            self.failures[model] = f"{type(error).__name__}: {error}"
            return None
        self.failures.pop(model, None)
        return snapshot_from_exposition(response.text, model, self._clock())

    async def scrape_now(self) -> dict[str, Snapshot | None]:
        """Scrape every runtime at once; the new snapshots are also kept."""
        async with self._lock:
            models = list(self.metrics_urls)
            results = await asyncio.gather(*(self._scrape_one(m, self.metrics_urls[m]) for m in models))
            for model, snapshot in zip(models, results, strict=True):
                if snapshot is not None:
                    self.snapshots[model].append(snapshot)
            return dict(zip(models, results, strict=True))

    async def _loop(self) -> None:
        while True:
            started = self._clock()
            await self.scrape_now()
            await asyncio.sleep(max(0.0, self.interval_s - (self._clock() - started)))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="demo-collector")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._client.aclose()

    def between(self, model: str, start_s: float, end_s: float) -> list[Snapshot]:
        """The snapshots of ``model`` taken within ``[start_s, end_s]``."""
        return [s for s in self.snapshots[model] if start_s <= s.at_s <= end_s]

    def recent(self, model: str, window_s: float) -> tuple[Snapshot | None, Snapshot | None]:
        """(the snapshot about ``window_s`` before the latest, the latest), for the live view."""
        snapshots = self.snapshots[model]
        if not snapshots:
            return None, None
        latest = snapshots[-1]
        before = next((s for s in reversed(snapshots) if latest.at_s - s.at_s >= window_s), snapshots[0])
        return before, latest
