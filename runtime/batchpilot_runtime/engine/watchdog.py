"""The engine watchdog: tells a hung engine from a busy, waiting or idle one (pure, the clock passed in).

The engine thread reports each step that ends and each wait it makes by design (no request, or
the admission deadline the scheduler set); ``AsyncEngine`` reports how many requests it holds.
The engine owes a step while requests are pending and its thread is not in such a wait; it is
*stalled* when it has owed one for longer than the stall timeout, counted from the latest of:
the last step's end, the moment requests became pending, the end of the last wait by design.

So an idle engine is never stalled, nor one waiting out ``maxWaitMs`` for its batch to fill,
and a first step after a long idle (allocator and kernel warm-up) is timed from when its work
arrived; a step that never returns, or requests that are never planned and have no deadline,
are. Not thread-safe: ``AsyncEngine`` calls it under its lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_STALL_TIMEOUT_S", "EngineHealth", "EngineWatchdog"]

# The longest step the measured set-ups legitimately take, times three. A step prefills at most
# min(prefill budget, KV cache) prompt tokens. On CPU (the `small` preset, calibrated in docs/benchmarks.md:
# 29.8 ms + 596 us per prompt token) whole prompts filling the default 65,536-token KV cache take
# 29.8 ms + 65,536 x 596 us = 39 s; on an A100 with Llama-2-7B (cost_model.A100_LLAMA2_7B,
# 61 us per prompt token) the largest budget a window may set, 262,144 tokens, takes 16 s.
# A larger KV cache on CPU, or a heavier model there, needs a larger --engine-stall-timeout-s.
DEFAULT_STALL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class EngineHealth:
    """One reading of the watchdog."""

    stalled: bool
    stall_s: float  # how long the engine has owed a step; 0 while it owes none
    pending_requests: int  # submitted and not yet finished
    stall_timeout_s: float

    @property
    def reason(self) -> str | None:
        """Why the engine is unhealthy (for /healthz and /readyz), or None when it is not stalled."""
        if not self.stalled:
            return None
        plural = "" if self.pending_requests == 1 else "s"
        return (
            f"engine stalled: no step completed for {self.stall_s:.0f} s with {self.pending_requests} "
            f"request{plural} pending (stall timeout {self.stall_timeout_s:g} s)"
        )


class EngineWatchdog:
    """Invariant: ``check(now_s).stalled`` implies requests are pending, the engine thread is not in
    a wait by design, and ``now_s`` is more than the stall timeout after every event that clears it
    (a step's end, requests becoming pending, a wait by design ending)."""

    def __init__(self, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, now_s: float = 0.0) -> None:
        if not (math.isfinite(stall_timeout_s) and stall_timeout_s > 0):
            raise ValueError(f"stall_timeout_s must be a finite number > 0, got {stall_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self._pending_requests = 0
        self._waiting = False
        self._owed_since_s = now_s

    def step_ended(self, now_s: float) -> None:
        """A step ran (or failed and ended its requests): the engine is making progress."""
        self._restart(now_s)

    def requests_pending(self, now_s: float, count: int) -> None:
        """The number of submitted, unfinished requests changed; the clock starts when it leaves 0."""
        if self._pending_requests == 0 and count > 0:
            self._restart(now_s)
        self._pending_requests = count

    def wait_started(self) -> None:
        """The engine thread sleeps by design: no request, or until the scheduler's next deadline."""
        self._waiting = True

    def wait_ended(self, now_s: float) -> None:
        self._waiting = False
        self._restart(now_s)

    def check(self, now_s: float) -> EngineHealth:
        owes_step = self._pending_requests > 0 and not self._waiting
        stall_s = max(0.0, now_s - self._owed_since_s) if owes_step else 0.0
        return EngineHealth(
            stalled=stall_s > self.stall_timeout_s,
            stall_s=stall_s,
            pending_requests=self._pending_requests,
            stall_timeout_s=self.stall_timeout_s,
        )

    def _restart(self, now_s: float) -> None:
        # max: callers on different threads read the clock before they take the lock.
        self._owed_since_s = max(self._owed_since_s, now_s)
