"""AsyncEngine: the engine thread behind asyncio (concurrency, abort, queue limits, drain, windows)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence

import pytest

from batchpilot_runtime.contract.admin_api import LaneWindow, WindowState, WindowUpdate
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.engine.async_engine import AsyncEngine
from batchpilot_runtime.engine.engine import Engine
from batchpilot_runtime.engine.types import (
    EngineStoppedError,
    GenerationRequest,
    InvalidWindowError,
    QueueFullError,
    RequestRejected,
    StaleGenerationError,
    TokenEvent,
)
from batchpilot_runtime.scheduling.types import RequestTimings, StepStats
from tests.support.tiny_engine import KV_TOKENS, VOCAB, tiny_engine, wait_until
from tests.support.torch_fixtures import one_thread_per_module  # noqa: F401  (autouse fixture)


class Recorder:
    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.outcomes: list[str] = []
        self.windows: list[WindowState] = []

    def on_step(self, stats: StepStats, step_seconds: float, forward_seconds: float) -> None:
        self.steps.append(stats)

    def on_request_finished(self, timings: RequestTimings, outcome: str) -> None:
        self.outcomes.append(outcome)

    def on_admitted(self, lane: str, queue_wait_s: float) -> None:
        pass

    def on_first_token(self, lane: str, ttft_s: float) -> None:
        pass

    def on_tokens(self, lane: str, inter_token_gaps_s: Sequence[float]) -> None:
        pass

    def on_window(self, state: WindowState) -> None:
        self.windows.append(state)


def make_engine(
    window: Window | None = None,
    max_queue: int = 64,
    observer: Recorder | None = None,
    lanes: dict[str, LaneWindow] | None = None,
) -> Engine:
    return tiny_engine(
        window or Window(target_batch_size=4, hard_cap=16, max_wait_ms=0),
        max_queue=max_queue,
        observer=observer,
        lanes=lanes,
        batch_invariant=True,  # test_concurrent_submits_get_their_own_tokens compares with alone, token for token
    )


def make_request(index: int, max_tokens: int = 8, **kwargs: object) -> GenerationRequest:
    rng = random.Random(index)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
    return GenerationRequest(f"q{index}", prompt, max_tokens, **kwargs)  # type: ignore[arg-type]


async def collect(events: AsyncIterator[TokenEvent]) -> tuple[list[int], TokenEvent]:
    tokens: list[int] = []
    async for event in events:
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.finish_reason is not None:
            return tokens, event
    raise AssertionError("the stream ended without a final event")


@pytest.fixture
async def running() -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(make_engine())
    await engine.start()
    yield engine
    await engine.shutdown(drain=False)


def alone_tokens(requests: Sequence[GenerationRequest]) -> dict[str, list[int]]:
    engine = make_engine(Window(target_batch_size=1, hard_cap=1, max_wait_ms=0))
    result: dict[str, list[int]] = {}
    for request in requests:
        engine.add_request(request)
        tokens: list[int] = []
        while engine.has_unfinished:
            tokens.extend(e.token_id for e in engine.step() if e.token_id is not None)
        result[request.request_id] = tokens
    return result


async def test_concurrent_submits_get_their_own_tokens(running: AsyncEngine) -> None:
    requests = [make_request(i, max_tokens=4 + i % 9) for i in range(24)]
    results = await asyncio.gather(*(collect(running.submit(r)) for r in requests))
    by_id = {r.request_id: tokens for r, (tokens, _) in zip(requests, results, strict=True)}
    assert all(final.finish_reason == "length" for _, final in results)
    assert all(final.timings is not None and final.timings.output_tokens == len(t) for t, final in results)
    assert by_id == alone_tokens(requests)
    await wait_until(lambda: running.load().running == 0 and running.load().kv_usage_ratio == 0.0, "an idle engine")


async def test_abort_frees_kv(running: AsyncEngine) -> None:
    stream = running.submit(make_request(1, max_tokens=400))
    first = await anext(stream)
    assert first.token_id is not None and first.finish_reason is None
    assert running.load().kv_usage_ratio > 0.0
    running.abort("q1")
    _, final = await collect(stream)
    assert final.finish_reason == "cancelled"
    await wait_until(lambda: running.load().kv_usage_ratio == 0.0, "KV usage back to 0")
    assert running.load().running == 0


async def test_a_reader_that_goes_away_cancels_its_request(running: AsyncEngine) -> None:
    streams = [running.submit(make_request(i, max_tokens=400)) for i in range(3)]
    for stream in streams:
        await anext(stream)
    for stream in streams:
        await stream.aclose()  # what a disconnected HTTP client does
    await wait_until(lambda: running.load().kv_usage_ratio == 0.0 and running.load().running == 0, "KV freed")


async def test_queue_full_raises_at_once() -> None:
    # target 64 is never reached and the wait is a minute: every request stays queued
    engine = AsyncEngine(make_engine(Window(target_batch_size=64, hard_cap=64, max_wait_ms=60_000), max_queue=3))
    await engine.start()
    streams = [engine.submit(make_request(i)) for i in range(3)]
    with pytest.raises(QueueFullError) as refused:
        engine.submit(make_request(3))
    assert refused.value.retry_after_s > 0
    await engine.shutdown(drain=False)
    for stream in streams:
        _, final = await collect(stream)
        assert final.finish_reason == "cancelled"


async def test_bad_requests_are_refused_at_once_naming_the_field(running: AsyncEngine) -> None:
    cases = {
        "max_tokens": GenerationRequest("bad1", [1, 2], 0),
        "prompt_token_ids": GenerationRequest("bad2", [], 4),
        "temperature": GenerationRequest("bad3", [1], 4, temperature=-1.0),
        "lane": GenerationRequest("bad4", [1], 4, lane="nope"),
    }
    for field_name, request in cases.items():
        with pytest.raises(RequestRejected, match=field_name):
            running.submit(request)
    with pytest.raises(RequestRejected, match="max_tokens"):
        running.submit(GenerationRequest("too-long", [1] * 10, KV_TOKENS))
    stream = running.submit(make_request(5, max_tokens=50))
    with pytest.raises(RequestRejected, match="request_id"):
        running.submit(make_request(5))
    await collect(stream)


async def test_shutdown_drain_finishes_everything() -> None:
    recorder = Recorder()
    engine = AsyncEngine(make_engine(Window(target_batch_size=4, hard_cap=4, max_wait_ms=0), observer=recorder))
    await engine.start()
    requests = [make_request(i, max_tokens=6 + i % 5) for i in range(12)]
    readers = [asyncio.ensure_future(collect(engine.submit(r))) for r in requests]
    await engine.shutdown(drain=True)
    with pytest.raises(EngineStoppedError):
        engine.submit(make_request(99))
    results = await asyncio.gather(*readers)
    for request, (tokens, final) in zip(requests, results, strict=True):
        assert final.finish_reason == "length"
        assert len(tokens) == request.max_tokens
    assert recorder.outcomes == ["completed"] * len(requests)
    assert not engine.is_alive()


async def test_shutdown_without_drain_cancels() -> None:
    engine = AsyncEngine(make_engine())
    await engine.start()
    streams = [engine.submit(make_request(i, max_tokens=400)) for i in range(4)]
    await anext(streams[0])
    await engine.shutdown(drain=False)
    for stream in streams:
        _, final = await collect(stream)
        assert final.finish_reason == "cancelled"
    assert engine.engine.scheduler.kv_usage_ratio == 0.0


async def test_update_window_generations_and_capacity() -> None:
    recorder = Recorder()
    engine = AsyncEngine(
        make_engine(Window(target_batch_size=4, hard_cap=16, max_wait_ms=0, generation=3), observer=recorder)
    )
    await engine.start()
    try:
        state = engine.window_state()
        assert state.capacity.max_hard_cap == KV_TOKENS // 16
        assert state.capacity.kv_cache_tokens == KV_TOKENS
        # 409: older generation; same generation with other values
        with pytest.raises(StaleGenerationError) as stale:
            engine.update_window(
                WindowUpdate(window=Window(target_batch_size=2, hard_cap=8, max_wait_ms=0, generation=2))
            )
        assert stale.value.window_in_force.generation == 3
        with pytest.raises(StaleGenerationError):
            engine.update_window(
                WindowUpdate(window=Window(target_batch_size=2, hard_cap=8, max_wait_ms=0, generation=3))
            )
        # re-sending the window in force is accepted and changes nothing
        assert engine.update_window(WindowUpdate(window=state.window)) == state
        # 422: a cap the KV cache cannot hold, with the reason; reservations that starve the default lane
        with pytest.raises(InvalidWindowError, match=r"hardCap.*64 sequences"):
            engine.update_window(
                WindowUpdate(window=Window(target_batch_size=8, hard_cap=65, max_wait_ms=0, generation=4))
            )
        critical = LaneWindow(
            name="critical", window=Window(target_batch_size=1, hard_cap=4, max_wait_ms=0), reserved_slots=4
        )
        with pytest.raises(InvalidWindowError, match="reservedSlots"):
            engine.update_window(
                WindowUpdate(
                    window=Window(target_batch_size=2, hard_cap=4, max_wait_ms=0, generation=4), lanes=[critical]
                )
            )
        assert engine.window_state() == state  # refused updates change nothing
        # 200: staged, applied at the next step boundary
        new_window = Window(target_batch_size=2, hard_cap=8, max_wait_ms=5, generation=4)
        accepted = engine.update_window(WindowUpdate(window=new_window, lanes=[critical]))
        assert accepted.window == new_window and accepted.lanes == [critical]
        assert engine.window_state() == accepted
        await collect(engine.submit(make_request(1, max_tokens=3, lane="critical")))
        assert recorder.steps[-1].window_generation == 4
        assert recorder.windows[-1] == accepted
    finally:
        await engine.shutdown(drain=False)


async def test_idle_engine_sleeps_until_the_wait_deadline() -> None:
    engine = AsyncEngine(make_engine(Window(target_batch_size=8, hard_cap=8, max_wait_ms=1000)))
    timeouts: list[float | None] = []
    idle_timeout_s = engine._idle_timeout_s

    def recording_timeout() -> float | None:
        timeout = idle_timeout_s()
        timeouts.append(timeout)
        return timeout

    engine._idle_timeout_s = recording_timeout  # type: ignore[method-assign]
    await engine.start()
    try:
        await wait_until(lambda: timeouts == [None], "the engine to sleep with no deadline")
        _, final = await collect(engine.submit(make_request(1, max_tokens=2)))
        assert final.finish_reason == "length"
        # admitted by the wait rule after one sleep towards its deadline, no polling in between
        deadlines = [t for t in timeouts[1:] if t is not None]
        assert deadlines and 0.01 < deadlines[0] <= 1.0
        assert len(deadlines) <= 3
    finally:
        await engine.shutdown(drain=False)
