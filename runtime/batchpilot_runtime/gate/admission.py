"""The gate's admission: the runtime's window rules applied to requests in flight to an upstream engine.

Pure, synchronous and clock-injected, like the scheduler, and built from the scheduler's own pieces
(``LaneTable``, tail marking, ``AdmissionRate``, and the admission pass itself,
``scheduling.admission_pass.admit_lanes``, told that every request fits): what the gate cannot know
(tokens, KV blocks, steps) is left out, and everything else means what it means in
``scheduling.scheduler``:

- a request is *running* from its admission until ``release`` (its response ended, failed, or its
  client went away); the main window's ``hardCap`` bounds running requests over all lanes, a lane's
  own cap and reserved slots bound its share (``LaneTable.slot_room``);
- a lane admits a group when its target, tail or wait trigger holds (``Lane.triggers``), taking
  tail-marked requests first, then FCFS, while a slot is free; each group is counted once by the
  strongest condition that held ("cap", "target", "tail", "wait");
- a waiting request is tail-marked once it has waited ``tailMarkRatio`` x its lane's rolling P50 wait;
- ``enqueue`` refuses with ``QueueFullError`` (Retry-After from the recent admission rate, the
  runtime's computation) when ``max_queue`` requests wait, and with ``RequestRejected`` naming
  ``lane`` for a lane that is not open;
- ``set_window`` applies at once: the next ``admit`` uses it. A cap below the running count evicts
  nothing; admissions wait until the running set drops below it.

Invariant: after any ``admit``, no lane and not the whole gate holds more running requests than its cap
allows, whatever windows were set before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.scheduling.admission import AdmissionRate, check_queueable
from batchpilot_runtime.scheduling.admission_pass import admit_lanes
from batchpilot_runtime.scheduling.lanes import LaneTable, Seq, check_window
from batchpilot_runtime.scheduling.types import SchedRequest, SeqStatus


@dataclass(frozen=True)
class GateLimits:
    """The gate's fixed configuration (start-up flags)."""

    max_queue: int = 1024  # waiting requests over all lanes; beyond -> QueueFullError
    max_hard_cap: int = 256  # the engine's own cap (vLLM --max-num-seqs): no window may exceed it
    wait_p50_samples: int = 256
    tail_min_samples: int = 20

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_hard_cap", "wait_p50_samples", "tail_min_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.tail_min_samples > self.wait_p50_samples:
            raise ValueError(
                f"tail_min_samples ({self.tail_min_samples}) must not exceed wait_p50_samples ({self.wait_p50_samples})"
            )


@dataclass(frozen=True)
class Admitted:
    """A request let through to the upstream, with what its metrics need."""

    request_id: str
    lane: str
    arrival_s: float
    admitted_s: float
    tail_marked: bool


@dataclass
class AdmissionPass:
    """What one ``admit`` did."""

    admitted: list[Admitted] = field(default_factory=list)
    admissions: dict[str, int] = field(default_factory=dict)  # reason -> groups
    tail_marked: int = 0


