"""The engine: scheduler steps run on the model, and the thread that serves them to asyncio.

``Engine`` is synchronous. One step is: the scheduler plans (pure, clock passed in) ->
``ForwardBatch.build`` -> ``model.forward`` under ``torch.inference_mode`` -> sampling of
the sequences whose step ends on a new token -> ``scheduler.update_from_output`` -> one
``TokenEvent`` per new token or finished request.

``AsyncEngine`` owns an ``Engine`` on one dedicated thread. That thread is the only one that
touches the scheduler, the model and the KV cache; ``submit``/``abort``/``update_window``
hand it commands through a condition-guarded inbox, and it hands events back to each
request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe`` (one call per step and loop).
It sleeps on the condition until a command arrives or the scheduler's next deadline
(the wait or tail rule) falls due, so an idle engine costs no CPU. A watchdog
(``watchdog.EngineWatchdog``) is told of every step and every such sleep, so that a step that
never returns shows in ``AsyncEngine.health()`` (and so in /healthz and /metrics).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LaneWindow, PodCapacity, WindowState, WindowUpdate
from batchpilot_runtime.contract.window import MAX_BATCH_SIZE, Window
from batchpilot_runtime.engine.watchdog import DEFAULT_STALL_TIMEOUT_S, EngineHealth, EngineWatchdog
from batchpilot_runtime.model.batch import ForwardBatch
from batchpilot_runtime.model.config import config_from_name
from batchpilot_runtime.model.device import pick_device
from batchpilot_runtime.model.kv_cache import PagedKVCache
from batchpilot_runtime.model.model import LlamaModel
from batchpilot_runtime.model.sampling import SamplingParams, make_generator, sample
from batchpilot_runtime.model.tokenizer import Tokenizer, load_tokenizer
from batchpilot_runtime.scheduling.kv_blocks import blocks_for_tokens
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import (
    QueueFullError,
    RequestOutput,
    RequestRejected,
    RequestTimings,
    SchedRequest,
    SchedulerConfig,
    StepStats,
)

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineLoad",
    "EngineObserver",
    "EngineStoppedError",
    "GenerationRequest",
    "InvalidWindowError",
    "QueueFullError",
    "RequestRejected",
    "StaleGenerationError",
    "TokenEvent",
]

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Batching = Literal["continuous", "static"]

DEFAULT_KV_CACHE_TOKENS = 65_536
DEFAULT_KV_MEMORY_FRACTION = 0.85
DEFAULT_KV_BLOCK_SIZE = 16
DEFAULT_MAX_QUEUE = 1024
# When the scheduler reports a deadline that is already due but still plans nothing, the
# engine thread re-checks after this long instead of spinning.
_MIN_IDLE_WAIT_S = 0.001
# With requests in the scheduler but neither a plan nor a deadline (nothing should do
# that), re-check at this period so that a scheduler oversight cannot hang a request; the
# watchdog counts these waits towards a stall.
_STALLED_POLL_S = 0.05

_FINISH_RATE_SAMPLES = 64
_RETRY_AFTER_MIN_S = 0.1
_RETRY_AFTER_MAX_S = 60.0

FINISH_TO_OUTCOME = {"length": "completed", "stop": "completed", "cancelled": "cancelled", "error": "error"}


def _rejected(field_name: str, message: str) -> RequestRejected:
    return RequestRejected(f"{field_name}: {message}", field_name)


class StaleGenerationError(Exception):
    """A window update whose generation is older than the one in force (HTTP 409)."""

    def __init__(self, offered: Window, in_force: Window) -> None:
        if offered.generation < in_force.generation:
            why = f"generation {offered.generation} is older than the generation in force ({in_force.generation})"
        else:
            why = f"generation {offered.generation} is already in force with a different window ({in_force.describe()})"
        super().__init__(why)
        self.offered = offered
        self.window_in_force = in_force


class InvalidWindowError(ValueError):
    """A window the pod cannot apply (HTTP 422); the message gives the reason and names the field."""


class EngineStoppedError(RuntimeError):
    """The engine is draining or stopped and accepts no new request (HTTP 503)."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    lane: str = DEFAULT_LANE


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int | None
    finish_reason: str | None
    error: str | None = None
    timings: RequestTimings | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot for gauges, published by the engine thread after every step."""

    queue_depth: int
    running: int
    kv_usage_ratio: float


class EngineObserver(Protocol):
    """Implemented by the server's metrics layer; every call comes from the engine thread."""

    def on_step(self, stats: StepStats, step_seconds: float, forward_seconds: float) -> None: ...

    def on_request_finished(self, timings: RequestTimings, outcome: str) -> None: ...

    def on_tokens(self, lane: str, inter_token_gaps_s: Sequence[float]) -> None: ...

    def on_window(self, state: WindowState) -> None: ...


