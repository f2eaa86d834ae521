"""The window scheduler: who runs in the next step, and how many tokens each feeds.

Pure, synchronous and clock-injected (no torch, no I/O, ``now_s`` passed in), so that the engine
and the discrete-event simulator run this very code. One step is::

    plan = scheduler.schedule(now_s)                  # decide; KV blocks allocated here
    sampled = run_forward_and_sample(plan.seqs)       # the caller's part
    outputs = scheduler.update_from_output(plan, sampled, now_s)

Exactly one ``update_from_output`` per plan, before the next ``schedule``.

Lanes and slots
    Every request waits in one lane. The lane ``DEFAULT_LANE`` uses the main ``window``; named lanes
    (``LaneWindow``) have their own window and ``reserved_slots``. The main window's ``hardCap`` is
    the pod's global cap G on running sequences, whatever their lane. Let R be all running
    sequences, r_L those of lane L, and held = sum over named lanes M of max(0, min(reserved_M,
    cap_M) - r_M) the reserved slots nobody uses yet. The default lane may start at most
    G - R - held more sequences; a named lane L at most min(cap_L - r_L, G - R - held + its own
    unused reservation). So reserved slots are part of G and only their lane can fill them. The
    reservations together must leave the default lane at least one slot (sum < G), else
    ``set_window``/``__init__`` raise ``ValueError`` naming ``lanes``.

Admission (continuous mode), once per lane per step, lanes holding a tail-marked request first
(oldest mark first), then named lanes in their order, then ``default``
    Requests preempted earlier are resumed first, at the front of their lane, as soon as a slot and
    KV allow; a resume is not a new admission (not counted in ``admissions``) and fresh requests of
    that lane wait behind it. Then a group of fresh requests is admitted when one trigger holds:

    - target: running + waiting >= targetBatchSize, where "running" is R for the default lane and
      r_L for a named lane. When the running set is already at or above the target this holds for
      any waiting request, so new arrivals join the running batch at the next step boundary, up to
      the cap: continuous batching never idles slots it may fill;
    - tail: a tail-marked request is waiting in the lane;
    - wait: the oldest waiting request arrived at least maxWaitMs ago (``now >= arrival + wait``).

    The group takes requests from the front of the lane (tail-marked first, then FCFS) while a slot
    is free, at least one token of the step's prompt budget is left (each admitted request gets its
    first chunk at once, as in vLLM; a request admitted without one would hold a slot and its KV
    while counted as running), and the request's whole prompt (prompt + generated tokens, for a recompute) fits in the
    free KV blocks. When the front request does not fit, a request among the next ``skip_ahead``
    that does fit may be admitted past it (a short prompt need not wait behind a long one for KV
    that it does not need), but nothing passes a tail-marked request: the group stops there, so
    that freed blocks go to it. Tail marking thereby bounds how long a skipped request waits: once
    it has waited ``tailMarkRatio`` x the lane's P50 wait it is marked, and from then on it only
    waits for running sequences to free its blocks. While other
    sequences run, a watermark of ``kv_watermark_fraction`` x blocks stays free for their decode
    growth; with nothing running the watermark is waived so that any accepted request can start.
    Each admitted group is counted once, by the strongest condition that holds: "cap" (the group
    brought the lane's running set to its cap, or R to G), else "target" (the target trigger held),
    else "tail", else "wait". Hence the batch-hit ratio is (cap + target) / all groups. No request
    is admitted or resumed in a step that preempted, so freed blocks go to the running sequences.

Static mode
    Groups are formed by the same triggers, but only when no sequence runs (in any lane) and no
    preempted one waits: a batch runs to completion before the next is admitted (preempted members
    of the running batch are resumed; nothing new joins).

Tail marking
    A lane's rolling P50 is taken over the queue waits (arrival to first admission) of its last
    ``wait_p50_samples`` admitted requests. Once the lane has ``tail_min_samples`` samples (before
    that nothing is marked), a waiting request with ``now >= arrival + tailMarkRatio x max(P50,
    1 ms)`` is marked (once; counted in ``StepStats.tail_marked``). A marked request triggers its
    lane's admission at once, is taken first in its lane, and puts its lane ahead of the others
    (lanes compete for unreserved slots and KV). Marking scans from the front, and fresh requests
    queue in arrival order, so the marked ones are always a lane's oldest: order inside a lane stays
    FCFS. The 1 ms floor keeps a near-zero P50 from marking everyone. Marking is checked at the start
    of ``schedule``, before admission, with the samples of earlier steps.

Chunked prefill
    The main window's ``maxPrefillTokens`` (or, when the window leaves it unset,
    ``max_prefill_tokens_per_step``, the pod's start-up budget) bounds the prompt (and recompute)
    tokens of one step; decodes do not count against it; lane windows' budgets are not used (the
    budget is the step's, shared by every lane). A new window's budget applies from the next step.
    A *step budget rule* (``set_step_budget_rule``), when set, lowers a step's budget further to
    what it returns for that step's decodes: (number of decoding sequences, their KV tokens) ->
    prompt tokens. The simulator uses it to compare a budget derived per step from an inter-token
    target with the window's fixed one. Order: (1) every decoding sequence feeds its last sampled token,
    (2) running sequences with prompt tokens left, oldest admitted first, (3) new admissions, with
    what budget is left. A sequence whose chunk does not end its prompt gets ``sample=False``.
    The whole prompt's KV blocks are allocated at admission, so chunks never run out of KV.

Preemption
    When a decoding sequence needs a block and none is free, the youngest running sequence (latest
    admitted, possibly the one asking) is preempted: its blocks are freed, it goes to the front of
    its lane's resume queue with its generated tokens, and when resumed it prefills prompt +
    generated tokens (recompute) and then samples its next token. Decodes are served oldest first,
    so the oldest sequence always progresses and every accepted request finishes. A request that
    could never fit is refused by ``add_request`` (``RequestRejected`` naming the field): prompt +
    max_new_tokens > max_model_len, or prompt + max_new_tokens - 1 tokens (the last sampled token is
    never fed back) > KV capacity.

Windows
    ``set_window`` validates and stages; the staged window (and lanes, unless ``None``) takes effect
    atomically at the start of the next ``schedule``. A cap below the running count evicts nothing:
    admissions wait until the running set drops below it. A lane missing from new ``lanes`` is
    retired: no new requests, its reservation is released, its queued and running requests finish
    under its last window.

Complexity: ``schedule`` and ``update_from_output`` are O(running + admitted + lanes) per step with
small constants (deques, an insertion-ordered dict for the running set, block tables kept as tuples).
"""