class GateAdmission:
    """Every waiting and running request of the gate; see the module docstring for the rules."""

    def __init__(self, window: Window, lanes: Mapping[str, LaneWindow] | None = None, limits: GateLimits | None = None):
        self.limits = limits or GateLimits()
        lanes = dict(lanes or {})
        check_window(window, lanes, self.limits.max_hard_cap)
        self._window = window
        self._lanes = LaneTable(window, lanes, self.limits.wait_p50_samples)
        self._seqs: dict[str, Seq] = {}
        self._num_waiting = 0
        self._num_running = 0
        self._rate = AdmissionRate()
        self._last_now_s = -math.inf

    @property
    def window(self) -> Window:
        return self._window

    @property
    def lanes(self) -> dict[str, LaneWindow]:
        return dict(self._lanes.windows)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    def running_in(self, lane: str) -> int:
        state = self._lanes.states.get(lane)
        return 0 if state is None else state.running

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seqs

    def enqueue(self, request_id: str, lane: str, now_s: float) -> None:
        """Queue a request arriving at ``now_s``; ``RequestRejected`` (``request_id``, ``lane``) or
        ``QueueFullError``."""
        check_queueable(
            request_id,
            request_id in self._seqs,
            lane,
            self._lanes.is_open(lane),
            self._lanes.open_names,
            self._num_waiting,
            self.limits.max_queue,
            self.retry_after_s,
        )
        state = self._lanes.open_lane(lane)
        seq = Seq(SchedRequest(request_id, (), 0, now_s, lane), state)
        self._seqs[request_id] = seq
        state.waiting.append(seq)
        self._num_waiting += 1

    def release(self, request_id: str) -> bool:
        """End a request, waiting or running (its slot is free for the next ``admit``); False if unknown."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        lane = seq.lane
        if seq.status is SeqStatus.RUNNING:
            lane.running -= 1
            self._num_running -= 1
        else:
            (lane.marked if seq.tail_marked else lane.waiting).remove(seq)
            self._num_waiting -= 1
        seq.status = SeqStatus.FINISHED
        self._lanes.drop_if_done(lane)
        return True

    def set_window(self, window: Window, lanes: Mapping[str, LaneWindow] | None = None) -> None:
        """Check ``window`` (and ``lanes``, None: keep those in force) and put them in force now;
        ``ValueError`` naming the field when they do not fit each other or ``max_hard_cap``."""
        check_window(window, self._lanes.windows if lanes is None else lanes, self.limits.max_hard_cap)
        self._lanes.stage(window, lanes)
        self._lanes.apply(window)
        self._window = window

    def admit(self, now_s: float) -> AdmissionPass:
        """Admit every group whose trigger holds at ``now_s``, lanes with a tail-marked request first."""
        self._last_now_s = now_s
        tail_marked = self._lanes.mark_tails(now_s, self.limits.tail_min_samples)
        admitted: list[Admitted] = []
        host = _GateHost(self, admitted, now_s)
        groups = admit_lanes(self._lanes, host, now_s, self._window.hard_cap, self._rate)
        return AdmissionPass(admitted, groups.admissions, tail_marked)

    def next_deadline_s(self) -> float | None:
        """When ``admit`` would next let a waiting request through with no arrival or release; None when
        nothing waits. A time at or before the last ``admit`` means a trigger holds but no slot is free:
        a ``release`` will call ``admit`` anyway."""
        return self._lanes.next_deadline_s(self._last_now_s, self._num_running, self.limits.tail_min_samples)

    def retry_after_s(self) -> float:
        """The runtime's Retry-After: the queue draining by a tenth at the recent admission rate (with no
        rate yet, 1 s or the window's wait if longer)."""
        return self._rate.retry_after_s(self.limits.max_queue, self._window.max_wait_ms)

    def wait_p50_s(self, lane: str = DEFAULT_LANE) -> float | None:
        waits = self._lanes.states[lane].waits
        return waits.median() if len(waits) else None


class _GateHost:
    """The gate's side of an admission pass: with no tokens or KV to count, every request fits and
    no budget runs out; a request starts by joining the running set and the pass's ``admitted``."""

    __slots__ = ("_admitted", "_gate", "_now_s")

    def __init__(self, gate: GateAdmission, admitted: list[Admitted], now_s: float) -> None:
        self._gate = gate
        self._admitted = admitted
        self._now_s = now_s

    @property
    def num_running(self) -> int:
        return self._gate.num_running

    def fits(self, seq: Seq) -> bool:
        return True

    def has_budget(self) -> bool:
        return True

    def start(self, seq: Seq) -> None:
        seq.status = SeqStatus.RUNNING
        seq.lane.running += 1
        self._gate._num_waiting -= 1
        self._gate._num_running += 1
        self._admitted.append(Admitted(seq.request_id, seq.lane.name, seq.arrival_s, self._now_s, seq.tail_marked))