@dataclass
class _LiveRequest:
    """Engine-side state of one request, kept across preemptions (the generator too, so that a
    seeded request draws the same random numbers whether or not it was recomputed)."""

    lane: str
    params: SamplingParams
    generator: torch.Generator | None
    last_token_s: float | None = None


class Engine:
    """Runs one scheduler step at a time on the model. Not thread-safe: one owner at a time."""

    def __init__(
        self,
        model: LlamaModel,
        kv: PagedKVCache,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        model_name: str,
        clock: Clock = time.monotonic,
        observer: EngineObserver | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.clock = clock
        self.observer = observer
        config = scheduler.config
        self.batching: Batching = config.batching
        self.block_size = config.kv_block_size
        self.max_model_len = config.max_model_len
        self.max_queue = config.max_queue
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        self.capacity = PodCapacity(
            kv_cache_tokens=scheduler.capacity_tokens,
            kv_block_size=self.block_size,
            # Every running sequence holds at least one KV block.
            max_hard_cap=max(1, min(MAX_BATCH_SIZE, scheduler.capacity_tokens // self.block_size)),
            max_model_len=self.max_model_len,
        )
        self.steps_run = 0
        self._live: dict[str, _LiveRequest] = {}

    # -- construction -------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        *,
        model_name: str,
        window: Window,
        preset: str = "tiny",
        checkpoint: Path | str | None = None,
        kv_cache_tokens: int | None = None,
        kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION,
        kv_block_size: int = DEFAULT_KV_BLOCK_SIZE,
        lanes: Mapping[str, LaneWindow] | None = None,
        batching: Batching = "continuous",
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_prefill_tokens_per_step: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        device: str | None = None,
        dtype: str | None = None,
        batch_invariant: bool | None = None,
        clock: Clock = time.monotonic,
        observer: EngineObserver | None = None,
    ) -> Engine:
        """Model (a preset with seeded random weights, or a local checkpoint), tokenizer, KV cache
        (``kv_cache_tokens``, or on CUDA without it a fraction of free memory) and scheduler.

        ``batch_invariant`` None keeps the model's default (on for CPU: token-exact batching at
        about half the GEMM speed; off trades exactness across batch sizes for speed)."""
        torch_device, torch_dtype = pick_device(device, dtype)
        if checkpoint is not None:
            checkpoint_dir = Path(checkpoint)
            model = LlamaModel.from_safetensors(checkpoint_dir, torch_device, torch_dtype, batch_invariant)
            tokenizer = load_tokenizer(checkpoint_dir)
        else:
            model = LlamaModel.random(config_from_name(preset), seed, torch_device, torch_dtype, batch_invariant)
            tokenizer = load_tokenizer(None)
        model.eval()
        config = model.config
        if kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {kv_block_size}")
        if kv_cache_tokens is not None:
            if kv_cache_tokens < kv_block_size:
                raise ValueError(f"kv_cache_tokens must be >= kv_block_size ({kv_block_size}), got {kv_cache_tokens}")
            num_blocks = PagedKVCache.blocks_for_token_budget(kv_cache_tokens, kv_block_size)
        elif torch_device.type == "cuda":
            if not 0.0 < kv_memory_fraction < 1.0:
                raise ValueError(f"kv_memory_fraction must be in (0, 1), got {kv_memory_fraction}")
            num_blocks = PagedKVCache.blocks_for_memory_fraction(
                config, kv_block_size, kv_memory_fraction, torch_device, torch_dtype
            )
        else:
            num_blocks = PagedKVCache.blocks_for_token_budget(DEFAULT_KV_CACHE_TOKENS, kv_block_size)
        kv = PagedKVCache(config, num_blocks, kv_block_size, torch_device, torch_dtype)
        model_len = config.max_position_embeddings if max_model_len is None else max_model_len
        if model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({model_len}) exceeds the model's max_position_embeddings "
                f"({config.max_position_embeddings})"
            )
        scheduler = Scheduler(
            SchedulerConfig(
                num_kv_blocks=num_blocks,
                kv_block_size=kv_block_size,
                max_model_len=min(model_len, num_blocks * kv_block_size),
                max_prefill_tokens_per_step=max_prefill_tokens_per_step,
                max_queue=max_queue,
                batching=batching,
            ),
            window,
            lanes,
        )
        return cls(model, kv, scheduler, tokenizer, model_name, clock=clock, observer=observer)

    # -- requests -----------------------------------------------------------------------

    def check_request(self, request: GenerationRequest, lanes: Collection[str] | None = None) -> None:
        """Raise ``RequestRejected`` naming the field when the request can never be served.

        Depends only on the engine's fixed configuration and ``lanes`` (the named lanes; the
        scheduler's when None), so ``AsyncEngine`` calls it on the caller's thread, with the
        lanes it last accepted, to refuse bad requests at once."""
        if not request.request_id:
            raise _rejected("request_id", "must not be empty")
        prompt_tokens = len(request.prompt_token_ids)
        if prompt_tokens == 0:
            raise _rejected("prompt_token_ids", "must not be empty")
        for token in request.prompt_token_ids:
            if not 0 <= token < self.vocab_size:
                raise _rejected("prompt_token_ids", f"token {token} is outside the vocabulary [0, {self.vocab_size})")
        if request.max_tokens < 1:
            raise _rejected("max_tokens", f"must be >= 1, got {request.max_tokens}")
        if prompt_tokens >= self.max_model_len:
            raise _rejected(
                "prompt_token_ids",
                f"the prompt has {prompt_tokens} tokens; the maximum sequence length {self.max_model_len} "
                "leaves no room to generate",
            )
        total_tokens = prompt_tokens + request.max_tokens
        if total_tokens > self.max_model_len:
            raise _rejected(
                "max_tokens",
                f"{request.max_tokens} new tokens after a {prompt_tokens}-token prompt exceed the maximum "
                f"sequence length {self.max_model_len}",
            )
        # The last sampled token is never fed back, so it needs no KV slot.
        if blocks_for_tokens(total_tokens - 1, self.block_size) * self.block_size > self.capacity.kv_cache_tokens:
            raise _rejected(
                "max_tokens",
                f"a {prompt_tokens}-token prompt with {request.max_tokens} new tokens does not fit the KV cache "
                f"({self.capacity.kv_cache_tokens} tokens)",
            )
        for name in ("temperature", "top_p", "seed"):
            value = getattr(request, name)
            try:
                SamplingParams(**{name: value})
            except (TypeError, ValueError) as error:
                raise _rejected(name, str(error).removeprefix(f"{name}: ")) from None
        named_lanes = self.scheduler.lanes if lanes is None else lanes
        if request.lane != DEFAULT_LANE and request.lane not in named_lanes:
            known = ", ".join(sorted({DEFAULT_LANE, *named_lanes}))
            raise _rejected("lane", f"unknown lane {request.lane!r} (known: {known})")

    def add_request(self, request: GenerationRequest, arrival_s: float | None = None) -> None:
        """Queue a request; ``QueueFullError`` / ``RequestRejected`` when it cannot be queued."""
        self.check_request(request)
        if request.request_id in self._live:
            raise _rejected("request_id", f"{request.request_id!r} is already queued or running")
        self.scheduler.add_request(
            SchedRequest(
                request_id=request.request_id,
                prompt_token_ids=tuple(request.prompt_token_ids),
                max_new_tokens=request.max_tokens,
                arrival_s=self.clock() if arrival_s is None else arrival_s,
                lane=request.lane,
                stop_token_ids=frozenset(request.stop_token_ids),
            )
        )
        params = SamplingParams(temperature=request.temperature, top_p=request.top_p, seed=request.seed)
        self._live[request.request_id] = _LiveRequest(request.lane, params, make_generator(params, self.device))

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request and free its KV; None when it is unknown or already finished."""
        return self.finish(request_id, "cancelled")

    def finish(self, request_id: str, reason: str, error: str | None = None) -> TokenEvent | None:
        """End a request early (a stop string, a cancellation, an error); frees its KV."""
        now_s = self.clock()
        if reason == "cancelled":
            output = self.scheduler.abort(request_id, now_s)
        else:
            output = self.scheduler.finish(request_id, reason, now_s)
        if output is None:
            self._live.pop(request_id, None)
            return None
        return self._finished_event(output, error)

    @property
    def live_request_ids(self) -> list[str]:
        return list(self._live)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished)

    def next_deadline_s(self) -> float | None:
        return self.scheduler.next_deadline_s()

    def load(self) -> EngineLoad:
        return EngineLoad(
            queue_depth=self.scheduler.num_waiting,
            running=self.scheduler.num_running,
            kv_usage_ratio=self.scheduler.kv_usage_ratio,
        )

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """Run one step; returns the new tokens and finished requests (empty when nothing ran)."""
        step_start = time.perf_counter()
        # 1. Plan: admissions, chunking, preemptions; a staged window takes effect here.
        plan = self.scheduler.schedule(self.clock())
        if plan.is_empty:
            return []
        # 2. One forward over every scheduled token: prompt chunks and decodes together (the
        #    model groups attention by query length itself).
        batch = ForwardBatch.build(plan.seqs, self.block_size, self.device)
        forward_start = time.perf_counter()
        with torch.inference_mode():
            logits = self.model(batch, self.kv)
            if self.device.type == "cuda":
                # Only so that forward_seconds measures the kernels; sampling would sync anyway.
                torch.cuda.synchronize(self.device)
            forward_s = time.perf_counter() - forward_start
            # 3. Sample one token for each sequence whose step ends at its last known token.
            sampling_ids = [seq.request_id for seq in plan.seqs if seq.sample]
            sampled: dict[str, int] = {}
            if sampling_ids:
                live = [self._live[request_id] for request_id in sampling_ids]
                tokens = sample(logits, [r.params for r in live], [r.generator for r in live])
                sampled = dict(zip(sampling_ids, tokens, strict=True))
        # 4. Hand the tokens to the scheduler: appends, stop and length checks, KV release.
        now_s = self.clock()
        outputs = self.scheduler.update_from_output(plan, sampled, now_s)
        events = self._events(outputs, now_s)
        self.steps_run += 1
        if self.observer is not None:
            self.observer.on_step(plan.stats, time.perf_counter() - step_start, forward_s)
        return events

    def _events(self, outputs: Sequence[RequestOutput], now_s: float) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        gaps_by_lane: dict[str, list[float]] = {}
        for output in outputs:
            live = self._live.get(output.request_id)
            if output.token_id is not None and live is not None:
                if live.last_token_s is not None:
                    gaps_by_lane.setdefault(live.lane, []).append(now_s - live.last_token_s)
                live.last_token_s = now_s
            if output.finish_reason is None:
                events.append(TokenEvent(output.request_id, output.token_id, None))
            else:
                events.append(self._finished_event(output, None))
        if self.observer is not None:
            for lane, gaps in gaps_by_lane.items():
                self.observer.on_tokens(lane, gaps)
        return events

    def _finished_event(self, output: RequestOutput, error: str | None) -> TokenEvent:
        self._live.pop(output.request_id, None)
        reason = output.finish_reason or "error"
        if self.observer is not None and output.timings is not None:
            self.observer.on_request_finished(output.timings, FINISH_TO_OUTCOME.get(reason, "error"))
        return TokenEvent(output.request_id, output.token_id, reason, error, output.timings)

    # -- the window ---------------------------------------------------------------------

    def validate_window(self, window: Window, lanes: Collection[LaneWindow] = ()) -> None:
        """Raise ``InvalidWindowError`` (with the reason, naming the field) for a window this pod
        cannot hold. ``lanes`` is the complete set of named lanes that would be in force.

        Depends only on the engine's fixed capacity, so it may run on any thread."""
        cap_limit = self.capacity.max_hard_cap
        if window.hard_cap > cap_limit:
            raise InvalidWindowError(
                f"window.hardCap: {window.hard_cap} exceeds what the KV cache can hold, {cap_limit} sequences "
                f"({self.capacity.kv_cache_tokens} tokens in blocks of {self.block_size})"
            )
        reserved = 0
        for lane in lanes:
            if lane.name == DEFAULT_LANE:
                raise InvalidWindowError(f"lanes: {DEFAULT_LANE!r} is the main window's lane and cannot be listed")
            if lane.window.hard_cap > cap_limit:
                raise InvalidWindowError(
                    f"lanes[{lane.name}].window.hardCap: {lane.window.hard_cap} exceeds what the KV cache can hold, "
                    f"{cap_limit} sequences"
                )
            reserved += min(lane.reserved_slots, lane.window.hard_cap)
        if lanes and reserved >= window.hard_cap:
            raise InvalidWindowError(
                f"lanes: reservedSlots add up to {reserved}, which leaves none of window.hardCap "
                f"({window.hard_cap}) to the default lane"
            )

    def set_window(self, window: Window, lanes: Mapping[str, LaneWindow] | None = None) -> None:
        """Stage a window; the scheduler applies it at the start of the next step."""
        self.scheduler.set_window(window, lanes)

    def window_state(self) -> WindowState:
        """The window and lanes in force (a staged window shows only after the next step)."""
        return WindowState(
            model=self.model_name,
            window=self.scheduler.window,
            lanes=[lane for _, lane in sorted(self.scheduler.lanes.items())],
            capacity=self.capacity,
            batching=self.batching,
            default_prefill_tokens=self.scheduler.config.max_prefill_tokens_per_step,
        )


# -- the asynchronous front ---------------------------------------------------------------


@dataclass(frozen=True)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenEvent]


