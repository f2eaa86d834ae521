"""Lanes: each lane's window and queues, the table of lanes the scheduler owns, and the one check of
a window and its lanes.

A lane is *open* (takes new requests) while it is in force and not retired, or staged by
``LaneTable.stage``: a request for a lane the last ``set_window`` staged is queued at once and
admitted from the step that applies the lanes, so no caller has to hold it back. A lane left out of
the lanes applied is retired: closed, its reservation released, its queued and running requests
finished under its last window, and it is dropped once empty.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Mapping

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.scheduling.types import SchedRequest, SeqStatus

# Below this P50 a tail threshold would mark nearly every request that waits at all.
TAIL_P50_FLOOR_S = 0.001


def lanes_by_name(lanes: Iterable[LaneWindow]) -> dict[str, LaneWindow]:
    """The lanes keyed by name; ``ValueError`` naming ``lanes`` when a name is listed twice."""
    by_name: dict[str, LaneWindow] = {}
    for lane in lanes:
        if lane.name in by_name:
            raise ValueError(f"lanes: lane {lane.name!r} is listed twice")
        by_name[lane.name] = lane
    return by_name


def check_window(
    window: Window, lanes: Mapping[str, LaneWindow], max_hard_cap: int | None = None
) -> dict[str, LaneWindow]:
    """The named ``lanes`` that would be in force with ``window``, checked; ``ValueError`` naming the
    field otherwise. ``max_hard_cap`` (what the pod's KV cache can hold), when given, bounds every cap."""
    if max_hard_cap is not None and window.hard_cap > max_hard_cap:
        raise ValueError(
            f"window.hardCap: {window.hard_cap} exceeds what the KV cache can hold, {max_hard_cap} sequences"
        )
    for name, lane in lanes.items():
        if name == DEFAULT_LANE:
            raise ValueError(f"lanes: {DEFAULT_LANE!r} is the main window's lane and cannot be redefined")
        if not name:
            raise ValueError("lanes: a lane name must not be empty")
        if lane.name != name:
            raise ValueError(f"lanes: key {name!r} differs from the lane's name {lane.name!r}")
        if max_hard_cap is not None and lane.window.hard_cap > max_hard_cap:
            raise ValueError(
                f"lanes[{name}].window.hardCap: {lane.window.hard_cap} exceeds what the KV cache can hold, "
                f"{max_hard_cap} sequences"
            )
    reserved = sum(min(lane.reserved_slots, lane.window.hard_cap) for lane in lanes.values())
    if lanes and reserved >= window.hard_cap:
        raise ValueError(
            f"lanes: reservedSlots add up to {reserved}, which leaves none of hardCap {window.hard_cap} "
            "to the default lane"
        )
    return dict(lanes)


class RollingMedian:
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


class Lane:
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
        self.waiting: deque[Seq] = deque()
        self.marked: deque[Seq] = deque()
        self.resume: deque[Seq] = deque()
        self.running = 0
        self.waits = RollingMedian(wait_samples)

    @property
    def effective_reservation(self) -> int:
        return 0 if self.retired or self.is_default else min(self.reserved_slots, self.window.hard_cap)

    @property
    def num_fresh(self) -> int:
        return len(self.waiting) + len(self.marked)

    @property
    def is_empty(self) -> bool:
        return self.running == 0 and not self.waiting and not self.marked and not self.resume

    def tail_threshold_s(self, min_samples: int) -> float | None:
        """How long a request may wait before it is tail-marked; None before ``min_samples`` waits."""
        if len(self.waits) < min_samples:
            return None
        return self.window.tail_mark_ratio * max(self.waits.median(), TAIL_P50_FLOOR_S)

    def deadline_s(self, last_now_s: float, num_running: int, min_samples: int) -> float | None:
        """When this lane's admission trigger fires with no new arrival (``last_now_s`` when it already
        holds); ``num_running`` is R, every lane's running sequences."""
        if self.resume or self.marked:
            return last_now_s
        oldest = self.oldest_fresh()
        if oldest is None:
            return None
        running = num_running if self.is_default else self.running
        if running + self.num_fresh >= self.window.target_batch_size:
            return last_now_s
        deadline_s = oldest.arrival_s + self.window.max_wait_ms / 1000.0
        threshold_s = self.tail_threshold_s(min_samples)
        if threshold_s is not None:
            deadline_s = min(deadline_s, self.waiting[0].arrival_s + threshold_s)
        return deadline_s

    def triggers(self, now_s: float, num_running: int) -> tuple[bool, bool, bool]:
        """Which admission triggers hold for this lane's fresh requests at ``now_s``: (target, tail,
        wait); ``num_running`` is R, every lane's running sequences (the default lane counts them all)."""
        oldest = self.oldest_fresh()
        if oldest is None:
            return False, False, False
        running = num_running if self.is_default else self.running
        target_hit = running + self.num_fresh >= self.window.target_batch_size
        wait_hit = now_s >= oldest.arrival_s + self.window.max_wait_ms / 1000.0
        return target_hit, bool(self.marked), wait_hit

    def oldest_fresh(self) -> Seq | None:
        if self.marked:
            return self.marked[0]
        return self.waiting[0] if self.waiting else None


class Seq:
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

    def __init__(self, request: SchedRequest, lane: Lane) -> None:
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


class LaneTable:
    """Every lane's state (``states``: named lanes in their order, retired ones, then the default lane,
    the order in which lanes without a tail-marked request are admitted), the named lanes in force
    (``windows``) and those staged for the next step (``staged``; None: none staged)."""

    def __init__(self, window: Window, lanes: Mapping[str, LaneWindow], wait_samples: int) -> None:
        self._wait_samples = wait_samples
        self.windows = check_window(window, lanes)
        self.staged: dict[str, LaneWindow] | None = None
        self.states: dict[str, Lane] = {}
        self.apply(window)

    def stage(self, window: Window, lanes: Mapping[str, LaneWindow] | None) -> None:
        """Check ``lanes`` against ``window`` and stage them; None keeps the staged (or in-force) ones,
        which are checked against ``window`` all the same."""
        if lanes is not None:
            self.staged = check_window(window, lanes)
        else:
            check_window(window, self.windows if self.staged is None else self.staged)

    def apply(self, window: Window) -> None:
        """Put the staged lanes (if any) in force, with ``window`` as the default lane's window."""
        if self.staged is not None:
            self.windows, self.staged = self.staged, None
        old = self.states
        rebuilt: dict[str, Lane] = {}
        for name, lane_window in self.windows.items():
            state = old.get(name) or Lane(name, lane_window.window, 0, self._wait_samples)
            state.window = lane_window.window
            state.reserved_slots = lane_window.reserved_slots
            state.retired = False
            rebuilt[name] = state
        for name, state in old.items():
            if name not in rebuilt and name != DEFAULT_LANE and not state.is_empty:
                state.retired = True
                rebuilt[name] = state
        default = old.get(DEFAULT_LANE) or Lane(DEFAULT_LANE, window, 0, self._wait_samples)
        default.window = window
        rebuilt[DEFAULT_LANE] = default
        self.states = rebuilt

    def is_open(self, name: str) -> bool:
        """Whether a new request for ``name`` is taken: the lane is in force and not retired, or staged."""
        state = self.states.get(name)
        if state is not None and not state.retired:
            return True
        return self.staged is not None and name in self.staged

    def open_lane(self, name: str) -> Lane:
        """The lane a new request for ``name`` joins (``is_open`` says whether there is one; ``KeyError``
        when not): a staged lane's queue opens here, its window applies with the lanes."""
        state = self.states.get(name)
        if state is not None and not state.retired:
            return state
        staged = None if self.staged is None else self.staged.get(name)
        if staged is None:
            raise KeyError(f"lane {name!r} is not open")
        if state is None:
            state = Lane(name, staged.window, staged.reserved_slots, self._wait_samples)
            self.states[name] = state
        return state

    def open_names(self) -> list[str]:
        names = {name for name, state in self.states.items() if not state.retired}
        return sorted(names | set(self.staged or ()))

    def drop_if_done(self, lane: Lane) -> None:
        if lane.retired and lane.is_empty:
            del self.states[lane.name]

    def slot_room(self, lane: Lane, num_running: int, global_cap: int) -> int:
        """How many more sequences ``lane`` may start (see the scheduler's "Lanes and slots")."""
        held = 0
        for other in self.states.values():
            held += max(0, other.effective_reservation - other.running)
        free_global = global_cap - num_running - held
        if lane.is_default:
            return free_global
        own_unused = max(0, lane.effective_reservation - lane.running)
        return min(lane.window.hard_cap - lane.running, free_global + own_unused)

    def next_deadline_s(self, last_now_s: float, num_running: int, min_samples: int) -> float | None:
        """The earliest time a lane's trigger fires with no new arrival (``last_now_s``, the last
        ``schedule``'s time, when one already holds); None when no request waits."""
        deadline_s: float | None = None
        for lane in self.states.values():
            candidate_s = lane.deadline_s(last_now_s, num_running, min_samples)
            if candidate_s is not None and (deadline_s is None or candidate_s < deadline_s):
                deadline_s = candidate_s
        return deadline_s

    def mark_tails(self, now_s: float, min_samples: int) -> int:
        """Tail-mark every waiting request past its lane's threshold at ``now_s``; returns how many."""
        marked = 0
        for lane in self.states.values():
            if not lane.waiting:
                continue
            threshold_s = lane.tail_threshold_s(min_samples)
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

    def admission_order(self) -> list[Lane]:
        """Lanes holding a tail-marked request first (oldest mark first), then the others in order."""
        lanes = list(self.states.values())
        with_tail = sorted((lane for lane in lanes if lane.marked), key=lambda lane: lane.marked[0].arrival_s)
        return with_tail + [lane for lane in lanes if not lane.marked]
