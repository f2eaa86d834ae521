"""The engine: scheduler steps run on the model.

``Engine`` is synchronous. One step is: the scheduler plans (pure, clock passed in) ->
``ForwardBatch.build`` -> ``model.forward`` under ``torch.inference_mode`` -> sampling of
the sequences whose step ends on a new token -> ``scheduler.update_from_output`` -> one
``TokenEvent`` per new token or finished request. ``async_engine.AsyncEngine`` serves it to
asyncio from one thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from batchpilot_runtime.contract.admin_api import LaneWindow, PodCapacity, WindowState
from batchpilot_runtime.contract.window import MAX_BATCH_SIZE, Window
from batchpilot_runtime.engine.types import (
    FINISH_TO_OUTCOME,
    AcceptedRequest,
    EngineLoad,
    EngineObserver,
    GenerationRequest,
    InvalidWindowError,
    TokenEvent,
    check_request,
)
from batchpilot_runtime.model.batch import ForwardBatch
from batchpilot_runtime.model.config import config_from_name
from batchpilot_runtime.model.device import pick_device
from batchpilot_runtime.model.kv_cache import PagedKVCache
from batchpilot_runtime.model.model import LlamaModel
from batchpilot_runtime.model.sampling import SamplingParams, make_generator, sample
from batchpilot_runtime.model.sources import load_checkpoint, resolve_checkpoint
from batchpilot_runtime.model.tokenizer import Tokenizer, load_tokenizer
from batchpilot_runtime.scheduling.lanes import check_window
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import RequestOutput, SchedulerConfig, StepPlan

Clock = Callable[[], float]
Batching = Literal["continuous", "static"]

DEFAULT_KV_CACHE_TOKENS = 65_536
DEFAULT_KV_MEMORY_FRACTION = 0.85
DEFAULT_KV_BLOCK_SIZE = 16
DEFAULT_MAX_QUEUE = 1024


@dataclass
class _LiveRequest:
    """Engine-side state of one request, kept across preemptions (the generator too, so that a
    seeded request draws the same random numbers whether or not it was recomputed)."""

    lane: str
    arrival_s: float
    params: SamplingParams
    generator: torch.Generator | None
    admitted: bool = False  # first scheduled (a resume after a preemption is no new admission)
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
        """Model (a preset with seeded random weights, or a checkpoint: a named model, a GGUF file or a
        safetensors directory, see ``model.sources``), tokenizer, KV cache
        (``kv_cache_tokens``, or on CUDA without it a fraction of free memory) and scheduler.

        ``batch_invariant`` None: off unless BATCHPILOT_BATCH_INVARIANT is set (model/kernels.py);
        on makes batching token-exact against each request alone, at a cost in speed."""
        torch_device, torch_dtype = pick_device(device, dtype)
        if checkpoint is not None:
            source = resolve_checkpoint(checkpoint)
            model, tokenizer = load_checkpoint(source, torch_device, torch_dtype, batch_invariant)
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

    def check_request(self, request: GenerationRequest, arrival_s: float) -> AcceptedRequest:
        """``types.check_request`` with this engine's limits and vocabulary. Depends only on the
        engine's fixed configuration, so it may run on any thread."""
        return check_request(request, self.scheduler.limits, self.vocab_size, arrival_s)

    def add_request(self, request: GenerationRequest, arrival_s: float | None = None) -> None:
        """Check and queue a request; ``QueueFullError`` / ``RequestRejected`` when it cannot be queued."""
        self.enqueue(self.check_request(request, self.clock() if arrival_s is None else arrival_s))

    def enqueue(self, accepted: AcceptedRequest) -> None:
        """Queue a checked request; the scheduler refuses an id in use, a lane not open, a full queue."""
        request = accepted.request
        self.scheduler.enqueue(request)
        generator = make_generator(accepted.params, self.device)
        self._live[request.request_id] = _LiveRequest(
            request.lane, accepted.request.arrival_s, accepted.params, generator
        )

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
            retry_after_s=self.scheduler.retry_after_s(),
        )

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """Run one step; returns the new tokens and finished requests (empty when nothing ran)."""
        step_start = time.perf_counter()
        # 1. Plan: admissions, chunking, preemptions; a staged window takes effect here.
        schedule_s = self.clock()
        plan = self.scheduler.schedule(schedule_s)
        if plan.is_empty:
            return []
        if self.observer is not None:
            self._observe_admissions(plan, schedule_s)
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

    def _observe_admissions(self, plan: StepPlan, schedule_s: float) -> None:
        # An admitted request gets its first prompt chunk in the step that admits it, so its first
        # plan is its admission, at the very time the scheduler records as first_admitted_s.
        assert self.observer is not None
        for seq in plan.seqs:
            live = self._live.get(seq.request_id)
            if live is not None and not live.admitted:
                live.admitted = True
                self.observer.on_admitted(live.lane, schedule_s - live.arrival_s)

    def _events(self, outputs: Sequence[RequestOutput], now_s: float) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        gaps_by_lane: dict[str, list[float]] = {}
        for output in outputs:
            live = self._live.get(output.request_id)
            if output.token_id is not None and live is not None:
                if live.last_token_s is not None:
                    gaps_by_lane.setdefault(live.lane, []).append(now_s - live.last_token_s)
                elif self.observer is not None:
                    self.observer.on_first_token(live.lane, now_s - live.arrival_s)
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
        try:
            check_window(window, {lane.name: lane for lane in lanes}, self.capacity.max_hard_cap)
        except ValueError as error:
            raise InvalidWindowError(str(error)) from None

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
