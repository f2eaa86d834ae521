"""The gate's connections to the upstream engine: one per request slot, and a side client.

The gate already bounds requests in flight (the cap never exceeds ``max_hard_cap``), so each
admitted request takes a slot number and goes through that slot's own connection
(:mod:`batchpilot_runtime.gate.h1client`): nothing is pooled or queued, and the lowest free slot,
whose connection is the warmest, goes first. ``/v1/models``, ``/health`` and ``/readyz`` go through
a small httpx client beside the slots, so that a full window never delays a health check.
"""

from __future__ import annotations

import heapq
import ssl
from types import TracebackType

import httpx

from batchpilot_runtime.gate.h1client import KEEPALIVE_EXPIRY_S, Origin, SlotClient

SIDE_CONNECTIONS = 4


class UpstreamSlots:
    """``take`` a slot and its client for one request; ``give_back`` it when the request ends."""

    def __init__(self, upstream: str, slots: int, connect_timeout_s: float) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        origin = Origin.parse(upstream)
        tls = ssl.create_default_context() if origin.scheme == "https" else None  # one, shared: it loads the CAs
        self._slots = [SlotClient(origin, connect_timeout_s, tls) for _ in range(slots)]
        self._free = list(range(slots))  # a heap: the lowest free slot first, whose connection is warm
        # No read timeout: a side request is short, and /readyz sets its own.
        self.side = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=SIDE_CONNECTIONS,
                max_keepalive_connections=SIDE_CONNECTIONS,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
        )

    def take(self) -> tuple[int, SlotClient]:
        """A free slot and its client; ``RuntimeError`` if none is free (more requests in flight than
        the slots the gate was started with, which admission never allows)."""
        if not self._free:
            raise RuntimeError("no free upstream slot: more requests in flight than --max-hard-cap allows")
        slot = heapq.heappop(self._free)
        client = self._slots[slot]
        client.hung_up = False
        return slot, client

    def give_back(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    async def __aenter__(self) -> UpstreamSlots:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for client in self._slots:
            client.close()
        await self.side.aclose()