from __future__ import annotations

import bisect
import enum
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.scheduling.kv_blocks import KVBlockManager, blocks_for_tokens

ADMISSION_REASONS = ("target", "wait", "tail", "cap")
FINISH_REASONS = ("length", "stop", "cancelled", "error")
# Below this P50 a tail threshold would mark nearly every request that waits at all.
TAIL_P50_FLOOR_S = 0.001
RETRY_AFTER_MIN_S = 0.1
RETRY_AFTER_MAX_S = 60.0
_ADMISSION_RATE_SAMPLES = 256


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


def _rejected(field_name: str, message: str) -> RequestRejected:
    return RequestRejected(f"{field_name}: {message}", field_name)


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


class _RollingMedian:
    """Median of the last ``capacity`` values: a deque for age order, a sorted list for rank."""

    __slots__ = ("_by_age", "_capacity", "_sorted")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._by_age: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._by_age)

    def add(self, value: float) -> None:
        if len(self._by_age) == self._capacity:
            oldest = self._by_age.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._by_age.append(value)
        bisect.insort(self._sorted, value)

    def median(self) -> float:
        return self._sorted[(len(self._sorted) - 1) // 2]


class _Lane:
    """One lane's window and queues. ``waiting`` holds unmarked fresh requests in FCFS order,
    ``marked`` the tail-marked ones in marking order, ``resume`` preempted ones (front first)."""

    __slots__ = (
        "is_default",
        "marked",
        "name",
        "reserved_slots",
        "resume",
        "retired",
        "running",
        "waiting",
        "waits",
        "window",
    )

    def __init__(self, name: str, window: Window, reserved_slots: int, wait_samples: int) -> None:
        self.name = name
        self.is_default = name == DEFAULT_LANE
        self.window = window
        self.reserved_slots = reserved_slots
        self.retired = False
        self.waiting: deque[_Seq] = deque()
        self.marked: deque[_Seq] = deque()
        self.resume: deque[_Seq] = deque()
        self.running = 0
        self.waits = _RollingMedian(wait_samples)

    @property
    def effective_reservation(self) -> int:
        return 0 if self.retired or self.is_default else min(self.reserved_slots, self.window.hard_cap)

    @property
    def num_fresh(self) -> int:
        return len(self.waiting) + len(self.marked)

    @property
    def is_empty(self) -> bool:
        return self.running == 0 and not self.waiting and not self.marked and not self.resume

    def oldest_fresh(self) -> _Seq | None:
        if self.marked:
            return self.marked[0]
        return self.waiting[0] if self.waiting else None


class _Seq:
    """Mutable state of one request; token lists change only through ``update_from_output``."""

    __slots__ = (
        "arrival_s",
        "first_admitted_s",
        "first_token_s",
        "lane",
        "max_new_tokens",
        "num_computed",
        "num_tokens",
        "outputs",
        "preemptions",
        "prompt",
        "request_id",
        "status",
        "stop_token_ids",
        "tail_marked",
    )

    def __init__(self, request: SchedRequest, lane: _Lane) -> None:
        self.request_id = request.request_id
        self.prompt = request.prompt_token_ids
        self.max_new_tokens = request.max_new_tokens
        self.stop_token_ids = request.stop_token_ids
        self.arrival_s = request.arrival_s
        self.lane = lane
        self.outputs: list[int] = []
        self.num_computed = 0  # tokens whose KV is written
        self.num_tokens = len(self.prompt)  # prompt + outputs, kept in step with ``outputs``
        self.status = SeqStatus.WAITING
        self.tail_marked = False
        self.first_admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.preemptions = 0

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        prompt_len = len(self.prompt)
        if stop <= prompt_len:
            return self.prompt[start:stop]
        if start >= prompt_len:
            return tuple(self.outputs[start - prompt_len : stop - prompt_len])
        return self.prompt[start:] + tuple(self.outputs[: stop - prompt_len])


@dataclass
class _StepAccumulator:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    admissions: dict[str, int] = field(default_factory=dict)
    admitted_requests: int = 0
    num_prefill_seqs: int = 0
    num_prefill_tokens: int = 0


def _validate_lanes(window: Window, lanes: Mapping[str, LaneWindow]) -> dict[str, LaneWindow]:
    for name, lane in lanes.items():
        if name == DEFAULT_LANE:
            raise ValueError(f"lanes: {DEFAULT_LANE!r} is the main window's lane and cannot be redefined")
        if not name:
            raise ValueError("lanes: a lane name must not be empty")
        if lane.name != name:
            raise ValueError(f"lanes: key {name!r} differs from the lane's name {lane.name!r}")
    reserved = sum(min(lane.reserved_slots, lane.window.hard_cap) for lane in lanes.values())
    if lanes and reserved >= window.hard_cap:
        raise ValueError(
            f"lanes: reservedSlots add up to {reserved}, which leaves none of hardCap {window.hard_cap} "
            "to the default lane"
        )
    return dict(lanes)


class Scheduler:
    """Owns every request's state and the KV block tables; see the module docstring for the rules."""

    def __init__(self, config: SchedulerConfig, window: Window, lanes: Mapping[str, LaneWindow] | None = None) -> None:
        self.config = config
        self._kv = KVBlockManager(config.num_kv_blocks, config.kv_block_size)
        self._static = config.batching == "static"
        self._watermark_blocks = config.watermark_blocks
        self._window = window
        self._budget_tokens = self._step_budget(window)
        self._lane_windows = _validate_lanes(window, lanes or {})
        self._lanes: dict[str, _Lane] = {}
        self._rebuild_lanes(self._lane_windows)
        self._staged: tuple[Window, dict[str, LaneWindow] | None] | None = None
        self._seqs: dict[str, _Seq] = {}  # every unfinished request
        self._running: dict[str, _Seq] = {}  # insertion order = admission order: last is the youngest
        self._num_waiting = 0
        self._admit_times_s: deque[float] = deque(maxlen=_ADMISSION_RATE_SAMPLES)
        self._last_now_s = -math.inf
        self._step_budget_rule: Callable[[int, int], float] | None = None

    # ----------------------------------------------------------------- read-only state

    @property
    def window(self) -> Window:
        """The main window in force (a staged one shows here only after the next ``schedule``)."""
        return self._window

    @property
    def lanes(self) -> Mapping[str, LaneWindow]:
        return dict(self._lane_windows)

    @property
    def staged_window(self) -> Window | None:
        return None if self._staged is None else self._staged[0]

    @property
    def num_waiting(self) -> int:
        """Requests waiting in every lane, preempted ones included (the queue depth)."""
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def kv_usage_ratio(self) -> float:
        return self._kv.usage_ratio

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def capacity_tokens(self) -> int:
        return self._kv.capacity_tokens

    @property
    def kv(self) -> KVBlockManager:
        return self._kv

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seqs

    def status_of(self, request_id: str) -> SeqStatus:
        """WAITING or RUNNING for an unfinished request, FINISHED for one this scheduler no longer holds."""
        seq = self._seqs.get(request_id)
        return SeqStatus.FINISHED if seq is None else seq.status

    def wait_p50_s(self, lane: str = DEFAULT_LANE) -> float | None:
        """The rolling P50 queue wait the lane's tail marking uses; ``None`` before any admission."""
        waits = self._lanes[lane].waits
        return waits.median() if len(waits) else None

    def marked_ids(self, lane: str = DEFAULT_LANE) -> tuple[str, ...]:
        """A lane's tail-marked request ids still waiting, in marking order."""
        return tuple(s.request_id for s in self._lanes[lane].marked)

    def running_ids(self) -> tuple[str, ...]:
        """Running request ids, oldest admitted first."""
        return tuple(self._running)

    def waiting_ids(self, lane: str = DEFAULT_LANE) -> tuple[str, ...]:
        """A lane's waiting request ids in admission order: preempted, tail-marked, then FCFS."""
        state = self._lanes[lane]
        return tuple(s.request_id for queue in (state.resume, state.marked, state.waiting) for s in queue)

    # ----------------------------------------------------------------- requests in and out

    def add_request(self, request: SchedRequest) -> None:
        """Queue a request; ``RequestRejected`` if it can never be served, ``QueueFullError`` if no room now."""
        if request.request_id in self._seqs:
            raise _rejected("request_id", f"{request.request_id!r} is already queued or running")
        lane = self._lanes.get(request.lane)
        if lane is None or lane.retired:
            known = ", ".join(name for name, state in self._lanes.items() if not state.retired)
            raise _rejected("lane", f"unknown lane {request.lane!r} (known: {known})")
        prompt_tokens = len(request.prompt_token_ids)
        max_model_len = self.config.max_model_len
        if prompt_tokens == 0:
            raise _rejected("prompt_token_ids", "must not be empty")
        if request.max_new_tokens < 1:
            raise _rejected("max_new_tokens", f"must be at least 1, got {request.max_new_tokens}")
        if prompt_tokens >= max_model_len:
            raise _rejected(
                "prompt_token_ids",
                f"the prompt has {prompt_tokens} tokens; max_model_len {max_model_len} leaves no room to generate",
            )
        if prompt_tokens + request.max_new_tokens > max_model_len:
            raise _rejected(
                "max_new_tokens",
                f"{request.max_new_tokens} new tokens after a {prompt_tokens}-token prompt exceed "
                f"max_model_len {max_model_len}",
            )
        if self._kv.blocks_for_tokens(prompt_tokens + request.max_new_tokens - 1) > self._kv.num_blocks:
            field_name = "prompt_token_ids" if prompt_tokens > self._kv.capacity_tokens else "max_new_tokens"
            raise _rejected(
                field_name,
                f"a {prompt_tokens}-token prompt with {request.max_new_tokens} new tokens does not fit "
                f"the KV cache ({self._kv.capacity_tokens} tokens)",
            )
        if self._num_waiting >= self.config.max_queue:
            retry_after_s = self._retry_after_s()
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_queue} requests); retry in {retry_after_s:.1f} s",
                retry_after_s,
            )
        seq = _Seq(request, lane)
        self._seqs[request.request_id] = seq
        lane.waiting.append(seq)
        self._num_waiting += 1

    def abort(self, request_id: str, now_s: float) -> RequestOutput | None:
        """Cancel a waiting or running request and free its KV; ``None`` when it is unknown or done."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "cancelled", now_s, token_id=None)

    def finish(self, request_id: str, reason: str, now_s: float) -> RequestOutput | None:
        """End a request for a reason found outside the scheduler (a stop string, an error)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason must be one of {', '.join(FINISH_REASONS)}, got {reason!r}")
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, reason, now_s, token_id=None)

    # ----------------------------------------------------------------- windows

    def set_window(self, window: Window, lanes: Mapping[str, LaneWindow] | None = None) -> None:
        """Validate and stage a window (and lanes unless ``None``); applied at the next ``schedule``.

        A later call before that ``schedule`` replaces the staged window; staged lanes stay staged
        unless it brings lanes of its own. ``ValueError`` names ``lanes`` when the lanes (new, staged,
        or in force) do not fit the window.
        """
        if lanes is not None:
            staged_lanes: dict[str, LaneWindow] | None = _validate_lanes(window, lanes)
        else:
            staged_lanes = None if self._staged is None else self._staged[1]
            _validate_lanes(window, self._lane_windows if staged_lanes is None else staged_lanes)
        self._staged = (window, staged_lanes)

    def _apply_staged(self) -> None:
        if self._staged is None:
            return
        window, lanes = self._staged
        self._staged = None
        self._window = window
        self._budget_tokens = self._step_budget(window)
        if lanes is not None:
            self._lane_windows = lanes
        self._rebuild_lanes(self._lane_windows)

    def set_step_budget_rule(self, rule: Callable[[int, int], float] | None) -> None:
        """Lower each step's prompt budget to ``rule(decoding sequences, their KV tokens)``; None: off."""
        self._step_budget_rule = rule

    def _step_budget(self, window: Window) -> float:
        budget = window.max_prefill_tokens or self.config.max_prefill_tokens_per_step
        return math.inf if budget is None else float(budget)

    @property
    def prefill_budget_tokens(self) -> int | None:
        """Prompt tokens one step may prefill now; ``None``: whole prompts."""
        return None if math.isinf(self._budget_tokens) else int(self._budget_tokens)

    def _rebuild_lanes(self, lane_windows: Mapping[str, LaneWindow]) -> None:
        old = self._lanes
        rebuilt: dict[str, _Lane] = {}
        for name, lane_window in lane_windows.items():
            state = old.get(name) or _Lane(name, lane_window.window, 0, self.config.wait_p50_samples)
            state.window = lane_window.window
            state.reserved_slots = lane_window.reserved_slots
            state.retired = False
            rebuilt[name] = state
        for name, state in old.items():
            if name not in rebuilt and name != DEFAULT_LANE and not state.is_empty:
                state.retired = True
                rebuilt[name] = state
        default = old.get(DEFAULT_LANE) or _Lane(DEFAULT_LANE, self._window, 0, self.config.wait_p50_samples)
        default.window = self._window
        rebuilt[DEFAULT_LANE] = default
        self._lanes = rebuilt

    # ----------------------------------------------------------------- the step

    def schedule(self, now_s: float) -> StepPlan:
        """Plan one step at ``now_s``: decodes, prefill chunks, admissions; allocates their KV blocks."""
        self._last_now_s = now_s
        # 1. A staged window takes effect here, before anything else of this step.
        self._apply_staged()
        acc = _StepAccumulator()
        tail_marked = self._mark_tails(now_s)
        budget = self._budget_tokens
        # 2. Every decoding sequence feeds its last token; prefilling ones wait for phase 3.
        prefilling: list[_Seq] = []
        decode_kv_tokens = 0
        running_status = SeqStatus.RUNNING
        allocate = self._kv.allocate
        add_seq = acc.seqs.append
        for seq in list(self._running.values()):
            if seq.status is not running_status:
                continue  # preempted by an older sequence earlier in this loop
            computed = seq.num_computed
            if seq.num_tokens - computed == 1 and seq.outputs:
                table = allocate(seq.request_id, computed + 1)
                if table is None:
                    table = self._grow_or_preempt(seq, computed + 1, acc)
                    if table is None:
                        continue
                add_seq(ScheduledSeq(seq.request_id, (seq.outputs[-1],), computed, table, True, False))
                decode_kv_tokens += computed + 1
            else:
                prefilling.append(seq)
        if self._step_budget_rule is not None and acc.seqs:
            budget = min(budget, max(0.0, self._step_budget_rule(len(acc.seqs), decode_kv_tokens)))
        # 3. Prompt chunks of running sequences, oldest admitted first, under the token budget.
        for seq in prefilling:
            if seq.status is SeqStatus.RUNNING and budget > 0:
                budget -= self._add_prefill_chunk(seq, budget, acc)
        # 4. Admissions (none in a step that preempted), each with its first chunk, while prompt
        #    budget is left (as vLLM does): a request admitted with no budget would hold a slot and its
        #    KV while it waits, and be counted as running rather than queued.
        if not acc.preempted:
            budget = self._admit(now_s, acc, budget)
        num_seqs = len(acc.seqs)
        stats = StepStats(
            batch_size=num_seqs,
            num_prefill_seqs=acc.num_prefill_seqs,
            num_decode_seqs=num_seqs - acc.num_prefill_seqs,
            num_prefill_tokens=acc.num_prefill_tokens,
            admissions=acc.admissions,
            admitted_requests=acc.admitted_requests,
            tail_marked=tail_marked,
            preempted=len(acc.preempted),
            queue_depth=self._num_waiting,
            running=len(self._running),
            kv_usage_ratio=self._kv.usage_ratio,
            window_generation=self._window.generation,
        )
        return StepPlan(tuple(acc.seqs), tuple(acc.preempted), stats)

    def update_from_output(self, plan: StepPlan, sampled: Mapping[str, int], now_s: float) -> list[RequestOutput]:
        """Advance each planned sequence; ``sampled`` holds a token for every seq with ``sample=True``.

        Returns one output per sampled token; the finishing one ("length" when max_new_tokens is
        reached, "stop" when the token is a stop token, the token included) carries the timings.
        Sequences aborted or finished since ``schedule`` are skipped.
        """
        outputs: list[RequestOutput] = []
        add_output = outputs.append
        get_seq = self._seqs.get
        get_token = sampled.get
        running_status = SeqStatus.RUNNING
        for planned in plan.seqs:
            request_id = planned.request_id
            seq = get_seq(request_id)
            if seq is None or seq.status is not running_status or seq.num_computed != planned.start_pos:
                continue
            seq.num_computed = planned.start_pos + len(planned.token_ids)
            if not planned.sample:
                continue
            token_id = get_token(request_id)
            if token_id is None:
                raise ValueError(f"sampled: no token for request {request_id!r}, which the plan samples")
            seq.outputs.append(token_id)
            seq.num_tokens += 1
            if seq.first_token_s is None:
                seq.first_token_s = now_s
            if token_id in seq.stop_token_ids:
                add_output(self._finish(seq, "stop", now_s, token_id))
            elif len(seq.outputs) >= seq.max_new_tokens:
                add_output(self._finish(seq, "length", now_s, token_id))
            else:
                add_output(RequestOutput(request_id, token_id, None, None))
        return outputs

    def next_deadline_s(self) -> float | None:
        """Earliest time a waiting request would be admitted with no new arrival; ``None``: none waits.

        A time in the past (the last ``schedule``'s time, or ``-inf`` while a staged window waits
        to be applied) means "call ``schedule`` now". While sequences run the engine steps anyway;
        this matters for an idle engine or a simulator.
        """
        if self._staged is not None:
            return -math.inf
        deadline_s: float | None = None
        for lane in self._lanes.values():
            candidate_s = self._lane_deadline_s(lane)
            if candidate_s is not None and (deadline_s is None or candidate_s < deadline_s):
                deadline_s = candidate_s
        return deadline_s

    # ----------------------------------------------------------------- internals

    def _lane_deadline_s(self, lane: _Lane) -> float | None:
        if lane.resume or lane.marked:
            return self._last_now_s
        oldest = lane.oldest_fresh()
        if oldest is None:
            return None
        running = len(self._running) if lane.is_default else lane.running
        if running + lane.num_fresh >= lane.window.target_batch_size:
            return self._last_now_s
        deadline_s = oldest.arrival_s + lane.window.max_wait_ms / 1000.0
        threshold_s = self._tail_threshold_s(lane)
        if threshold_s is not None:
            deadline_s = min(deadline_s, lane.waiting[0].arrival_s + threshold_s)
        return deadline_s

    def _tail_threshold_s(self, lane: _Lane) -> float | None:
        if len(lane.waits) < self.config.tail_min_samples:
            return None
        return lane.window.tail_mark_ratio * max(lane.waits.median(), TAIL_P50_FLOOR_S)

    def _mark_tails(self, now_s: float) -> int:
        marked = 0
        for lane in self._lanes.values():
            if not lane.waiting:
                continue
            threshold_s = self._tail_threshold_s(lane)
            if threshold_s is None:
                continue
            waiting = lane.waiting
            # FCFS order means the longest waits are at the front: marking stops at the first short one.
            while waiting and now_s >= waiting[0].arrival_s + threshold_s:
                seq = waiting.popleft()
                seq.tail_marked = True
                lane.marked.append(seq)
                marked += 1
        return marked

    def _grow_or_preempt(self, seq: _Seq, total_tokens: int, acc: _StepAccumulator) -> tuple[int, ...] | None:
        """Grow ``seq``'s blocks to ``total_tokens``, preempting the youngest until they fit.

        ``None`` when ``seq`` itself was the youngest and got preempted.
        """
        table = self._kv.allocate(seq.request_id, total_tokens)
        while table is None:
            victim = next(reversed(self._running.values()))
            self._preempt(victim)
            acc.preempted.append(victim.request_id)
            if victim is seq:
                return None
            table = self._kv.allocate(seq.request_id, total_tokens)
        return table

    def _preempt(self, seq: _Seq) -> None:
        self._kv.free(seq.request_id)
        del self._running[seq.request_id]
        seq.lane.running -= 1
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        seq.preemptions += 1
        seq.lane.resume.appendleft(seq)
        self._num_waiting += 1

    def _add_prefill_chunk(self, seq: _Seq, budget: float, acc: _StepAccumulator) -> int:
        start = seq.num_computed
        total = seq.num_tokens
        num_tokens = int(min(total - start, budget))
        if num_tokens <= 0:
            return 0
        stop = start + num_tokens
        acc.seqs.append(
            ScheduledSeq(
                seq.request_id,
                seq.token_slice(start, stop),
                start,
                self._kv.block_table(seq.request_id),
                stop == total,
                True,
            )
        )
        acc.num_prefill_seqs += 1
        acc.num_prefill_tokens += num_tokens
        return num_tokens

    def _fits(self, seq: _Seq) -> bool:
        needed = blocks_for_tokens(seq.num_tokens, self._kv.block_size)
        if self._running:
            needed += self._watermark_blocks
        return needed <= self._kv.num_free_blocks

    def _first_fitting_behind(self, lane: _Lane) -> _Seq | None:
        """The oldest of the ``skip_ahead`` requests behind the lane's front whose prompt fits."""
        waiting = lane.waiting
        for index in range(1, min(len(waiting), self.config.skip_ahead + 1)):
            if self._fits(waiting[index]):
                return waiting[index]
        return None

    def _slot_room(self, lane: _Lane) -> int:
        global_cap = self._window.hard_cap
        held = 0
        for other in self._lanes.values():
            held += max(0, other.effective_reservation - other.running)
        free_global = global_cap - len(self._running) - held
        if lane.is_default:
            return free_global
        own_unused = max(0, lane.effective_reservation - lane.running)
        return min(lane.window.hard_cap - lane.running, free_global + own_unused)

    def _start_running(self, seq: _Seq, now_s: float) -> None:
        # Whole prompt (+ generated tokens on a recompute) up front: chunks never run out of KV.
        if self._kv.allocate(seq.request_id, seq.num_tokens) is None:
            raise RuntimeError(f"KV accounting broke: {seq.request_id!r} passed the fit check but does not fit")
        seq.status = SeqStatus.RUNNING
        self._running[seq.request_id] = seq
        seq.lane.running += 1
        self._num_waiting -= 1

    def _admission_order(self) -> list[_Lane]:
        lanes = list(self._lanes.values())
        with_tail = sorted((lane for lane in lanes if lane.marked), key=lambda lane: lane.marked[0].arrival_s)
        return with_tail + [lane for lane in lanes if not lane.marked]

    def _admit(self, now_s: float, acc: _StepAccumulator, budget: float) -> float:
        """Resume preempted requests and admit at most one group of fresh requests per lane, each with
        its first prompt chunk, while at least one prompt token of ``budget`` is left (static batching
        admits its whole group: a batch in progress blocks later admissions). Returns the budget left."""

        def start(seq: _Seq) -> None:
            nonlocal budget
            self._start_running(seq, now_s)
            if budget > 0:
                budget -= self._add_prefill_chunk(seq, budget, acc)

        def budget_left() -> bool:
            return self._static or budget >= 1

        batch_in_progress = self._static and (bool(self._running) or any(lane.resume for lane in self._lanes.values()))
        for lane in self._admission_order():
            if not (lane.resume or lane.marked or lane.waiting):
                continue
            room = self._slot_room(lane)
            # a. Preempted requests first: they were admitted before everything still waiting.
            while lane.resume and room > 0 and budget_left() and self._fits(lane.resume[0]):
                start(lane.resume.popleft())
                room -= 1
            if lane.resume or batch_in_progress or room <= 0 or not budget_left():
                continue
            # b. The window's triggers.
            window = lane.window
            running = len(self._running) if lane.is_default else lane.running
            oldest = lane.oldest_fresh()
            if oldest is None:
                continue
            target_hit = running + lane.num_fresh >= window.target_batch_size
            tail_hit = bool(lane.marked)
            wait_hit = now_s >= oldest.arrival_s + window.max_wait_ms / 1000.0
            if not (target_hit or tail_hit or wait_hit):
                continue
            # c. The group: front of the lane while a slot is free and the prompt fits; past an unmarked
            #    front that does not fit, one of the next ``skip_ahead`` that does.
            group = 0
            while room > 0 and budget_left():
                seq_or_none = lane.oldest_fresh()
                if seq_or_none is None:
                    break
                if self._fits(seq_or_none):
                    seq = seq_or_none
                    (lane.marked if seq.tail_marked else lane.waiting).popleft()
                else:
                    passer = None if seq_or_none.tail_marked else self._first_fitting_behind(lane)
                    if passer is None:
                        break
                    seq = passer
                    lane.waiting.remove(seq)
                seq.first_admitted_s = now_s
                lane.waits.add(now_s - seq.arrival_s)
                self._admit_times_s.append(now_s)
                start(seq)
                room -= 1
                group += 1
            if group == 0:
                continue
            # d. Counted once, by the strongest condition that holds.
            lane_running = len(self._running) if lane.is_default else lane.running
            if lane_running >= window.hard_cap or len(self._running) >= self._window.hard_cap:
                reason = "cap"
            elif target_hit:
                reason = "target"
            elif tail_hit:
                reason = "tail"
            else:
                reason = "wait"
            acc.admissions[reason] = acc.admissions.get(reason, 0) + 1
            acc.admitted_requests += group
        return budget

    def _finish(self, seq: _Seq, reason: str, now_s: float, token_id: int | None) -> RequestOutput:
        lane = seq.lane
        if seq.status is SeqStatus.RUNNING:
            self._kv.free(seq.request_id)
            del self._running[seq.request_id]
            lane.running -= 1
        else:
            for queue in (lane.waiting, lane.marked, lane.resume):
                if seq in queue:
                    queue.remove(seq)
                    break
            self._num_waiting -= 1
        seq.status = SeqStatus.FINISHED
        del self._seqs[seq.request_id]
        if lane.retired and lane.is_empty:
            del self._lanes[lane.name]
        timings = RequestTimings(
            arrival_s=seq.arrival_s,
            first_admitted_s=seq.first_admitted_s,
            first_token_s=seq.first_token_s,
            finished_s=now_s,
            prompt_tokens=len(seq.prompt),
            output_tokens=len(seq.outputs),
            lane=lane.name,
            tail_marked=seq.tail_marked,
            preemptions=seq.preemptions,
        )
        return RequestOutput(seq.request_id, token_id, reason, timings)

    def _retry_after_s(self) -> float:
        """Time for the queue to drain by a tenth at the recent admission rate (1 s or the window's wait
        when there is no rate yet), within [0.1 s, 60 s]."""
        times = self._admit_times_s
        if len(times) >= 2 and times[-1] > times[0]:
            rate_per_s = (len(times) - 1) / (times[-1] - times[0])
            estimate_s = max(1, self.config.max_queue // 10) / rate_per_s
        else:
            estimate_s = max(1.0, self._window.max_wait_ms / 1000.0)
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, estimate_s))
