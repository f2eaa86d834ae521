"""The scheduler's value types: its configuration, a request, a step's plan and outputs, and the errors
that refuse a request. Plain data, no behaviour beyond the configuration's own validation."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE

ADMISSION_REASONS = ("target", "wait", "tail", "cap")
FINISH_REASONS = ("length", "stop", "cancelled", "error")


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_blocks: int
    kv_block_size: int = 16
    max_model_len: int = 4096  # prompt + output tokens of one request
    max_prefill_tokens_per_step: int | None = None  # chunked prefill budget; None = whole prompts
    max_queue: int = 1024  # waiting requests over all lanes; beyond -> QueueFullError
    batching: Literal["continuous", "static"] = "continuous"
    wait_p50_samples: int = 256  # rolling window of queue waits for the tail-mark P50
    tail_min_samples: int = 20  # no tail marking in a lane before it has this many wait samples
    kv_watermark_fraction: float = 0.01  # blocks kept free for decode growth when admitting
    skip_ahead: int = 16  # requests behind an unmarked front that does not fit KV that may pass it (0: strict FCFS)

    def __post_init__(self) -> None:
        positive = {
            "num_kv_blocks": self.num_kv_blocks,
            "kv_block_size": self.kv_block_size,
            "max_model_len": self.max_model_len,
            "max_queue": self.max_queue,
            "wait_p50_samples": self.wait_p50_samples,
            "tail_min_samples": self.tail_min_samples,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_prefill_tokens_per_step is not None and self.max_prefill_tokens_per_step < 1:
            raise ValueError(
                f"max_prefill_tokens_per_step must be at least 1 or None, got {self.max_prefill_tokens_per_step}"
            )
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.tail_min_samples > self.wait_p50_samples:
            raise ValueError(
                f"tail_min_samples ({self.tail_min_samples}) must not exceed wait_p50_samples ({self.wait_p50_samples})"
            )
        if self.skip_ahead < 0:
            raise ValueError(f"skip_ahead must be >= 0, got {self.skip_ahead}")
        if not 0.0 <= self.kv_watermark_fraction < 1.0:
            raise ValueError(f"kv_watermark_fraction must be in [0, 1), got {self.kv_watermark_fraction}")

    @property
    def watermark_blocks(self) -> int:
        return int(self.kv_watermark_fraction * self.num_kv_blocks)


@dataclass(frozen=True, slots=True)
class SchedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float
    lane: str = DEFAULT_LANE
    stop_token_ids: frozenset[int] = frozenset()


class QueueFullError(Exception):
    """The waiting queue is full; ``retry_after_s`` estimates when it will have room."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestRejected(ValueError):
    """A request that can never be served. The message names the field; ``field`` holds it when known."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


# ScheduledSeq and RequestOutput are made once per sequence per step: a frozen dataclass's __init__
# (object.__setattr__ per field) would double the scheduler's per-sequence cost, so they are plain
# slots dataclasses. Treat them as read-only values all the same.
@dataclass(slots=True)
class ScheduledSeq:
    request_id: str
    token_ids: tuple[int, ...]  # a prompt chunk, a recompute chunk, or the last sampled token
    start_pos: int  # absolute position of token_ids[0] (= tokens already in this seq's KV)
    block_table: tuple[int, ...]  # the seq's whole block table after this step's allocation
    sample: bool  # this step's last token yields a new sampled token for the request
    is_prefill: bool


@dataclass(frozen=True, slots=True)
class StepStats:
    batch_size: int
    num_prefill_seqs: int
    num_decode_seqs: int
    num_prefill_tokens: int
    admissions: Mapping[str, int]  # reason -> groups admitted this step
    admitted_requests: int  # first admissions this step (resumes of preempted requests excluded)
    tail_marked: int
    preempted: int
    queue_depth: int  # waiting requests after this step's admissions (preempted ones included)
    running: int
    kv_usage_ratio: float
    window_generation: int
    kv_tokens: int = 0  # the context every scheduled sequence attends to, summed (the cost model's KV term)


@dataclass(frozen=True, slots=True)
class StepPlan:
    seqs: tuple[ScheduledSeq, ...]  # empty plan = nothing to run now
    preempted: tuple[str, ...]  # request ids whose KV was freed this step (recomputed later)
    stats: StepStats

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True, slots=True)
class RequestTimings:
    arrival_s: float
    first_admitted_s: float | None
    first_token_s: float | None
    finished_s: float
    prompt_tokens: int
    output_tokens: int
    lane: str
    tail_marked: bool
    preemptions: int

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.first_admitted_s is None else self.first_admitted_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_id: int | None
    finish_reason: str | None  # None | "length" | "stop" | "cancelled" | "error"
    timings: RequestTimings | None = None  # set on the finishing output


class SeqStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
