"""What a request must satisfy to be queued, and how long a refused caller should wait.

``RequestLimits.check`` is the one check of a request's own fields against the scheduler's fixed
configuration; it turns a ``SchedRequest`` into the ``CheckedRequest`` that ``Scheduler.enqueue``
trusts. It depends on nothing that changes, so a caller on another thread may run it at its
boundary (the engine does, to refuse at once) and hand the result over.

``check_queueable`` is the one check of a request against a queue's state (its id in use, its lane
not open, the queue full), whoever holds that state.

``AdmissionRate`` is the one estimate of Retry-After: the time for a full queue to drain by a tenth
at the recent admission rate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NewType

from batchpilot_runtime.scheduling.kv_blocks import blocks_for_tokens
from batchpilot_runtime.scheduling.types import QueueFullError, RequestRejected, SchedRequest, SchedulerConfig

RETRY_AFTER_MIN_S = 0.1
RETRY_AFTER_MAX_S = 60.0
_ADMISSION_RATE_SAMPLES = 256

# A request whose fields passed ``RequestLimits.check``: what the scheduler queues without checking again.
CheckedRequest = NewType("CheckedRequest", SchedRequest)


def rejected(field_name: str, message: str) -> RequestRejected:
    return RequestRejected(f"{field_name}: {message}", field_name)


@dataclass(frozen=True)
class RequestLimits:
    """The bounds every request must fit: the sequence length and the KV cache (both fixed)."""

    max_model_len: int
    kv_block_size: int
    num_kv_blocks: int

    @classmethod
    def of(cls, config: SchedulerConfig) -> RequestLimits:
        return cls(config.max_model_len, config.kv_block_size, config.num_kv_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.kv_block_size

    def check(self, request: SchedRequest, new_tokens_field: str = "max_new_tokens") -> CheckedRequest:
        """``request`` as a ``CheckedRequest``; ``RequestRejected`` naming the field when it can never be
        served. ``new_tokens_field`` is the name the caller's own request gives ``max_new_tokens``."""
        if not request.request_id:
            raise rejected("request_id", "must not be empty")
        prompt_tokens = len(request.prompt_token_ids)
        max_new_tokens = request.max_new_tokens
        max_model_len = self.max_model_len
        if prompt_tokens == 0:
            raise rejected("prompt_token_ids", "must not be empty")
        if max_new_tokens < 1:
            raise rejected(new_tokens_field, f"must be at least 1, got {max_new_tokens}")
        if prompt_tokens >= max_model_len:
            raise rejected(
                "prompt_token_ids",
                f"the prompt has {prompt_tokens} tokens; max_model_len {max_model_len} leaves no room to generate",
            )
        if prompt_tokens + max_new_tokens > max_model_len:
            raise rejected(
                new_tokens_field,
                f"{max_new_tokens} new tokens after a {prompt_tokens}-token prompt exceed max_model_len {max_model_len}",
            )
        # The last sampled token is never fed back, so it needs no KV slot.
        if blocks_for_tokens(prompt_tokens + max_new_tokens - 1, self.kv_block_size) > self.num_kv_blocks:
            field_name = "prompt_token_ids" if prompt_tokens > self.capacity_tokens else new_tokens_field
            raise rejected(
                field_name,
                f"a {prompt_tokens}-token prompt with {max_new_tokens} new tokens does not fit "
                f"the KV cache ({self.capacity_tokens} tokens)",
            )
        return CheckedRequest(request)


class AdmissionRate:
    """The times of the last admissions, and from them the Retry-After of a refused request."""

    __slots__ = ("_times_s",)

    def __init__(self, samples: int = _ADMISSION_RATE_SAMPLES) -> None:
        self._times_s: deque[float] = deque(maxlen=samples)

    def record(self, now_s: float) -> None:
        self._times_s.append(now_s)

    def retry_after_s(self, max_queue: int, max_wait_ms: float) -> float:
        """Time for a full queue of ``max_queue`` to drain by a tenth at the recent admission rate
        (with no rate yet, 1 s or the window's ``max_wait_ms`` if longer), within [0.1 s, 60 s]."""
        times = self._times_s
        if len(times) >= 2 and times[-1] > times[0]:
            rate_per_s = (len(times) - 1) / (times[-1] - times[0])
            estimate_s = max(1, max_queue // 10) / rate_per_s
        else:
            estimate_s = max(1.0, max_wait_ms / 1000.0)
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, estimate_s))


def admission_reason(at_cap: bool, target_hit: bool, tail_hit: bool) -> str:
    """The strongest condition that held for an admitted group (else the wait rule admitted it)."""
    if at_cap:
        return "cap"
    if target_hit:
        return "target"
    return "tail" if tail_hit else "wait"


def check_queueable(
    request_id: str,
    id_in_use: bool,
    lane: str,
    lane_open: bool,
    open_lanes: Callable[[], Iterable[str]],
    waiting: int,
    max_queue: int,
    retry_after_s: Callable[[], float],
) -> None:
    """The refusals at a queue's door, in this order: ``RequestRejected`` naming ``request_id`` when the id
    is in use, naming ``lane`` (with the ``open_lanes``) when the lane is not open, and ``QueueFullError``
    (with ``retry_after_s``) when ``waiting`` has reached ``max_queue``. The scheduler, the gate and the
    engine's caller-side check each apply it to the state they hold."""
    if id_in_use:
        raise rejected("request_id", f"{request_id!r} is already queued or running")
    if not lane_open:
        raise rejected("lane", f"unknown lane {lane!r} (known: {', '.join(open_lanes())})")
    if waiting >= max_queue:
        delay_s = retry_after_s()
        raise QueueFullError(f"the waiting queue is full ({max_queue} requests); retry in {delay_s:.1f} s", delay_s)
