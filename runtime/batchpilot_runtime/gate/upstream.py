"""Connections to the upstream engine: one small httpx pool per group of request slots.

Why not one ``httpx.AsyncClient``: httpcore's pool re-scans every connection against every other
on each request it starts or ends (``_assign_requests_to_connections``, quadratic in connections),
which at a window of 100 requests in flight took more CPU than the proxying itself and added
seconds of TTFT on a small host. The gate already bounds requests in flight (the cap never exceeds
``max_hard_cap``), so each admitted request takes a slot number, and slot ``i`` always goes through
pool ``i // SLOTS_PER_POOL`` of at most ``SLOTS_PER_POOL`` connections: no pool ever queues, each
scan is over a handful of connections, and a slot's connection stays warm for the next request.
"""

from __future__ import annotations

import heapq
from types import TracebackType

import httpx

SLOTS_PER_POOL = 8
# Below the 5 s keep-alive of uvicorn (vLLM's and SGLang's server) and of most engines: the gate drops
# an idle connection before the engine does, rather than sending a request on one the engine is closing.
KEEPALIVE_EXPIRY_S = 2.0


class UpstreamPools:
    """``take`` a slot and its client for one request; ``give_back`` it when the request ends."""

    def __init__(self, slots: int, connect_timeout_s: float) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        timeout = httpx.Timeout(None, connect=connect_timeout_s)
        self._clients = [_client(timeout) for _ in range(-(-slots // SLOTS_PER_POOL))]
        self._free = list(range(slots))  # a heap: the lowest free slot first, whose connection is warm
        # /v1/models, /health and /readyz: beside a full window, never in a slot's pool.
        self.side = _client(timeout)

    def take(self) -> tuple[int, httpx.AsyncClient]:
        """A free slot and its pool's client; ``RuntimeError`` if none is free (more requests in flight
        than the slots the gate was started with, which admission never allows)."""
        if not self._free:
            raise RuntimeError("no free upstream slot: more requests in flight than --max-hard-cap allows")
        slot = heapq.heappop(self._free)
        return slot, self._clients[slot // SLOTS_PER_POOL]

    def give_back(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    async def __aenter__(self) -> UpstreamPools:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for client in [*self._clients, self.side]:
            await client.aclose()


def _client(timeout: httpx.Timeout) -> httpx.AsyncClient:
    # No read timeout: a stream lasts as long as the engine generates; its end or a hang-up closes it.
    # identity: the gate reads SSE events and usage from the bytes it passes on.
    return httpx.AsyncClient(
        limits=httpx.Limits(
            max_connections=SLOTS_PER_POOL,
            max_keepalive_connections=SLOTS_PER_POOL,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        ),
        timeout=timeout,
        headers={"accept-encoding": "identity"},
    )