@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest
    arrival_s: float
    sink: _Sink


@dataclass(frozen=True)
class _Finish:
    request_id: str
    reason: str


@dataclass(frozen=True)
class _SetWindow:
    window: Window
    lanes: Mapping[str, LaneWindow] | None
    state: WindowState  # what the caller was told; reported to the observer once applied


_Command = _Submit | _Finish | _SetWindow


def _deliver(batch: Sequence[tuple[asyncio.Queue[TokenEvent], TokenEvent]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)


class AsyncEngine:
    """Runs ``Engine.step`` on its own thread; never blocks the asyncio loop.

    Invariant: only the engine thread calls the ``Engine`` (scheduler, model, KV). Callers
    touch nothing but the inbox, and a few fields of this object guarded by ``_cond``; the
    engine thread never holds ``_cond`` during a step, so ``health()`` answers while one hangs.
    """

    def __init__(self, engine: Engine, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._inbox: deque[_Command] = deque()
        self._accepting = True
        self._stop: Literal["drain", "cancel"] | None = None
        self._pending_submits = 0
        self._request_ids: set[str] = set()  # submitted and not yet finished
        self._window_state = engine.window_state()
        self._watchdog = EngineWatchdog(stall_timeout_s, engine.clock())
        # Written by the engine thread only (a reference swap), read by anyone:
        self._load = engine.load()
        self._failure: str | None = None
        self._retry_after_s = 1.0
        # Owned by the engine thread:
        self._sinks: dict[str, _Sink] = {}
        self._finish_times_s: deque[float] = deque(maxlen=_FINISH_RATE_SAMPLES)
        self._deferred: list[_Submit] = []  # requests for a lane that is staged, not yet in force
        self._staged_lanes: frozenset[str] = frozenset()
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._thread = threading.Thread(target=self._run, name="batchpilot-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting; with ``drain`` finish every running and waiting request, else cancel them."""
        with self._cond:
            self._accepting = False
            if self._stop != "cancel":
                self._stop = "drain" if drain else "cancel"
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)

    def is_alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and self._failure is None

    @property
    def accepting(self) -> bool:
        with self._cond:
            return self._accepting

    def load(self) -> EngineLoad:
        return self._load

    def health(self) -> EngineHealth:
        """The watchdog's reading: whether pending requests have gone without a step for longer
        than the stall timeout (a hung step), and for how long. Safe from any thread."""
        with self._cond:
            return self._watchdog.check(self.engine.clock())

    # -- requests -----------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Queue a request and return its events, the last one with a ``finish_reason``.

        Raises at once: ``RequestRejected`` (bad field, id in use), ``QueueFullError`` (the
        waiting queue is full), ``EngineStoppedError`` (draining or stopped). Leaving the
        iteration early (a client that hung up) cancels the request and frees its KV."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        with self._cond:
            self.engine.check_request(request, lanes=[lane.name for lane in self._window_state.lanes])
            if not self._accepting or self._failure is not None:
                raise EngineStoppedError(self._failure or "the engine is shutting down and accepts no new request")
            if request.request_id in self._request_ids:
                raise _rejected("request_id", f"{request.request_id!r} is already queued or running")
            waiting = self._load.queue_depth + self._pending_submits
            if waiting >= self.engine.max_queue:
                raise QueueFullError(
                    f"the waiting queue is full ({waiting} requests); retry in {self._retry_after_s:.1f} s",
                    self._retry_after_s,
                )
            self._pending_submits += 1
            self._request_ids.add(request.request_id)
            now_s = self.engine.clock()
            self._watchdog.requests_pending(now_s, len(self._request_ids))
            self._inbox.append(_Submit(request, now_s, _Sink(loop, queue)))
            self._cond.notify()
        return self._stream(request.request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue[TokenEvent]) -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.is_final
                yield event
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op when it already ended); its stream ends with ``cancelled``."""
        self.finish(request_id, "cancelled")

    def finish(self, request_id: str, reason: str = "stop") -> None:
        """End a request early (e.g. ``"stop"`` on a stop string the server matched): its KV is
        freed and its stream ends with ``reason``. No-op when it already ended."""
        if reason not in FINISH_TO_OUTCOME:
            raise ValueError(f"reason must be one of {', '.join(FINISH_TO_OUTCOME)}, got {reason!r}")
        with self._cond:
            self._inbox.append(_Finish(request_id, reason))
            self._cond.notify()

    # -- the window ---------------------------------------------------------------------

    def update_window(self, update: WindowUpdate) -> WindowState:
        """Validate and stage a window for the next step boundary; returns the accepted state.

        ``update.lanes``, when given, is the complete new set of named lanes (a lane left out is
        retired once its requests finish); None keeps the lanes in force. Re-sending the window in
        force with its generation is accepted and changes nothing (level-triggered pushes).
        ``StaleGenerationError`` (409): a generation older than the one in force, or the same
        generation with other values. ``InvalidWindowError`` (422): the pod cannot hold it."""
        offered = update.window
        new_lanes: dict[str, LaneWindow] | None = None
        if update.lanes is not None:
            new_lanes = {}
            for lane in update.lanes:
                if lane.name in new_lanes:
                    raise InvalidWindowError(f"lanes: lane {lane.name!r} is listed twice")
                new_lanes[lane.name] = lane
        with self._cond:
            current = self._window_state
            in_force = current.window
            current_lanes = {lane.name: lane for lane in current.lanes}
            lanes = current_lanes if new_lanes is None else new_lanes
            if offered.generation < in_force.generation:
                raise StaleGenerationError(offered, in_force)
            if offered.generation == in_force.generation:
                if offered.fields_equal(in_force) and lanes == current_lanes:
                    return current
                raise StaleGenerationError(offered, in_force)
            self.engine.validate_window(offered, list(lanes.values()))
            state = current.model_copy(update={"window": offered, "lanes": [lanes[name] for name in sorted(lanes)]})
            self._window_state = state
            self._inbox.append(_SetWindow(offered, new_lanes, state))
            self._cond.notify()
        return state

    def window_state(self) -> WindowState:
        with self._cond:
            return self._window_state

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            self._observe_window(self.window_state())
            while True:
                # 1. Take the commands, and the stop order, that arrived since the last step.
                with self._cond:
                    commands = list(self._inbox)
                    self._inbox.clear()
                    stop = self._stop
                replies = self._apply(commands)
                with self._cond:
                    self._pending_submits -= sum(1 for c in commands if isinstance(c, _Submit))
                    self._load = engine.load()
                self._dispatch(replies)
                if stop == "cancel":
                    cancelled = [e for rid in engine.live_request_ids if (e := engine.abort(rid)) is not None]
                    cancelled += [TokenEvent(c.request.request_id, None, "cancelled") for c in self._deferred]
                    self._dispatch(cancelled)
                    break
                if stop == "drain" and not engine.has_unfinished and not self._sinks:
                    break
                # 2. One step, unless there is nothing to run now.
                steps_before = engine.steps_run
                events = self._step_guarded()
                stepped = engine.steps_run != steps_before
                if stepped or events:  # a step ran, or failed and ended its requests
                    with self._cond:
                        self._watchdog.step_ended(engine.clock())
                if self._deferred:
                    # The step's schedule() applied the staged lanes these requests wait for.
                    deferred, self._deferred = self._deferred, []
                    self._staged_lanes = frozenset()
                    events += self._apply(deferred)
                self._load = engine.load()
                self._dispatch(events)
                if stepped:
                    continue
                # 3. Idle: sleep until a command arrives or the next admission deadline.
                with self._cond:
                    if self._inbox or self._stop != stop:
                        continue
                    self._idle_wait()
        except BaseException as error:  # the thread must not die silently
            log.exception("engine thread failed")
            self._fail_everything(f"engine failure: {error!r}")
            raise
        finally:
            with self._cond:
                self._accepting = False

    def _apply(self, commands: Sequence[_Command]) -> list[TokenEvent]:
        replies: list[TokenEvent] = []
        engine = self.engine
        for command in commands:
            if isinstance(command, _Submit):
                request = command.request
                self._sinks[request.request_id] = command.sink
                if request.lane in self._staged_lanes and request.lane not in engine.scheduler.lanes:
                    # Its lane was accepted by update_window but takes effect at the next step.
                    self._deferred.append(command)
                    continue
                try:
                    engine.add_request(request, arrival_s=command.arrival_s)
                except (QueueFullError, RequestRejected) as refused:
                    # The caller's checks ran on a snapshot; the scheduler has the last word.
                    replies.append(TokenEvent(request.request_id, None, "error", str(refused)))
            elif isinstance(command, _Finish):
                event = engine.finish(command.request_id, command.reason)
                if event is not None:
                    replies.append(event)
                elif any(c.request.request_id == command.request_id for c in self._deferred):
                    self._deferred = [c for c in self._deferred if c.request.request_id != command.request_id]
                    replies.append(TokenEvent(command.request_id, None, command.reason))
            else:
                engine.set_window(command.window, command.lanes)
                if command.lanes is not None:
                    self._staged_lanes = frozenset(command.lanes)
                self._observe_window(command.state)
        return replies

    def _step_guarded(self) -> list[TokenEvent]:
        """A step; when it raises, the requests in flight end with an error and the loop goes on."""
        try:
            return self.engine.step()
        except Exception as error:
            log.exception("engine step failed; failing the requests in flight")
            message = f"engine step failed: {error!r}"
            return [
                event
                for request_id in self.engine.live_request_ids
                if (event := self.engine.finish(request_id, "error", message)) is not None
            ]

    def _idle_wait(self) -> None:
        """Sleep on ``_cond`` (held) until a command or the scheduler's next deadline. The watchdog
        does not count a sleep the scheduler asked for, nor one with no request in the scheduler."""
        engine = self.engine
        by_design = not engine.has_unfinished or engine.next_deadline_s() is not None
        if by_design:
            self._watchdog.wait_started()
        self._cond.wait(self._idle_timeout_s())
        if by_design:
            self._watchdog.wait_ended(engine.clock())

    def _idle_timeout_s(self) -> float | None:
        deadline_s = self.engine.next_deadline_s()
        if deadline_s is None:
            return _STALLED_POLL_S if self.engine.has_unfinished else None
        return max(deadline_s - self.engine.clock(), _MIN_IDLE_WAIT_S)

    def _dispatch(self, events: Sequence[TokenEvent]) -> None:
        if not events:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]] = {}
        finished: list[str] = []
        for event in events:
            sink = self._sinks.get(event.request_id)
            if sink is None:
                continue
            by_loop.setdefault(sink.loop, []).append((sink.queue, event))
            if event.is_final:
                del self._sinks[event.request_id]
                finished.append(event.request_id)
        if finished:
            with self._cond:
                self._request_ids.difference_update(finished)
                self._watchdog.requests_pending(self.engine.clock(), len(self._request_ids))
            self._update_retry_after(len(finished))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:
                # The caller's loop is closed: nobody is left to read these events.
                log.debug("dropping %d events for a closed event loop", len(batch))

    def _update_retry_after(self, num_finished: int) -> None:
        # A waiting slot opens when a running request ends, so a full queue has room again after
        # about one finish interval at the recent rate.
        now_s = self.engine.clock()
        self._finish_times_s.extend([now_s] * num_finished)
        times = self._finish_times_s
        if len(times) >= 2 and times[-1] > times[0]:
            interval_s = (times[-1] - times[0]) / (len(times) - 1)
            self._retry_after_s = min(_RETRY_AFTER_MAX_S, max(_RETRY_AFTER_MIN_S, interval_s))

    def _fail_everything(self, message: str) -> None:
        with self._cond:
            self._failure = message
            self._accepting = False
        self._dispatch([TokenEvent(rid, None, "error", message) for rid in list(self._sinks)])

    def _observe_window(self, state: WindowState) -> None:
        observer = self.engine.observer
        if observer is not None:
            observer.on_window(state)
