"""The admission pass shared by the scheduler and the gate, driven through a hand-made host, and the
check at the queue's door that both (and the engine) apply."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.scheduling.admission import AdmissionRate, check_queueable
from batchpilot_runtime.scheduling.admission_pass import AdmittedGroups, admit_lanes
from batchpilot_runtime.scheduling.lanes import LaneTable, Seq
from batchpilot_runtime.scheduling.types import QueueFullError, RequestRejected, SchedRequest, SeqStatus

LANE = "critical"


class Host:
    """Starts what ``fits`` lets through, at most ``budget`` requests; records the order of starts."""

    def __init__(self, fits: Callable[[Seq], bool] = lambda seq: True, budget: int = 1_000) -> None:
        self._fits = fits
        self.budget = budget
        self.started: list[Seq] = []

    @property
    def num_running(self) -> int:
        return len(self.started)

    def fits(self, seq: Seq) -> bool:
        return self._fits(seq)

    def has_budget(self) -> bool:
        return self.budget > 0

    def start(self, seq: Seq) -> None:
        seq.status = SeqStatus.RUNNING
        seq.lane.running += 1
        self.budget -= 1
        self.started.append(seq)


def make_table(window: Window, lanes: Sequence[LaneWindow] = ()) -> LaneTable:
    return LaneTable(window, {lane.name: lane for lane in lanes}, wait_samples=8)


def queue(table: LaneTable, lane: str, count: int, arrival_s: float = 0.0, prompt_tokens: int = 1) -> list[Seq]:
    state = table.open_lane(lane)
    seqs = [
        Seq(SchedRequest(f"{lane}-{index}", (0,) * prompt_tokens, 1, arrival_s, lane), state) for index in range(count)
    ]
    state.waiting.extend(seqs)
    return seqs


def admit(table: LaneTable, host: Host, now_s: float = 0.0, skip_ahead: int = 0, **kwargs: bool) -> AdmittedGroups:
    return admit_lanes(
        table, host, now_s, table.states[DEFAULT_LANE].window.hard_cap, AdmissionRate(), skip_ahead, **kwargs
    )


def ids(seqs: Sequence[Seq]) -> list[str]:
    return [seq.request_id for seq in seqs]


def test_a_group_fills_the_cap_and_is_counted_once_as_cap() -> None:
    table = make_table(Window(target_batch_size=2, hard_cap=3, max_wait_ms=100))
    queue(table, DEFAULT_LANE, 5)
    host = Host()
    admitted = admit(table, host)
    assert ids(host.started) == ["default-0", "default-1", "default-2"]
    assert admitted == AdmittedGroups({"cap": 1}, 3)


def test_no_trigger_no_group_and_the_wait_trigger_counts_as_wait() -> None:
    table = make_table(Window(target_batch_size=4, hard_cap=8, max_wait_ms=100))
    queue(table, DEFAULT_LANE, 2)
    host = Host()
    assert admit(table, host, now_s=0.099) == AdmittedGroups({}, 0)
    assert admit(table, host, now_s=0.1) == AdmittedGroups({"wait": 1}, 2)
    assert [seq.first_admitted_s for seq in host.started] == [0.1, 0.1]


def test_a_front_that_does_not_fit_is_passed_by_one_that_does_within_skip_ahead() -> None:
    table = make_table(Window(target_batch_size=1, hard_cap=8, max_wait_ms=0))
    queue(table, DEFAULT_LANE, 1, prompt_tokens=100)
    short = Seq(SchedRequest("short", (0,), 1, 0.0, DEFAULT_LANE), table.states[DEFAULT_LANE])
    table.states[DEFAULT_LANE].waiting.append(short)
    small_only = Host(fits=lambda seq: len(seq.prompt) < 10)
    assert admit(table, small_only, skip_ahead=0) == AdmittedGroups({}, 0)
    assert admit(table, small_only, skip_ahead=1) == AdmittedGroups({"target": 1}, 1)
    assert ids(small_only.started) == ["short"]
    assert ids(table.states[DEFAULT_LANE].waiting) == ["default-0"]


def test_nothing_passes_a_tail_marked_front() -> None:
    table = make_table(Window(target_batch_size=1, hard_cap=8, max_wait_ms=0))
    long, short = queue(table, DEFAULT_LANE, 2)
    lane = table.states[DEFAULT_LANE]
    lane.waiting.popleft()
    long.tail_marked = True
    lane.marked.append(long)
    host = Host(fits=lambda seq: seq is short)
    assert admit(table, host, skip_ahead=4) == AdmittedGroups({}, 0)
    assert host.started == []


def test_resumes_go_first_are_not_admissions_and_a_batch_in_progress_admits_nothing_new() -> None:
    table = make_table(Window(target_batch_size=1, hard_cap=8, max_wait_ms=0))
    fresh = queue(table, DEFAULT_LANE, 2)
    lane = table.states[DEFAULT_LANE]
    resumed = Seq(SchedRequest("resumed", (0,), 1, 0.0, DEFAULT_LANE), lane)
    lane.resume.append(resumed)
    host = Host()
    assert admit(table, host, batch_in_progress=True) == AdmittedGroups({}, 0)
    assert host.started == [resumed]
    assert admit(table, host) == AdmittedGroups({"target": 1}, 2)
    assert host.started == [resumed, *fresh]


def test_a_lane_with_a_tail_marked_request_goes_first_and_its_group_counts_as_tail() -> None:
    lane_window = LaneWindow(
        name=LANE, window=Window(target_batch_size=2, hard_cap=2, max_wait_ms=1000), reserved_slots=0
    )
    table = make_table(Window(target_batch_size=2, hard_cap=2, max_wait_ms=1000), [lane_window])
    default_first, _ = queue(table, DEFAULT_LANE, 2)
    (marked,) = queue(table, LANE, 1)
    lane = table.states[LANE]
    lane.waiting.popleft()
    marked.tail_marked = True
    lane.marked.append(marked)
    host = Host()
    # The marked lane takes one of the two slots first; the default lane's group then fills the cap.
    assert admit(table, host) == AdmittedGroups({"tail": 1, "cap": 1}, 2)
    assert host.started == [marked, default_first]


def test_the_budget_cuts_a_group() -> None:
    table = make_table(Window(target_batch_size=1, hard_cap=8, max_wait_ms=0))
    queue(table, DEFAULT_LANE, 4)
    host = Host(budget=2)
    assert admit(table, host) == AdmittedGroups({"target": 1}, 2)
    assert ids(host.started) == ["default-0", "default-1"]


@settings(max_examples=200, deadline=None)
@given(
    cap=st.integers(1, 8),
    lane_cap=st.integers(1, 8),
    reserved=st.integers(0, 8),
    targets=st.tuples(st.integers(1, 10), st.integers(1, 10)),
    counts=st.tuples(st.integers(0, 12), st.integers(0, 12)),
    large=st.sets(st.integers(0, 23)),
    budget=st.integers(0, 20),
    skip_ahead=st.integers(0, 4),
    now_s=st.sampled_from([0.0, 0.05, 0.2]),
)
def test_a_pass_keeps_the_caps_counts_every_group_once_and_keeps_queue_order(
    cap: int,
    lane_cap: int,
    reserved: int,
    targets: tuple[int, int],
    counts: tuple[int, int],
    large: set[int],
    budget: int,
    skip_ahead: int,
    now_s: float,
) -> None:
    reserved = min(reserved, cap - 1, lane_cap)
    lane_window = LaneWindow(
        name=LANE,
        window=Window(target_batch_size=min(targets[1], lane_cap), hard_cap=lane_cap, max_wait_ms=100),
        reserved_slots=reserved,
    )
    table = make_table(Window(target_batch_size=min(targets[0], cap), hard_cap=cap, max_wait_ms=100), [lane_window])
    queued = {
        DEFAULT_LANE: queue(table, DEFAULT_LANE, counts[0]),
        LANE: queue(table, LANE, counts[1]),
    }
    # Requests whose position (over both lanes) is in ``large`` never fit.
    too_large = {id(seq) for index, seq in enumerate(queued[DEFAULT_LANE] + queued[LANE]) if index in large}
    host = Host(fits=lambda seq: id(seq) not in too_large, budget=budget)
    admitted = admit(table, host, now_s=now_s, skip_ahead=skip_ahead)

    assert host.num_running <= cap
    assert table.states[LANE].running <= lane_cap
    assert sum(admitted.admissions.values()) <= 2  # at most one group per lane
    assert admitted.admitted_requests == len(host.started) <= budget
    assert all(id(seq) not in too_large for seq in host.started)
    for name, seqs in queued.items():
        started = [seq for seq in host.started if seq.lane.name == name]
        # FIFO within a lane: the started ones keep their queue order, and only a request that does
        # not fit is ever passed.
        positions = [seqs.index(seq) for seq in started]
        assert positions == sorted(positions)
        passed = [seq for seq in seqs[: max(positions, default=-1) + 1] if seq not in started]
        assert all(id(seq) in too_large for seq in passed)
        assert ids(table.states[name].waiting) == ids([seq for seq in seqs if seq not in started])
    groups = {seq.lane.name for seq in host.started}
    assert sum(admitted.admissions.values()) == len(groups)


def _refusal(id_in_use: bool, lane_open: bool, waiting: int) -> str:
    try:
        check_queueable("r1", id_in_use, "bulk", lane_open, lambda: ["critical", "default"], waiting, 4, lambda: 2.5)
    except RequestRejected as error:
        return f"{error.field}: {error}"
    except QueueFullError as error:
        return f"full {error.retry_after_s}: {error}"
    return "queued"


def test_the_door_refuses_an_id_in_use_then_a_closed_lane_then_a_full_queue() -> None:
    assert _refusal(True, False, 4) == "request_id: request_id: 'r1' is already queued or running"
    assert _refusal(False, False, 4) == "lane: lane: unknown lane 'bulk' (known: critical, default)"
    assert _refusal(False, True, 4) == "full 2.5: the waiting queue is full (4 requests); retry in 2.5 s"
    assert _refusal(False, True, 3) == "queued"
