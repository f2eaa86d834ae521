"""Exact cases of the window scheduler's windows and lanes: staging, caps, reserved slots, retired
lanes; each named after the rule it pins."""

from __future__ import annotations

import pytest

from batchpilot_runtime.contract.admin_api import LaneWindow
from batchpilot_runtime.scheduling.types import (
    RequestRejected,
    SeqStatus,
)
from tests.support.factories import make_lane, make_window
from tests.support.scheduler_factories import add_all, make_requests, make_scheduler, sampled_for, step

# -- windows -------------------------------------------------------------------------------------


def test_window_change_applies_only_at_the_next_schedule() -> None:
    scheduler = make_scheduler(target=2, cap=2, wait_ms=1000)
    add_all(scheduler, make_requests(4, max_new=5))
    plan = scheduler.schedule(0.0)
    scheduler.set_window(make_window(target=1, cap=4, wait_ms=0, generation=7))
    assert scheduler.window.generation == 0
    assert scheduler.staged_window is not None
    scheduler.update_from_output(plan, sampled_for(plan), 0.0)
    assert scheduler.window.hard_cap == 2
    assert plan.stats.window_generation == 0
    plan = scheduler.schedule(1.0)
    assert scheduler.window.generation == 7
    assert plan.stats.window_generation == 7
    assert plan.stats.admitted_requests == 2  # the new cap of 4 admits r2, r3 in that same step
    assert scheduler.staged_window is None


def test_lowering_the_cap_below_the_running_count_evicts_nothing() -> None:
    scheduler = make_scheduler(target=1, cap=4, wait_ms=0)
    add_all(scheduler, make_requests(4, max_new=3))
    step(scheduler, 0.0)
    scheduler.add_request(make_requests(1, max_new=1, start=4)[0])
    scheduler.set_window(make_window(target=1, cap=2, wait_ms=0, generation=1))
    plan, _ = step(scheduler, 1.0)
    assert scheduler.num_running == 4
    assert plan.stats.batch_size == 4
    assert scheduler.status_of("r4") is SeqStatus.WAITING
    step(scheduler, 2.0)  # r0..r3 finish
    plan = scheduler.schedule(3.0)
    assert plan.stats.admitted_requests == 1


def test_a_staged_lane_takes_requests_at_once_and_admits_them_when_applied() -> None:
    scheduler = make_scheduler(target=1, cap=4, wait_ms=0)
    lanes = {"critical": make_lane("critical", target=1, cap=2, wait_ms=0, reserved=1)}
    scheduler.set_window(make_window(target=1, cap=4, wait_ms=0, generation=1), lanes)
    scheduler.add_request(make_requests(1, lane="critical", prefix="c")[0])
    assert scheduler.lanes == {}
    assert scheduler.waiting_ids("critical") == ("c0",)
    plan = scheduler.schedule(0.0)
    assert scheduler.lanes == lanes
    assert [seq.request_id for seq in plan.seqs] == ["c0"]


def test_a_request_for_a_staged_lane_replaced_before_it_applies_finishes_in_the_retired_lane() -> None:
    scheduler = make_scheduler(target=1, cap=4, wait_ms=0)
    scheduler.set_window(make_window(target=1, cap=4, wait_ms=0, generation=1), {"critical": make_lane("critical")})
    scheduler.add_request(make_requests(1, max_new=2, lane="critical", prefix="c")[0])
    scheduler.set_window(make_window(target=1, cap=4, wait_ms=0, generation=2), {})
    for t in range(4):
        step(scheduler, float(t))
    assert not scheduler.has_unfinished
    with pytest.raises(RequestRejected, match="lane"):
        scheduler.add_request(make_requests(1, lane="critical", prefix="c", start=1)[0])


def test_a_later_set_window_replaces_the_staged_window_and_keeps_staged_lanes() -> None:
    scheduler = make_scheduler()
    lanes = {"critical": make_lane("critical", reserved=1)}
    scheduler.set_window(make_window(target=4, cap=8, wait_ms=10, generation=1), lanes)
    scheduler.set_window(make_window(target=2, cap=3, wait_ms=10, generation=2))
    assert scheduler.lanes == {}
    scheduler.schedule(0.0)
    assert (scheduler.window.generation, scheduler.window.hard_cap) == (2, 3)
    assert scheduler.lanes == lanes


