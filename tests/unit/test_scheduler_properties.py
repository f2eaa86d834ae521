"""Invariants of the window scheduler under random workloads, driven with a fake clock.

One driver replays a random workload (arrivals in two lanes, random windows, KV sizes, prefill
budgets, window changes between and inside steps, aborts) against the scheduler, checks the
per-step invariants as it goes and the end-of-run ones when every request has ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot_runtime.contract.admin_api import LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import StepComposition
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import (
    QueueFullError,
    RequestOutput,
    RequestRejected,
    SchedRequest,
    SchedulerConfig,
    StepPlan,
)
from tests.support.factories import make_window
from tests.support.scheduler_factories import sampled_for

STEP_S = 0.005
LANE = "critical"


@dataclass(frozen=True)
class Arrival:
    gap_s: float
    prompt_tokens: int
    max_new: int
    critical: bool
    stop_at: int | None  # the sampled position that is a stop token, if any


@dataclass(frozen=True)
class WindowChange:
    at_step: int
    target: int
    cap: int
    wait_ms: int
    inside_step: bool  # staged between schedule() and update_from_output()


@dataclass(frozen=True)
class Abort:
    at_step: int
    request: int
    inside_step: bool


@dataclass(frozen=True)
class Workload:
    batching: str
    block_size: int
    num_blocks: int
    budget: int | None
    max_queue: int
    target: int
    cap: int
    wait_ms: int
    ratio: float
    tail_min_samples: int
    watermark: float
    skip_ahead: int
    lane: tuple[int, int, int, int] | None  # target, cap, wait_ms, reserved
    arrivals: tuple[Arrival, ...]
    changes: tuple[WindowChange, ...]
    aborts: tuple[Abort, ...]


@st.composite
def workloads(draw: st.DrawFn, batching: str | None = None, with_lane: bool | None = None) -> Workload:
    cap = draw(st.integers(1, 8))
    target = draw(st.integers(1, cap))
    lane = None
    if (draw(st.booleans()) if with_lane is None else with_lane) and cap >= 2:
        lane_cap = draw(st.integers(1, 3))
        lane = (draw(st.integers(1, lane_cap)), lane_cap, draw(st.integers(0, 20)), draw(st.integers(0, cap - 1)))
    reserved = lane[3] if lane else 0
    arrivals = draw(
        st.lists(
            st.builds(
                Arrival,
                gap_s=st.sampled_from([0.0, 0.0, 0.001, 0.004, 0.02, 0.1]),
                prompt_tokens=st.integers(1, 12),
                max_new=st.integers(1, 16),
                critical=st.booleans() if lane else st.just(False),
                stop_at=st.none() | st.integers(1, 10),
            ),
            min_size=1,
            max_size=30,
        )
    )
    changes = draw(
        st.lists(
            st.builds(
                WindowChange,
                at_step=st.integers(0, 60),
                target=st.integers(1, 8),
                cap=st.integers(reserved + 1, 8),
                wait_ms=st.integers(0, 50),
                inside_step=st.booleans(),
            ),
            max_size=3,
        )
    )
    aborts = draw(
        st.lists(
            st.builds(Abort, at_step=st.integers(0, 60), request=st.integers(0, 29), inside_step=st.booleans()),
            max_size=3,
        )
    )
    return Workload(
        batching=draw(st.sampled_from(["continuous", "static"])) if batching is None else batching,
        block_size=draw(st.sampled_from([1, 2, 4])),
        num_blocks=draw(st.integers(4, 40)),
        budget=draw(st.none() | st.integers(1, 16)),
        max_queue=draw(st.integers(4, 40)),
        target=target,
        cap=cap,
        wait_ms=draw(st.integers(0, 50)),
        ratio=draw(st.sampled_from([1.5, 2.0, 4.0])),
        tail_min_samples=draw(st.integers(1, 6)),
        watermark=draw(st.sampled_from([0.0, 0.1])),
        skip_ahead=draw(st.sampled_from([0, 2, 16])),
        lane=lane,
        arrivals=tuple(arrivals),
        changes=tuple(changes),
        aborts=tuple(aborts),
    )


@dataclass
class RunResult:
    accepted: list[str] = field(default_factory=list)
    lane_of: dict[str, str] = field(default_factory=dict)
    arrival_order: dict[str, int] = field(default_factory=dict)
    terminal: dict[str, list[RequestOutput]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    max_new: dict[str, int] = field(default_factory=dict)
    ever_running: set[str] = field(default_factory=set)
    steps: int = 0


def _clamped_window(target: int, cap: int, wait_ms: int, ratio: float, generation: int = 0) -> Window:
    """The drawn window, its target (drawn apart from the cap) lowered to the cap."""
    return make_window(target=min(target, cap), cap=cap, wait_ms=wait_ms, ratio=ratio, generation=generation)


def _check_step_invariants(scheduler: Scheduler, result: RunResult, running_before: set[str]) -> None:
    running = scheduler.running_ids()
    newly = set(running) - running_before
    window = scheduler.window
    lane_caps = {name: lane.window.hard_cap for name, lane in scheduler.lanes.items()}
    reserved = {name: lane.reserved_slots for name, lane in scheduler.lanes.items()}
    per_lane: dict[str, int] = {}
    for request_id in running:
        lane = result.lane_of[request_id]
        per_lane[lane] = per_lane.get(lane, 0) + 1
    # The running set never exceeds the cap through an admission (a lowered cap evicts nothing).
    if newly:
        assert len(running) <= window.hard_cap
        for lane in {result.lane_of[r] for r in newly}:
            if lane in lane_caps:
                assert per_lane.get(lane, 0) <= lane_caps[lane]
        if any(result.lane_of[r] == "default" for r in newly):
            held = sum(max(0, min(reserved[n], lane_caps[n]) - per_lane.get(n, 0)) for n in lane_caps)
            assert len(running) + held <= window.hard_cap
    # The running set never exceeds the KV budget: tables cover the step's tokens and never share a block.
    kv = scheduler.kv
    seen_blocks: set[int] = set()
    for request_id in running:
        table = kv.block_table(request_id)
        assert not seen_blocks & set(table)
        seen_blocks |= set(table)
    assert len(seen_blocks) == kv.num_blocks - kv.num_free_blocks <= kv.num_blocks


def _make_scheduler(w: Workload) -> Scheduler:
    config = SchedulerConfig(
        num_kv_blocks=w.num_blocks,
        kv_block_size=w.block_size,
        max_model_len=64,
        max_prefill_tokens_per_step=w.budget,
        max_queue=w.max_queue,
        batching=w.batching,  # type: ignore[arg-type]
        wait_p50_samples=8,
        tail_min_samples=w.tail_min_samples,
        kv_watermark_fraction=w.watermark,
        skip_ahead=w.skip_ahead,
    )
    lanes = None
    if w.lane is not None:
        lane_target, lane_cap, lane_wait_ms, reserved = w.lane
        lanes = {
            LANE: LaneWindow(
                name=LANE, window=_clamped_window(lane_target, lane_cap, lane_wait_ms, w.ratio), reserved_slots=reserved
            )
        }
    return Scheduler(config, _clamped_window(w.target, w.cap, w.wait_ms, w.ratio), lanes)


class _Replay:
    """One workload replayed on a fake clock: the scheduler, the arrivals, and what was seen so far."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.scheduler = _make_scheduler(w)
        self.result = RunResult()
        self.arrivals: list[tuple[float, int, Arrival]] = []
        t = 0.0
        for index, arrival in enumerate(w.arrivals):
            t += arrival.gap_s
            self.arrivals.append((t, index, arrival))
        self.ids_by_index: dict[int, str] = {}
        self.generation = 0
        self.now_s = 0.0
        self.next_arrival = 0
        self.empty_due_plans = 0

    @property
    def done(self) -> bool:
        return self.next_arrival >= len(self.arrivals) and not self.scheduler.has_unfinished

    def end(self, output: RequestOutput | None) -> None:
        if output is not None:
            self.result.terminal.setdefault(output.request_id, []).append(output)

    def abort_due(self, inside_step: bool) -> None:
        for abort in self.w.aborts:
            if (
                abort.at_step == self.result.steps
                and abort.inside_step == inside_step
                and abort.request in self.ids_by_index
            ):
                self.end(self.scheduler.abort(self.ids_by_index[abort.request], self.now_s))

    def change_due(self, inside_step: bool) -> Window | None:
        staged = None
        for change in self.w.changes:
            if change.at_step == self.result.steps and change.inside_step == inside_step:
                self.generation += 1
                staged = _clamped_window(change.target, change.cap, change.wait_ms, self.w.ratio, self.generation)
                self.scheduler.set_window(staged)
        return staged

    def arrive(self) -> None:
        """Add the arrivals due by now, in arrival order."""
        result = self.result
        while self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival][0] <= self.now_s:
            arrival_s, index, arrival = self.arrivals[self.next_arrival]
            self.next_arrival += 1
            request_id = f"{'c' if arrival.critical else 'd'}{index}"
            stop = (
                frozenset() if arrival.stop_at is None else frozenset({1000 + arrival.prompt_tokens + arrival.stop_at})
            )
            request = SchedRequest(
                request_id,
                tuple(range(arrival.prompt_tokens)),
                arrival.max_new,
                arrival_s,
                LANE if arrival.critical else "default",
                stop,
            )
            try:
                self.scheduler.add_request(request)
            except (QueueFullError, RequestRejected):
                continue
            self.ids_by_index[index] = request_id
            result.accepted.append(request_id)
            result.lane_of[request_id] = request.lane
            result.arrival_order[request_id] = index
            result.max_new[request_id] = arrival.max_new

    def step(self) -> StepPlan:
        """One step, checked; a window staged inside it must not apply before the next schedule()."""
        scheduler, result = self.scheduler, self.result
        self.abort_due(inside_step=False)
        self.change_due(inside_step=False)
        staged_before = scheduler.staged_window
        running_before = set(scheduler.running_ids())
        batch_in_progress = bool(running_before) or bool(result.ever_running - running_before - set(result.terminal))
        plan = scheduler.schedule(self.now_s)
        if staged_before is not None:
            assert scheduler.window == staged_before
        assert plan.stats.window_generation == scheduler.window.generation
        # The step's KV term, as the cost model charges it (and serve --step-log writes it).
        assert plan.stats.kv_tokens == StepComposition.from_seqs(plan.seqs).kv_tokens
        _check_step_invariants(scheduler, result, running_before)
        newly_running = set(scheduler.running_ids()) - running_before
        if self.w.batching == "static" and batch_in_progress:
            # Static mode never admits into a running batch: only its own preempted members come back.
            assert plan.stats.admitted_requests == 0
            assert newly_running <= result.ever_running
        assert plan.stats.admitted_requests == len(newly_running - result.ever_running)
        # Nothing is admitted past a tail-marked request that still waits (of its lane).
        for admitted in newly_running - result.ever_running:
            lane = result.lane_of[admitted]
            older_marked = [
                m for m in scheduler.marked_ids(lane) if result.arrival_order[m] < result.arrival_order[admitted]
            ]
            assert not older_marked, f"{admitted} passed tail-marked {older_marked}"
        result.ever_running |= newly_running
        window_in_step = scheduler.window
        staged_inside = self.change_due(inside_step=True)
        self.abort_due(inside_step=True)
        outputs = scheduler.update_from_output(plan, sampled_for(plan), self.now_s)
        assert scheduler.window == window_in_step
        for output in outputs:
            if output.token_id is not None:
                result.tokens[output.request_id] = result.tokens.get(output.request_id, 0) + 1
            if output.finish_reason is not None:
                self.end(output)
        result.steps += 1
        if staged_inside is not None:
            # applied at the very next schedule, whatever else happens
            assert scheduler.staged_window == staged_inside
        return plan

    def advance_clock(self, plan: StepPlan) -> None:
        """A step costs STEP_S; an idle scheduler sleeps to its next event."""
        if not plan.is_empty:
            self.now_s += STEP_S
            self.empty_due_plans = 0
            return
        candidates = []
        deadline_s = self.scheduler.next_deadline_s()
        if deadline_s is not None:
            if deadline_s <= self.now_s:
                self.empty_due_plans += 1
                assert self.empty_due_plans <= 2, "a due deadline produced no work twice in a row"
                return
            candidates.append(deadline_s)
        if self.next_arrival < len(self.arrivals):
            candidates.append(self.arrivals[self.next_arrival][0])
        assert candidates or not self.scheduler.has_unfinished, "requests wait but nothing will ever admit them"
        if candidates:
            self.now_s = max(self.now_s, min(candidates))


