"""``Gate``: the gate's state on the event loop: admission, the requests waiting for it, the window
in force, and the metrics.

One object per gate process; only the event loop's thread touches it, so there are no locks. Every
change of the running or waiting set (an arrival, a release, a new window) runs an admission pass at
once, and a timer runs one at the next deadline (a wait or tail threshold expiring), so a request is
let through at the first moment the window allows. The admin app serves it as a ``WindowHolder``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping

from batchpilot_runtime.contract.admin_api import (
    InvalidWindowError,
    LaneWindow,
    PodCapacity,
    WindowState,
    WindowUpdate,
    is_resend,
)
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.gate.admission import Admitted, GateAdmission, GateLimits
from batchpilot_runtime.scheduling.lanes import lanes_by_name
from batchpilot_runtime.scheduling.types import QueueFullError, RequestRejected, RequestTimings, StepStats
from batchpilot_runtime.server.metrics import MetricsExporter

logger = logging.getLogger("batchpilot.gate")


class Gate:
    """The window in front of one upstream engine (see the module docstring)."""

    def __init__(
        self,
        model_name: str,
        window: Window,
        lanes: Mapping[str, LaneWindow],
        limits: GateLimits,
        admin_token: str,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_name = model_name
        self.admin_token = admin_token
        self.clock = clock
        self.admission = GateAdmission(window, lanes, limits)
        self.metrics = MetricsExporter(model_name, ["default", *lanes])
        self.draining = False
        self._state = WindowState(
            model=model_name,
            window=window,
            lanes=[lanes[name] for name in sorted(lanes)],
            # The gate holds no KV cache: its capacity is the engine's own cap (what a window may not exceed).
            capacity=PodCapacity(
                kv_cache_tokens=0, kv_block_size=1, max_hard_cap=limits.max_hard_cap, max_model_len=max_model_len
            ),
            batching="continuous",
        )
        self._waiters: dict[str, asyncio.Future[Admitted]] = {}
        self._ids = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due_s = 0.0
        self.idle = asyncio.Event()
        self.idle.set()
        self.metrics.on_window(self._state)

    # -- requests ------------------------------------------------------------------------------

    def enqueue(self, lane: str) -> tuple[str, asyncio.Future[Admitted]]:
        """Queue a request for ``lane``; its id and a future resolved at its admission. ``QueueFullError``
        or ``RequestRejected`` (counted as rejected) when it cannot wait."""
        request_id = f"gate-{next(self._ids)}"
        try:
            self.admission.enqueue(request_id, lane, self.clock())
        except (QueueFullError, RequestRejected):
            self.metrics.on_rejected()
            raise
        future: asyncio.Future[Admitted] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = future
        self.idle.clear()
        self._admit()
        return request_id, future

    def release(self, request_id: str) -> None:
        """The request ended (answered, failed, or its client left): its slot or queue place is free."""
        future = self._waiters.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        if self.admission.release(request_id):
            self._admit()
        if self.admission.num_running == 0 and self.admission.num_waiting == 0:
            self.idle.set()

    def finished(self, timings: RequestTimings, outcome: str, generated_tokens: int, gaps_s: list[float]) -> None:
        """Export one ended request as the runtime would (its latency, outcome, gaps and tokens; its wait and
        TTFT were observed when they happened)."""
        self.metrics.on_request_finished(timings, outcome)
        if gaps_s:
            self.metrics.on_tokens(timings.lane, gaps_s)
        self.metrics.on_generated_tokens(generated_tokens)

    def _admit(self) -> None:
        now_s = self.clock()
        result = self.admission.admit(now_s)
        for admitted in result.admitted:
            future = self._waiters.pop(admitted.request_id, None)
            if future is not None and not future.done():
                future.set_result(admitted)
        admission = self.admission
        # The gate runs no steps: an admission pass is exported as a step of no sequences, which
        # counts admissions and tail marks and sets the load gauges exactly as the runtime's do.
        self.metrics.on_step(
            StepStats(
                batch_size=0,
                num_prefill_seqs=0,
                num_decode_seqs=0,
                num_prefill_tokens=0,
                admissions=result.admissions,
                admitted_requests=len(result.admitted),
                tail_marked=result.tail_marked,
                preempted=0,
                queue_depth=admission.num_waiting,
                running=admission.num_running,
                kv_usage_ratio=0.0,
                window_generation=admission.window.generation,
            ),
            0.0,
            0.0,
        )
        self._arm_timer(now_s)

    def _arm_timer(self, now_s: float) -> None:
        deadline_s = self.admission.next_deadline_s()
        # A deadline already passed means a trigger holds but no slot is free: a release admits then.
        if deadline_s is None or deadline_s <= now_s:
            return
        if self._timer is not None:
            if self._timer_due_s <= deadline_s:
                return
            self._timer.cancel()
        self._timer_due_s = deadline_s
        self._timer = asyncio.get_running_loop().call_later(deadline_s - now_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._admit()

    # -- the admin API (``server.admin.WindowHolder``) ------------------------------------------------

    def window_in_force(self) -> WindowState | None:
        return self._state

    def update_window(self, update: WindowUpdate) -> WindowState:
        """The runtime's rules (``is_resend``; 422 for a window that does not fit), applied at once:
        the next admission uses the new cap, target and wait."""
        offered = update.window
        if offered.max_prefill_tokens is not None:
            raise InvalidWindowError(
                "window.maxPrefillTokens: the gate cannot bound an engine's prompt tokens per step; "
                "set the engine's own flag (vLLM --max-num-batched-tokens, SGLang --chunked-prefill-size)"
            )
        try:
            new_lanes = None if update.lanes is None else lanes_by_name(update.lanes)
        except ValueError as error:
            raise InvalidWindowError(str(error)) from None
        current_lanes = {lane.name: lane for lane in self._state.lanes}
        lanes = current_lanes if new_lanes is None else new_lanes
        if is_resend(offered, self._state.window, lanes == current_lanes):
            return self._state
        try:
            self.admission.set_window(offered, new_lanes)
        except ValueError as error:
            raise InvalidWindowError(str(error)) from None
        self._state = self._state.model_copy(
            update={"window": offered, "lanes": [lanes[name] for name in sorted(lanes)]}
        )
        self.metrics.on_window(self._state)
        logger.info("window updated", extra={"window": offered.describe(), "lanes": sorted(lanes)})
        self._admit()
        return self._state
