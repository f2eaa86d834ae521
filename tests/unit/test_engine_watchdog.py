"""The engine watchdog: its rule on a fake clock, then ``AsyncEngine`` feeding it from the engine
thread (a step made to hang on an event; the clock is the engine's, advanced by hand)."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.engine.async_engine import AsyncEngine
from batchpilot_runtime.engine.types import GenerationRequest
from batchpilot_runtime.engine.watchdog import DEFAULT_STALL_TIMEOUT_S, EngineHealth, EngineWatchdog
from tests.support.tiny_engine import DEADLINE_S, tiny_engine, wait_until
from tests.support.torch_fixtures import one_thread_per_module  # noqa: F401  (autouse fixture)

TIMEOUT_S = 60.0


def make_watchdog(now_s: float = 0.0, timeout_s: float = TIMEOUT_S) -> EngineWatchdog:
    return EngineWatchdog(timeout_s, now_s)


# -- the rule, on a fake clock ----------------------------------------------------------------


def test_idle_never_stalls() -> None:
    watchdog = make_watchdog()
    watchdog.step_ended(10.0)
    assert watchdog.check(1e6) == EngineHealth(False, 0.0, 0, TIMEOUT_S)


def test_pending_requests_without_a_step_beyond_the_timeout_stall() -> None:
    watchdog = make_watchdog()
    watchdog.requests_pending(100.0, 3)
    assert watchdog.check(160.0) == EngineHealth(False, 60.0, 3, TIMEOUT_S)  # at the timeout: not yet
    health = watchdog.check(175.0)
    assert health == EngineHealth(True, 75.0, 3, TIMEOUT_S)
    assert health.reason == "engine stalled: no step completed for 75 s with 3 requests pending (stall timeout 60 s)"


def test_a_completed_step_clears_the_stall() -> None:
    watchdog = make_watchdog()
    watchdog.requests_pending(0.0, 1)
    assert watchdog.check(90.0).stalled
    watchdog.step_ended(90.0)
    assert watchdog.check(95.0) == EngineHealth(False, 5.0, 1, TIMEOUT_S)
    assert watchdog.check(95.0).reason is None


def test_finished_requests_clear_the_stall() -> None:
    watchdog = make_watchdog()
    watchdog.requests_pending(0.0, 2)
    watchdog.requests_pending(90.0, 0)
    assert watchdog.check(95.0) == EngineHealth(False, 0.0, 0, TIMEOUT_S)


def test_a_long_first_step_after_idle_counts_from_when_work_arrived() -> None:
    # The last step ended long ago; the first request then warms up allocator and kernels for 50 s.
    watchdog = make_watchdog()
    watchdog.step_ended(5.0)
    watchdog.requests_pending(1000.0, 1)
    assert watchdog.check(1050.0) == EngineHealth(False, 50.0, 1, TIMEOUT_S)
    assert watchdog.check(1061.0).stalled


def test_more_requests_do_not_restart_the_clock() -> None:
    watchdog = make_watchdog()
    watchdog.requests_pending(0.0, 1)
    watchdog.requests_pending(50.0, 2)
    assert watchdog.check(70.0) == EngineHealth(True, 70.0, 2, TIMEOUT_S)
    assert watchdog.check(70.0).reason == (
        "engine stalled: no step completed for 70 s with 2 requests pending (stall timeout 60 s)"
    )


def test_a_wait_by_design_is_not_a_stall_and_restarts_the_clock() -> None:
    # One request waits for its batch to fill (maxWaitMs): the engine thread sleeps until the deadline.
    watchdog = make_watchdog()
    watchdog.requests_pending(0.0, 1)
    watchdog.wait_started()
    assert watchdog.check(500.0) == EngineHealth(False, 0.0, 1, TIMEOUT_S)
    watchdog.wait_ended(500.0)
    assert watchdog.check(520.0) == EngineHealth(False, 20.0, 1, TIMEOUT_S)
    assert watchdog.check(561.0).stalled


def test_one_request_reads_singular() -> None:
    watchdog = make_watchdog(timeout_s=0.5)
    watchdog.requests_pending(0.0, 1)
    assert watchdog.check(2.0).reason == (
        "engine stalled: no step completed for 2 s with 1 request pending (stall timeout 0.5 s)"
    )


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, math.inf, math.nan])
def test_the_timeout_must_be_finite_and_positive(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="stall_timeout_s must be a finite number > 0"):
        EngineWatchdog(timeout_s)


def test_the_default_timeout_covers_the_longest_measured_step() -> None:
    # The CPU calibration of the small preset (docs/benchmarks.md), whole prompts filling the default KV cache.
    cpu_full_prefill_s = 0.0298 + 65_536 * 596e-6
    assert 3 * cpu_full_prefill_s <= DEFAULT_STALL_TIMEOUT_S


# -- AsyncEngine feeding it ---------------------------------------------------------------------


class FakeClock:
    """The engine's clock (scheduler times and the watchdog's), moved by the test only."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class HangingModel:
    """Wraps the model: every forward waits for ``release`` (``entered`` says one has started)."""

    def __init__(self, model: Callable[..., Any]) -> None:
        self.model = model
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: Any) -> Any:
        self.entered.set()
        if not self.release.wait(DEADLINE_S):
            raise TimeoutError("the test never released the hung step")
        return self.model(*args)


