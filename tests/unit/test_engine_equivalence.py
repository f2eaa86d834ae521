"""Token-exact equivalence: whatever the batching does, a request gets the tokens it gets alone
(with the batch-invariant kernels, which these tests turn on: the default kernels are equal only
up to rounding).

The reference runs each request alone (a batch of one) on the same weights; every other
configuration runs all 48 requests together and must reproduce those tokens exactly:
continuous batching, chunked prefill, a KV cache small enough to force preemptions, a window
changed mid-run, and static batching.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from batchpilot_runtime.contract.admin_api import WindowState
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.engine.engine import Engine
from batchpilot_runtime.engine.types import GenerationRequest, TokenEvent
from batchpilot_runtime.scheduling.types import RequestTimings, StepStats
from tests.support.tiny_engine import VOCAB, tiny_engine
from tests.support.torch_fixtures import one_thread_per_module  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.slow

NUM_REQUESTS = 48
STEP_S = 0.001
MAX_STEPS = 5_000


class StepClock:
    """A clock the test advances by one millisecond per engine step: deterministic admissions."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class Recorder:
    """An EngineObserver that keeps what it is told."""

    steps: list[StepStats] = field(default_factory=list)
    finished: list[tuple[RequestTimings, str]] = field(default_factory=list)
    gaps: int = 0
    windows: list[WindowState] = field(default_factory=list)
    admitted: list[tuple[str, float]] = field(default_factory=list)
    first_tokens: list[tuple[str, float]] = field(default_factory=list)

    def on_admitted(self, lane: str, queue_wait_s: float) -> None:
        self.admitted.append((lane, queue_wait_s))

    def on_first_token(self, lane: str, ttft_s: float) -> None:
        self.first_tokens.append((lane, ttft_s))

    def on_step(self, stats: StepStats, step_seconds: float, forward_seconds: float) -> None:
        assert 0.0 <= forward_seconds <= step_seconds
        self.steps.append(stats)

    def on_request_finished(self, timings: RequestTimings, outcome: str) -> None:
        self.finished.append((timings, outcome))

    def on_tokens(self, lane: str, inter_token_gaps_s: Sequence[float]) -> None:
        self.gaps += len(inter_token_gaps_s)

    def on_window(self, state: WindowState) -> None:
        self.windows.append(state)


def make_requests(n: int = NUM_REQUESTS, seed: int = 20261129) -> list[GenerationRequest]:
    """Prompts of 1 to 90 tokens in three bands, outputs of 1 to 24 tokens."""
    rng = random.Random(seed)
    requests = []
    for index in range(n):
        band = index % 3
        prompt_len = rng.randint(1, 8) if band == 0 else rng.randint(9, 40) if band == 1 else rng.randint(41, 90)
        requests.append(
            GenerationRequest(
                request_id=f"r{index}",
                prompt_token_ids=[rng.randrange(VOCAB) for _ in range(prompt_len)],
                max_tokens=1 if index % 11 == 0 else rng.randint(2, 24),
            )
        )
    return requests


def make_engine(
    *,
    window: Window | None = None,
    kv_cache_tokens: int = 8192,
    batching: str = "continuous",
    max_prefill_tokens_per_step: int | None = None,
    observer: Recorder | None = None,
) -> tuple[Engine, StepClock]:
    clock = StepClock()
    engine = tiny_engine(
        window or Window(target_batch_size=8, hard_cap=32, max_wait_ms=0),
        kv_cache_tokens=kv_cache_tokens,
        batching="static" if batching == "static" else "continuous",
        max_prefill_tokens_per_step=max_prefill_tokens_per_step,
        max_queue=NUM_REQUESTS,
        clock=clock,
        observer=observer,
        batch_invariant=True,  # token-exact against alone is what the opt-in promises
    )
    return engine, clock


def run_to_completion(
    engine: Engine,
    clock: StepClock,
    requests: Sequence[GenerationRequest],
    before_step: Callable[[int], None] | None = None,
) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finish: dict[str, str] = {}
    for request in requests:
        engine.add_request(request)
    steps = 0
    while engine.has_unfinished:
        if before_step is not None:
            before_step(steps)
        events: list[TokenEvent] = engine.step()
        clock.now_s += STEP_S
        for event in events:
            if event.token_id is not None:
                tokens[event.request_id].append(event.token_id)
            if event.finish_reason is not None:
                finish[event.request_id] = event.finish_reason
        steps += 1
        assert steps < MAX_STEPS, "the engine did not finish the requests"
    assert finish == {r.request_id: "length" for r in requests}
    for request in requests:
        assert len(tokens[request.request_id]) == request.max_tokens
    return tokens


@pytest.fixture(scope="module")
def requests() -> list[GenerationRequest]:
    return make_requests()


@pytest.fixture(scope="module")
def alone(requests: list[GenerationRequest]) -> dict[str, list[int]]:
    """Each request run by itself: the reference every batched run must reproduce."""
    recorder = Recorder()
    engine, clock = make_engine(window=Window(target_batch_size=1, hard_cap=1, max_wait_ms=0), observer=recorder)
    reference: dict[str, list[int]] = {}
    for request in requests:
        reference.update(run_to_completion(engine, clock, [request]))
    assert max(stats.batch_size for stats in recorder.steps) == 1
    return reference


def test_requests_are_mixed(requests: list[GenerationRequest]) -> None:
    prompt_lens = {len(r.prompt_token_ids) for r in requests}
    output_lens = {r.max_tokens for r in requests}
    assert len(requests) >= 48
    assert min(prompt_lens) <= 8 and max(prompt_lens) > 40 and len(prompt_lens) > 20
    assert 1 in output_lens and len(output_lens) > 10