def test_wait_p50_is_the_median_of_recent_queue_waits() -> None:
    scheduler = make_scheduler(target=1, cap=1, wait_ms=0, wait_p50_samples=3, tail_min_samples=1)
    assert scheduler.wait_p50_s() is None
    for i, wait_s in enumerate((0.001, 0.005, 0.002, 0.009)):  # the first ages out of the 3 samples
        scheduler.add_request(make_requests(1, max_new=1, arrival_s=float(i), start=i)[0])
        step(scheduler, i + wait_s)
    assert scheduler.wait_p50_s() == pytest.approx(0.005)


# -- lanes and reserved slots ----------------------------------------------------------------------


def test_reserved_slots_are_held_for_their_lane() -> None:
    lanes = {"critical": make_lane("critical", target=1, cap=2, wait_ms=0, reserved=1)}
    scheduler = make_scheduler(target=1, cap=4, wait_ms=0, lanes=lanes)
    add_all(scheduler, make_requests(5, max_new=10))
    scheduler.schedule(0.0)
    assert scheduler.num_running == 3  # 4 - 1 reserved
    add_all(scheduler, make_requests(2, max_new=10, lane="critical", prefix="c", arrival_s=0.1))
    scheduler.schedule(0.1)
    assert scheduler.running_ids() == ("r0", "r1", "r2", "c0")  # c1: global cap reached
    assert scheduler.waiting_ids("critical") == ("c1",)
    assert scheduler.waiting_ids() == ("r3", "r4")


def test_a_lane_uses_free_unreserved_slots_up_to_its_own_cap() -> None:
    lanes = {"critical": make_lane("critical", target=1, cap=2, wait_ms=0, reserved=1)}
    scheduler = make_scheduler(target=1, cap=8, wait_ms=0, lanes=lanes)
    add_all(scheduler, make_requests(3, max_new=10, lane="critical", prefix="c"))
    plan = scheduler.schedule(0.0)
    assert scheduler.running_ids() == ("c0", "c1")
    assert dict(plan.stats.admissions) == {"cap": 1}


def test_the_default_lane_target_counts_every_running_sequence() -> None:
    lanes = {"critical": make_lane("critical", target=1, cap=2, wait_ms=0, reserved=0)}
    scheduler = make_scheduler(target=3, cap=8, wait_ms=1000, lanes=lanes)
    add_all(scheduler, make_requests(2, max_new=10, lane="critical", prefix="c"))
    scheduler.schedule(0.0)
    scheduler.add_request(make_requests(1, max_new=10)[0])
    plan = scheduler.schedule(0.001)
    assert dict(plan.stats.admissions) == {"target": 1}


@pytest.mark.parametrize(
    ("lanes", "match"),
    [
        ({"critical": make_lane("critical", reserved=2), "vip": make_lane("vip", reserved=2)}, "reservedSlots"),
        ({"default": make_lane("default")}, "main window"),
        ({"critical": make_lane("vip")}, "differs"),
    ],
)
def test_invalid_lanes_are_refused_naming_lanes(lanes: dict[str, LaneWindow], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_scheduler(cap=4, lanes=lanes)
    scheduler = make_scheduler(cap=4)
    with pytest.raises(ValueError, match="lanes"):
        scheduler.set_window(make_window(target=4, cap=4, wait_ms=10), lanes)


def test_a_removed_lane_drains_and_then_refuses_new_requests() -> None:
    lanes = {"critical": make_lane("critical", target=1, cap=2, wait_ms=0, reserved=1)}
    scheduler = make_scheduler(target=1, cap=4, wait_ms=0, lanes=lanes)
    add_all(scheduler, make_requests(1, max_new=2, lane="critical", prefix="c"))
    scheduler.schedule(0.0)
    scheduler.set_window(make_window(target=1, cap=4, wait_ms=0, generation=1), {})
    scheduler.add_request(make_requests(1, max_new=1, lane="critical", prefix="c", start=1)[0])  # still open
    plan = scheduler.schedule(1.0)
    assert scheduler.lanes == {}
    scheduler.update_from_output(plan, sampled_for(plan), 1.0)
    with pytest.raises(RequestRejected, match="lane"):
        scheduler.add_request(make_requests(1, lane="critical", prefix="c", start=2)[0])
    for t in range(2, 5):
        step(scheduler, float(t))
    assert not scheduler.has_unfinished
