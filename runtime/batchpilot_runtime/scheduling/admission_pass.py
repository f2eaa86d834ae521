"""One admission pass over the lanes, shared by the scheduler and the gate.

The rules (see ``scheduling.scheduler``'s "Admission") live here once: lanes in admission order;
preempted requests resumed first; a group of fresh requests when the lane's target, tail or wait
trigger holds, taken tail-marked first then FCFS while a slot is free, past an unmarked front that
does not fit to one of the next ``skip_ahead`` that does; each group counted once by the strongest
condition that held. What differs between the two owners sits behind ``AdmissionHost``: whether a
request fits now (the scheduler: its KV blocks; the gate: always), whether the step has prompt
budget left (the gate: always), and what starting a request means.

Invariants: a pass never starts more requests in a lane than ``LaneTable.slot_room`` allows, so no
lane and not the whole pod exceeds its cap; the reason counts add up to the groups admitted; inside
a lane fresh requests leave in queue order, except the skip-ahead past an unmarked front.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from batchpilot_runtime.scheduling.admission import AdmissionRate, admission_reason
from batchpilot_runtime.scheduling.lanes import Lane, LaneTable, Seq


class AdmissionHost(Protocol):
    """What an admission pass asks of the one who owns the running set."""

    @property
    def num_running(self) -> int:
        """R: requests running in every lane, the ones this pass started included."""
        ...

    def fits(self, seq: Seq) -> bool:
        """Whether ``seq`` could start now (its KV blocks are free)."""
        ...

    def has_budget(self) -> bool:
        """Whether one more request may start in this pass (prompt budget is left)."""
        ...

    def start(self, seq: Seq) -> None:
        """Make ``seq`` (already out of its lane's queues) running; its lane's ``running`` included."""
        ...


@dataclass
class AdmittedGroups:
    """What one pass admitted: groups by reason ("cap", "target", "tail", "wait") and fresh requests
    (resumes are not admissions)."""

    admissions: dict[str, int] = field(default_factory=dict)
    admitted_requests: int = 0


def take_fresh(lane: Lane, host: AdmissionHost, skip_ahead: int) -> Seq | None:
    """Take the lane's next fresh request to admit: its front when that fits, else (past an unmarked
    front) the first of the next ``skip_ahead`` that fits; None when none may go."""
    front = lane.oldest_fresh()
    if front is None:
        return None
    if host.fits(front):
        (lane.marked if front.tail_marked else lane.waiting).popleft()
        return front
    if front.tail_marked:
        return None  # nothing passes a tail-marked request: freed blocks go to it
    waiting = lane.waiting
    for index in range(1, min(len(waiting), skip_ahead + 1)):
        passer = waiting[index]
        if host.fits(passer):
            del waiting[index]
            return passer
    return None


def admit_lanes(
    lanes: LaneTable,
    host: AdmissionHost,
    now_s: float,
    global_cap: int,
    rate: AdmissionRate,
    skip_ahead: int = 0,
    batch_in_progress: bool = False,
) -> AdmittedGroups:
    """Resume preempted requests and admit at most one group of fresh requests per lane at ``now_s``
    under the pod's cap ``global_cap``; every admission is recorded in ``rate``. ``batch_in_progress``
    (static batching with a batch running) lets only resumes through."""
    result = AdmittedGroups()
    for lane in lanes.admission_order():
        if not (lane.resume or lane.marked or lane.waiting):
            continue
        room = lanes.slot_room(lane, host.num_running, global_cap)
        # 1. Preempted requests first: they were admitted before everything still waiting.
        while lane.resume and room > 0 and host.has_budget() and host.fits(lane.resume[0]):
            host.start(lane.resume.popleft())
            room -= 1
        if lane.resume or batch_in_progress or room <= 0 or not host.has_budget():
            continue
        # 2. The window's triggers.
        target_hit, tail_hit, wait_hit = lane.triggers(now_s, host.num_running)
        if not (target_hit or tail_hit or wait_hit):
            continue
        # 3. The group, while a slot is free and the request fits.
        group = 0
        while room > 0 and host.has_budget():
            seq = take_fresh(lane, host, skip_ahead)
            if seq is None:
                break
            seq.first_admitted_s = now_s
            lane.waits.add(now_s - seq.arrival_s)
            rate.record(now_s)
            host.start(seq)
            room -= 1
            group += 1
        if group == 0:
            continue
        # 4. Counted once, by the strongest condition that holds.
        num_running = host.num_running
        lane_running = num_running if lane.is_default else lane.running
        at_cap = lane_running >= lane.window.hard_cap or num_running >= global_cap
        reason = admission_reason(at_cap, target_hit, tail_hit)
        result.admissions[reason] = result.admissions.get(reason, 0) + 1
        result.admitted_requests += group
    return result
