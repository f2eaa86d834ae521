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
(oldest mark first), then named lanes in their order, then ``default`` (the pass is
``admission_pass.admit_lanes``, which the gate shares; the KV fit and the budget are this module's)
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
    admissions wait until the running set drops below it. A staged lane takes requests at once
    (they wait for the step that applies it). A lane missing from new ``lanes`` is
    retired: no new requests, its reservation is released, its queued and running requests finish
    under its last window.

Complexity: ``schedule`` and ``update_from_output`` are O(running + admitted + lanes) per step with
small constants (deques, an insertion-ordered dict for the running set, block tables kept as tuples).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.scheduling.admission import AdmissionRate, CheckedRequest, RequestLimits, check_queueable
from batchpilot_runtime.scheduling.admission_pass import admit_lanes
from batchpilot_runtime.scheduling.kv_blocks import KVBlockManager, blocks_for_tokens
from batchpilot_runtime.scheduling.lanes import LaneTable, Seq
from batchpilot_runtime.scheduling.types import (
    FINISH_REASONS,
    RequestOutput,
    RequestTimings,
    SchedRequest,
    ScheduledSeq,
    SchedulerConfig,
    SeqStatus,
    StepPlan,
    StepStats,
)


@dataclass
class _StepAccumulator:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    admissions: dict[str, int] = field(default_factory=dict)
    admitted_requests: int = 0
    num_prefill_seqs: int = 0
    num_prefill_tokens: int = 0


class Scheduler:
    """Owns every request's state and the KV block tables; see the module docstring for the rules."""

    def __init__(self, config: SchedulerConfig, window: Window, lanes: Mapping[str, LaneWindow] | None = None) -> None:
        self.config = config
        self._kv = KVBlockManager(config.num_kv_blocks, config.kv_block_size)
        self._static = config.batching == "static"
        self._watermark_blocks = config.watermark_blocks
        self._window = window
        self._budget_tokens = self._step_budget(window)
        self.limits = RequestLimits.of(config)  # fixed: callers on any thread may check requests with it
        self._lanes = LaneTable(window, lanes or {}, config.wait_p50_samples)
        self._staged_window: Window | None = None
        self._seqs: dict[str, Seq] = {}  # every unfinished request
        self._running: dict[str, Seq] = {}  # insertion order = admission order: last is the youngest
        self._num_waiting = 0
        self._admission_rate = AdmissionRate()
        self._last_now_s = -math.inf
        self._step_budget_rule: Callable[[int, int], float] | None = None

    # ----------------------------------------------------------------- read-only state

    @property
    def window(self) -> Window:
        """The main window in force (a staged one shows here only after the next ``schedule``)."""
        return self._window

    @property
    def lanes(self) -> Mapping[str, LaneWindow]:
        """The named lanes in force (staged ones show here only after the next ``schedule``)."""
        return dict(self._lanes.windows)

    @property
    def staged_window(self) -> Window | None:
        return self._staged_window

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
        waits = self._lanes.states[lane].waits
        return waits.median() if len(waits) else None

    def marked_ids(self, lane: str = DEFAULT_LANE) -> tuple[str, ...]:
        """A lane's tail-marked request ids still waiting, in marking order."""
        return tuple(s.request_id for s in self._lanes.states[lane].marked)

    def running_ids(self) -> tuple[str, ...]:
        """Running request ids, oldest admitted first."""
        return tuple(self._running)

    def waiting_ids(self, lane: str = DEFAULT_LANE) -> tuple[str, ...]:
        """A lane's waiting request ids in admission order: preempted, tail-marked, then FCFS."""
        state = self._lanes.states[lane]
        return tuple(s.request_id for queue in (state.resume, state.marked, state.waiting) for s in queue)

    # ----------------------------------------------------------------- requests in and out

    def add_request(self, request: SchedRequest) -> None:
        """Check and queue a request; ``RequestRejected`` if it can never be served (see ``enqueue``)."""
        self.enqueue(self.limits.check(request))

    def enqueue(self, request: CheckedRequest) -> None:
        """Queue a request whose fields ``limits.check`` passed. ``RequestRejected`` when its id is in use
        or its lane is not open (in force and not retired, or staged), ``QueueFullError`` if no room now."""
        check_queueable(
            request.request_id,
            request.request_id in self._seqs,
            request.lane,
            self._lanes.is_open(request.lane),
            self._lanes.open_names,
            self._num_waiting,
            self.config.max_queue,
            self.retry_after_s,
        )
        lane = self._lanes.open_lane(request.lane)
        seq = Seq(request, lane)
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
        self._lanes.stage(window, lanes)
        self._staged_window = window

    def _apply_staged(self) -> None:
        window = self._staged_window
        if window is None:
            return
        self._staged_window = None
        self._window = window
        self._budget_tokens = self._step_budget(window)
        self._lanes.apply(window)

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

    # ----------------------------------------------------------------- the step

    def schedule(self, now_s: float) -> StepPlan:
        """Plan one step at ``now_s``: decodes, prefill chunks, admissions; allocates their KV blocks."""
        self._last_now_s = now_s
        # 1. A staged window takes effect here, before anything else of this step.
        self._apply_staged()
        acc = _StepAccumulator()
        tail_marked = self._lanes.mark_tails(now_s, self.config.tail_min_samples)
        budget = self._budget_tokens
        # 2. Every decoding sequence feeds its last token; prefilling ones wait for phase 3.
        prefilling: list[Seq] = []
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
            kv_tokens=sum(seq.start_pos + len(seq.token_ids) for seq in acc.seqs),
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
        if self._staged_window is not None:
            return -math.inf
        return self._lanes.next_deadline_s(self._last_now_s, len(self._running), self.config.tail_min_samples)

    # ----------------------------------------------------------------- internals

    def _grow_or_preempt(self, seq: Seq, total_tokens: int, acc: _StepAccumulator) -> tuple[int, ...] | None:
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

    def _preempt(self, seq: Seq) -> None:
        self._kv.free(seq.request_id)
        del self._running[seq.request_id]
        seq.lane.running -= 1
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        seq.preemptions += 1
        seq.lane.resume.appendleft(seq)
        self._num_waiting += 1

    def _add_prefill_chunk(self, seq: Seq, budget: float, acc: _StepAccumulator) -> int:
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

    def _fits(self, seq: Seq) -> bool:
        needed = blocks_for_tokens(seq.num_tokens, self._kv.block_size)
        if self._running:
            needed += self._watermark_blocks
        return needed <= self._kv.num_free_blocks

    def _start_running(self, seq: Seq, now_s: float) -> None:
        # Whole prompt (+ generated tokens on a recompute) up front: chunks never run out of KV.
        if self._kv.allocate(seq.request_id, seq.num_tokens) is None:
            raise RuntimeError(f"KV accounting broke: {seq.request_id!r} passed the fit check but does not fit")
        seq.status = SeqStatus.RUNNING
        self._running[seq.request_id] = seq
        seq.lane.running += 1
        self._num_waiting -= 1

    def _admit(self, now_s: float, acc: _StepAccumulator, budget: float) -> float:
        """Resume preempted requests and admit at most one group of fresh requests per lane, each with
        its first prompt chunk, while at least one prompt token of ``budget`` is left (static batching
        admits its whole group: a batch in progress blocks later admissions). Returns the budget left."""
        batch_in_progress = self._static and (
            bool(self._running) or any(lane.resume for lane in self._lanes.states.values())
        )
        host = _StepAdmission(self, acc, now_s, budget)
        admitted = admit_lanes(
            self._lanes,
            host,
            now_s,
            self._window.hard_cap,
            self._admission_rate,
            self.config.skip_ahead,
            batch_in_progress,
        )
        acc.admissions = admitted.admissions
        acc.admitted_requests = admitted.admitted_requests
        return host.budget

    def _finish(self, seq: Seq, reason: str, now_s: float, token_id: int | None) -> RequestOutput:
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
        self._lanes.drop_if_done(lane)
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

    def retry_after_s(self) -> float:
        """How long a request refused for a full queue should wait: the time for the queue to drain by
        a tenth at the recent admission rate (with no rate yet, 1 s or the window's wait if longer)."""
        return self._admission_rate.retry_after_s(self.config.max_queue, self._window.max_wait_ms)


class _StepAdmission:
    """The scheduler's side of one step's admission pass: a request fits when its whole prompt and
    the watermark fit the free KV blocks, and starts with its first chunk of the step's budget."""

    __slots__ = ("_acc", "_now_s", "_scheduler", "budget")

    def __init__(self, scheduler: Scheduler, acc: _StepAccumulator, now_s: float, budget: float) -> None:
        self._scheduler = scheduler
        self._acc = acc
        self._now_s = now_s
        self.budget = budget  # prompt tokens this step may still prefill

    @property
    def num_running(self) -> int:
        return self._scheduler.num_running

    def fits(self, seq: Seq) -> bool:
        return self._scheduler._fits(seq)

    def has_budget(self) -> bool:
        # Static batching admits its whole group: the batch's first step may exceed the budget.
        return self._scheduler._static or self.budget >= 1

    def start(self, seq: Seq) -> None:
        scheduler = self._scheduler
        scheduler._start_running(seq, self._now_s)
        if self.budget > 0:
            self.budget -= scheduler._add_prefill_chunk(seq, self.budget, self._acc)