def test_continuous_batching_matches_alone(requests: list[GenerationRequest], alone: dict[str, list[int]]) -> None:
    recorder = Recorder()
    engine, clock = make_engine(observer=recorder)
    assert run_to_completion(engine, clock, requests) == alone
    # it really batched: full batches, with prefills and decodes mixed in one step
    assert max(stats.batch_size for stats in recorder.steps) == 32
    assert any(stats.num_prefill_seqs and stats.num_decode_seqs for stats in recorder.steps)
    assert engine.scheduler.kv_usage_ratio == 0.0
    assert sorted(outcome for _, outcome in recorder.finished) == ["completed"] * NUM_REQUESTS
    assert recorder.gaps == sum(r.max_tokens - 1 for r in requests)


def test_chunked_prefill_matches_alone(requests: list[GenerationRequest], alone: dict[str, list[int]]) -> None:
    budget_tokens = 24
    recorder = Recorder()
    engine, clock = make_engine(max_prefill_tokens_per_step=budget_tokens, observer=recorder)
    assert run_to_completion(engine, clock, requests) == alone
    assert max(stats.num_prefill_tokens for stats in recorder.steps) == budget_tokens
    assert max(len(r.prompt_token_ids) for r in requests) > budget_tokens  # so some prompt was split


def test_preemption_matches_alone(requests: list[GenerationRequest], alone: dict[str, list[int]]) -> None:
    # 12 blocks of 16 tokens: the longest request (90 + 24 tokens) fits alone, 32 running ones never do.
    recorder = Recorder()
    engine, clock = make_engine(kv_cache_tokens=12 * 16, observer=recorder)
    assert run_to_completion(engine, clock, requests) == alone
    assert sum(stats.preempted for stats in recorder.steps) > 0
    assert any(timings.preemptions > 0 for timings, _ in recorder.finished)
    assert engine.scheduler.kv_usage_ratio == 0.0
    # A preempted request's wait and TTFT are observed once, when they happened: the first admission
    # and the first token its timings carry, resumes and recomputed tokens not again.
    waits = sorted(t.queue_wait_s or 0.0 for t, _ in recorder.finished)
    ttfts = sorted(t.ttft_s or 0.0 for t, _ in recorder.finished)
    assert sorted(wait for _, wait in recorder.admitted) == pytest.approx(waits)
    assert sorted(ttft for _, ttft in recorder.first_tokens) == pytest.approx(ttfts)


def test_chunked_prefill_with_preemption_matches_alone(
    requests: list[GenerationRequest], alone: dict[str, list[int]]
) -> None:
    recorder = Recorder()
    engine, clock = make_engine(kv_cache_tokens=12 * 16, max_prefill_tokens_per_step=20, observer=recorder)
    assert run_to_completion(engine, clock, requests) == alone
    assert sum(stats.preempted for stats in recorder.steps) > 0


def test_window_change_mid_run_matches_alone(requests: list[GenerationRequest], alone: dict[str, list[int]]) -> None:
    recorder = Recorder()
    engine, clock = make_engine(window=Window(target_batch_size=4, hard_cap=4, max_wait_ms=0), observer=recorder)
    wide = Window(target_batch_size=16, hard_cap=24, max_wait_ms=0, generation=1)
    narrow = Window(target_batch_size=2, hard_cap=2, max_wait_ms=0, generation=2)

    def change_window(step: int) -> None:
        if step == 10:
            engine.set_window(wide)
            assert engine.scheduler.window.generation == 0  # staged, not applied mid-step
        elif step == 40:
            engine.set_window(narrow)

    assert run_to_completion(engine, clock, requests, before_step=change_window) == alone
    generations = [stats.window_generation for stats in recorder.steps]
    assert generations[:10] == [0] * 10 and generations[10:40] == [1] * 30 and set(generations[40:]) == {2}
    assert max(stats.batch_size for stats in recorder.steps[:10]) == 4
    assert max(stats.batch_size for stats in recorder.steps[10:40]) == 24


def test_static_batching_matches_alone(requests: list[GenerationRequest], alone: dict[str, list[int]]) -> None:
    recorder = Recorder()
    engine, clock = make_engine(window=Window(target_batch_size=12, hard_cap=12, max_wait_ms=0), batching="static")
    engine.observer = recorder
    assert run_to_completion(engine, clock, requests) == alone
    assert max(stats.batch_size for stats in recorder.steps) == 12


def test_seeded_sampling_is_reproducible_in_a_batch_and_across_preemption() -> None:
    rng = random.Random(7)
    sampled = [
        GenerationRequest(
            request_id=f"s{index}",
            prompt_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(5, 60))],
            max_tokens=rng.randint(8, 20),
            temperature=0.9,
            top_p=0.95,
            seed=1000 + index,
        )
        for index in range(12)
    ]
    engine, clock = make_engine(window=Window(target_batch_size=1, hard_cap=1, max_wait_ms=0))
    reference: dict[str, list[int]] = {}
    for request in sampled:
        reference.update(run_to_completion(engine, clock, [request]))
    recorder = Recorder()
    engine, clock = make_engine(kv_cache_tokens=8 * 16, observer=recorder)
    assert run_to_completion(engine, clock, sampled) == reference
    assert sum(stats.preempted for stats in recorder.steps) > 0
    assert len({tuple(tokens) for tokens in reference.values()}) == len(sampled)
