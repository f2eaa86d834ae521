"""What callers exchange with the engine: a generation request and its events, the load snapshot,
the observer interface, the errors, and the one check of a request at the engine's boundary.

``check_request`` turns a ``GenerationRequest`` into an ``AcceptedRequest``: the scheduler's
``CheckedRequest`` (its limits checked once, here) plus the sampling parameters. What it checks
depends only on the engine's fixed configuration, so it runs on the caller's thread; the lane and
the request id are the scheduler's to check, on the engine thread, when it queues the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, InvalidWindowError, StaleGenerationError, WindowState
from batchpilot_runtime.model.sampling import SamplingParams
from batchpilot_runtime.scheduling.admission import CheckedRequest, RequestLimits, rejected
from batchpilot_runtime.scheduling.types import (
    QueueFullError,
    RequestRejected,
    RequestTimings,
    SchedRequest,
    StepStats,
)

__all__ = [
    "FINISH_TO_OUTCOME",
    "AcceptedRequest",
    "EngineLoad",
    "EngineObserver",
    "EngineStoppedError",
    "GenerationRequest",
    "InvalidWindowError",
    "QueueFullError",
    "RequestRejected",
    "StaleGenerationError",
    "TokenEvent",
    "check_request",
]

_SAMPLING_FIELDS = ("temperature", "top_p", "seed")

FINISH_TO_OUTCOME = {"length": "completed", "stop": "completed", "cancelled": "cancelled", "error": "error"}


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
    retry_after_s: float = 1.0  # how long a request refused for a full queue should wait


class EngineObserver(Protocol):
    """Implemented by the server's metrics layer; every call comes from the engine thread.

    ``on_admitted`` (a request's first admission: its queue wait) and ``on_first_token`` (its TTFT)
    come when they happen, once per request (a resume after a preemption is neither), as vLLM
    observes its TTFT; a request that ends before either simply never reports it."""

    def on_step(self, stats: StepStats, step_seconds: float, forward_seconds: float) -> None: ...

    def on_admitted(self, lane: str, queue_wait_s: float) -> None: ...

    def on_first_token(self, lane: str, ttft_s: float) -> None: ...

    def on_request_finished(self, timings: RequestTimings, outcome: str) -> None: ...

    def on_tokens(self, lane: str, inter_token_gaps_s: Sequence[float]) -> None: ...

    def on_window(self, state: WindowState) -> None: ...


@dataclass(frozen=True)
class AcceptedRequest:
    """A request that passed ``check_request``: what the scheduler queues, and how to sample it."""

    request: CheckedRequest
    params: SamplingParams


def check_request(
    request: GenerationRequest, limits: RequestLimits, vocab_size: int, arrival_s: float
) -> AcceptedRequest:
    """``RequestRejected`` naming the field when the request can never be served; else the request
    as the scheduler takes it, arriving at ``arrival_s``."""
    checked = limits.check(
        SchedRequest(
            request_id=request.request_id,
            prompt_token_ids=tuple(request.prompt_token_ids),
            max_new_tokens=request.max_tokens,
            arrival_s=arrival_s,
            lane=request.lane,
            stop_token_ids=frozenset(request.stop_token_ids),
        ),
        new_tokens_field="max_tokens",
    )
    for token in checked.prompt_token_ids:
        if not 0 <= token < vocab_size:
            raise rejected("prompt_token_ids", f"token {token} is outside the vocabulary [0, {vocab_size})")
    try:
        params = SamplingParams(temperature=request.temperature, top_p=request.top_p, seed=request.seed)
    except (TypeError, ValueError) as error:
        # SamplingParams' messages start with the field they are about.
        field_name = str(error).split(":", 1)[0]
        if field_name not in _SAMPLING_FIELDS:
            raise rejected("sampling", str(error)) from None
        raise RequestRejected(str(error), field_name) from None
    return AcceptedRequest(checked, params)