async def test_a_hung_step_stalls_the_engine_until_it_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    engine = tiny_engine(Window(target_batch_size=1, hard_cap=4, max_wait_ms=0), clock=clock, device="cpu")
    hanging = HangingModel(engine.model)
    monkeypatch.setattr(engine, "model", hanging)
    running = AsyncEngine(engine, stall_timeout_s=TIMEOUT_S)
    await running.start()
    try:
        events = running.submit(GenerationRequest("r1", [1, 2, 3], max_tokens=2))
        collected = asyncio.ensure_future(asyncio.wait_for(_final(events), DEADLINE_S))
        await wait_until(hanging.entered.is_set, "the step to start")
        assert running.health() == EngineHealth(False, 0.0, 1, TIMEOUT_S)
        clock.advance(75.0)
        health = running.health()
        assert health == EngineHealth(True, 75.0, 1, TIMEOUT_S)
        assert health.reason == (
            "engine stalled: no step completed for 75 s with 1 request pending (stall timeout 60 s)"
        )
        assert running.is_alive()  # the thread is there: only the watchdog sees the hang
        hanging.release.set()
        assert await collected == "length"
        assert running.health() == EngineHealth(False, 0.0, 0, TIMEOUT_S)
    finally:
        hanging.release.set()
        await running.shutdown(drain=False)


async def test_waiting_for_the_admission_deadline_is_not_a_stall() -> None:
    clock = FakeClock()
    # One request, a target of 4: the engine sleeps towards the 60 s wait deadline.
    engine = tiny_engine(Window(target_batch_size=4, hard_cap=4, max_wait_ms=60_000), clock=clock, device="cpu")
    running = AsyncEngine(engine, stall_timeout_s=1.0)
    timeouts: list[float | None] = []
    idle_timeout_s = running._idle_timeout_s

    def recording_timeout() -> float | None:
        # Called on the engine thread inside its wait, with the lock that health() takes.
        timeout = idle_timeout_s()
        timeouts.append(timeout)
        return timeout

    running._idle_timeout_s = recording_timeout  # type: ignore[method-assign]
    await running.start()
    try:
        events = running.submit(GenerationRequest("r1", [1, 2, 3], max_tokens=2))
        await wait_until(lambda: any(t is not None for t in timeouts), "the engine to sleep towards the deadline")
        clock.advance(1000.0)
        assert running.health() == EngineHealth(False, 0.0, 1, 1.0)
    finally:
        await running.shutdown(drain=False)
    assert await asyncio.wait_for(_final(events), DEADLINE_S) == "cancelled"


async def _final(events: Any) -> str | None:
    async for event in events:
        if event.is_final:
            return str(event.finish_reason)
    return None