def run_workload(w: Workload) -> tuple[Scheduler, RunResult]:
    replay = _Replay(w)
    step_bound = 10 * sum(a.prompt_tokens + a.max_new for a in w.arrivals) + 200
    while not replay.done:
        assert replay.result.steps < step_bound, "a request was not served in bounded time"
        replay.arrive()
        replay.advance_clock(replay.step())
    return replay.scheduler, replay.result


def _check_end_invariants(scheduler: Scheduler, result: RunResult, strict_fcfs: bool = True) -> None:
    # Every accepted request ended exactly once, and nothing is left behind.
    assert sorted(result.terminal) == sorted(result.accepted)
    assert all(len(outputs) == 1 for outputs in result.terminal.values())
    assert not scheduler.has_unfinished
    assert (scheduler.num_waiting, scheduler.num_running, scheduler.kv_usage_ratio) == (0, 0, 0.0)
    for request_id, (output,) in result.terminal.items():
        timings = output.timings
        assert timings is not None
        produced = result.tokens.get(request_id, 0)
        assert timings.output_tokens == produced <= result.max_new[request_id]
        if output.finish_reason == "length":
            assert produced == result.max_new[request_id]
    # Within a lane, first admissions follow arrival order, except for tail-marked requests (and for
    # requests admitted past a front that did not fit the KV cache, when skip-ahead is on).
    if not strict_fcfs:
        return
    for lane in set(result.lane_of.values()):
        in_lane = sorted((r for r in result.accepted if result.lane_of[r] == lane), key=result.arrival_order.get)
        admitted = [
            (result.terminal[r][0].timings.first_admitted_s, result.terminal[r][0].timings.tail_marked)  # type: ignore[union-attr]
            for r in in_lane
        ]
        latest_s = float("-inf")
        for first_admitted_s, tail_marked in admitted:
            if first_admitted_s is None:
                continue  # cancelled while waiting
            if not tail_marked:
                assert first_admitted_s >= latest_s, f"lane {lane}: admitted ahead of an earlier arrival"
            latest_s = max(latest_s, first_admitted_s)


@settings(max_examples=200, deadline=None)
@given(workloads(batching="continuous"))
def test_continuous_mode_invariants_hold_and_every_request_ends_once(w: Workload) -> None:
    scheduler, result = run_workload(w)
    _check_end_invariants(scheduler, result, strict_fcfs=w.skip_ahead == 0)


@settings(max_examples=100, deadline=None)
@given(workloads(batching="static"))
def test_static_mode_never_admits_into_a_running_batch(w: Workload) -> None:
    scheduler, result = run_workload(w)
    _check_end_invariants(scheduler, result, strict_fcfs=w.skip_ahead == 0)


@settings(max_examples=80, deadline=None)
@given(workloads(with_lane=True))
def test_lanes_and_reserved_slots_hold_under_load(w: Workload) -> None:
    scheduler, result = run_workload(w)
    _check_end_invariants(scheduler, result, strict_fcfs=w.skip_ahead == 0)
