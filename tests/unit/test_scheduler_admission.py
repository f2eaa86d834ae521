"""Exact cases of the window scheduler's admission: the triggers, groups cut by the KV cache, skip-ahead,
the deadline, and tail marking; each named after the rule it pins."""

from __future__ import annotations

import dataclasses

import pytest

from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import (
    SchedRequest,
)
from tests.support.factories import make_lane, make_window
from tests.support.scheduler_factories import add_all, make_requests, make_scheduler, sampled_for, step

# -- admission reasons ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "target", "cap", "n", "now_s", "admitted", "reasons"),
    [
        ("target_reached_by_arrivals", 3, 8, 3, 0.0, 3, {"target": 1}),
        ("below_target_before_wait_admits_nothing", 3, 8, 2, 0.009, 0, {}),
        ("oldest_waited_max_wait", 3, 8, 2, 0.010, 2, {"wait": 1}),
        ("group_filling_the_cap_counts_as_cap", 2, 3, 5, 0.0, 3, {"cap": 1}),
        ("target_equal_cap_counts_as_cap", 4, 4, 4, 0.0, 4, {"cap": 1}),
    ],
)
def test_admission_reason(
    case: str, target: int, cap: int, n: int, now_s: float, admitted: int, reasons: dict[str, int]
) -> None:
    scheduler = make_scheduler(target=target, cap=cap, wait_ms=10)
    add_all(scheduler, make_requests(n))
    plan = scheduler.schedule(now_s)
    assert plan.stats.admitted_requests == admitted
    assert dict(plan.stats.admissions) == reasons
    assert scheduler.num_running == admitted
    assert scheduler.num_waiting == n - admitted


def test_arrivals_join_a_running_set_at_or_above_target_at_once_as_target() -> None:
    scheduler = make_scheduler(target=2, cap=8, wait_ms=1000)
    add_all(scheduler, make_requests(2, max_new=10))
    step(scheduler, 0.0)
    scheduler.add_request(make_requests(1, max_new=10, arrival_s=0.001, start=2)[0])
    plan = scheduler.schedule(0.001)
    assert plan.stats.admitted_requests == 1
    assert dict(plan.stats.admissions) == {"target": 1}
    assert scheduler.running_ids() == ("r0", "r1", "r2")


def test_running_below_target_waits_for_enough_arrivals() -> None:
    scheduler = make_scheduler(target=3, cap=8, wait_ms=1000)
    add_all(scheduler, make_requests(1, max_new=10))
    assert scheduler.schedule(0.0).stats.admitted_requests == 0
    scheduler.add_request(make_requests(1, arrival_s=0.1, start=1)[0])
    assert scheduler.schedule(0.1).stats.admitted_requests == 0
    scheduler.add_request(make_requests(1, arrival_s=0.2, start=2)[0])
    plan = scheduler.schedule(0.2)
    assert plan.stats.admitted_requests == 3
    assert dict(plan.stats.admissions) == {"target": 1}


def test_group_is_cut_at_the_first_request_that_does_not_fit_free_kv() -> None:
    # 4 blocks of 4 tokens; prompts of 6 tokens need 2 blocks each: two fit, the third waits (no overtaking).
    scheduler = make_scheduler(target=3, cap=8, blocks=4, block_size=4)
    add_all(scheduler, make_requests(3, prompt_tokens=6, max_new=2))
    scheduler.add_request(make_requests(1, prompt_tokens=1, max_new=1, start=3)[0])
    plan = scheduler.schedule(0.0)
    assert scheduler.running_ids() == ("r0", "r1")
    assert scheduler.waiting_ids() == ("r2", "r3")
    assert dict(plan.stats.admissions) == {"target": 1}
    assert scheduler.kv_usage_ratio == 1.0


def test_a_prompt_that_fits_is_admitted_past_a_front_that_does_not() -> None:
    # 6 blocks of 4: r0 (12 tokens) runs; r1 (16 tokens, 4 blocks) does not fit the 3 left; r2 (4) does.
    scheduler = make_scheduler(target=1, cap=8, blocks=6, block_size=4)
    scheduler.add_request(make_requests(1, prompt_tokens=12, max_new=4)[0])
    scheduler.schedule(0.0)
    scheduler.add_request(make_requests(1, prompt_tokens=16, max_new=2, start=1)[0])
    scheduler.add_request(make_requests(1, prompt_tokens=4, max_new=2, start=2)[0])
    plan = scheduler.schedule(0.001)
    assert scheduler.running_ids() == ("r0", "r2")
    assert scheduler.waiting_ids() == ("r1",)
    assert plan.stats.admitted_requests == 1
    strict = make_scheduler(target=1, cap=8, blocks=6, block_size=4)
    strict = Scheduler(dataclasses.replace(strict.config, skip_ahead=0), strict.window)
    strict.add_request(make_requests(1, prompt_tokens=12, max_new=4)[0])
    strict.schedule(0.0)
    add_all(strict, make_requests(2, prompt_tokens=16, max_new=2, start=1)[:1] + make_requests(1, 4, 2, start=2))
    strict.schedule(0.001)
    assert strict.running_ids() == ("r0",)


SHORT_EVERY = 2  # arrivals a little faster than the cache serves shorts: a queue always waits


def _starve(tail_min_samples: int) -> tuple[float | None, int, float]:
    """A long prompt at the front and a short one arriving every other step, each short fitting
    what a finishing one frees. Returns when the long one was admitted, how many shorts passed it,
    and the lane's P50 wait then."""
    # 8 blocks of 4 tokens; a short needs 1 block to start and 3 by its end (4 prompt + 8 out), the
    # long one 5 to start (18 tokens): the shorts keep the cache nearly full, so it never fits
    # unless the freed blocks are kept for it.
    scheduler = make_scheduler(
        target=1,
        cap=8,
        blocks=8,
        block_size=4,
        tail_min_samples=tail_min_samples,
        wait_p50_samples=max(32, tail_min_samples),
        max_queue=1024,
    )
    passed = 0
    for i in range(400):
        now_s = i * 0.001
        if i == 3:
            scheduler.add_request(SchedRequest("long", tuple(range(1, 19)), 2, now_s))
        if i % SHORT_EVERY == 0:
            scheduler.add_request(SchedRequest(f"s{i}", (1, 2, 3, 4), 8, now_s))
        plan, _ = step(scheduler, now_s)
        admitted = {s.request_id for s in plan.seqs if s.is_prefill and s.start_pos == 0}
        if "long" in admitted:
            return now_s, passed, scheduler.wait_p50_s() or 0.0
        passed += len(admitted) if i >= 3 else 0
    return None, passed, scheduler.wait_p50_s() or 0.0


def test_tail_marking_bounds_how_long_a_request_that_others_pass_waits() -> None:
    # Never marked (too few wait samples for marking, ever): the shorts keep taking the freed blocks.
    never, passed, _ = _starve(tail_min_samples=10_000)
    assert never is None and passed > 300
    # Marked once it has waited 2 x the lane's P50 wait (at least 1 ms): from then on nothing passes
    # it, and it waits only for running shorts (9 steps of life at most) to free its 5 blocks.
    admitted_s, passed, p50_s = _starve(tail_min_samples=2)
    assert admitted_s is not None
    step_s = 0.001
    assert admitted_s - 0.003 <= 2 * max(p50_s, 0.001) + 9 * step_s + step_s
    assert passed <= 2


def test_watermark_keeps_blocks_free_while_others_run_and_is_waived_when_idle() -> None:
    scheduler = make_scheduler(target=1, cap=8, blocks=10, block_size=4, watermark=0.2)
    add_all(scheduler, make_requests(2, prompt_tokens=20, max_new=2))
    scheduler.schedule(0.0)
    # r0 took 5 blocks; r1 needs 5 more + a watermark of 2 > 5 free.
    assert scheduler.running_ids() == ("r0",)
    idle = make_scheduler(target=1, cap=8, blocks=10, block_size=4, watermark=0.2)
    idle.add_request(make_requests(1, prompt_tokens=37, max_new=4)[0])  # 40 tokens: all 10 blocks
    idle.schedule(0.0)
    assert idle.running_ids() == ("r0",)


def test_next_deadline_is_the_oldest_arrival_plus_max_wait() -> None:
    scheduler = make_scheduler(target=3, wait_ms=10)
    assert scheduler.next_deadline_s() is None
    add_all(scheduler, make_requests(2, arrival_s=1.0, spacing_s=0.004))
    assert scheduler.next_deadline_s() == pytest.approx(1.010)
    assert scheduler.schedule(1.009).is_empty
    plan = scheduler.schedule(scheduler.next_deadline_s() or 0.0)
    assert dict(plan.stats.admissions) == {"wait": 1}


def test_next_deadline_is_now_when_a_trigger_already_holds() -> None:
    scheduler = make_scheduler(target=2, cap=2, wait_ms=1000)
    add_all(scheduler, make_requests(3, max_new=5))
    scheduler.schedule(0.5)
    assert scheduler.next_deadline_s() == 0.5  # r2 would join as soon as a slot frees


def test_a_staged_window_makes_the_deadline_due() -> None:
    scheduler = make_scheduler()
    scheduler.set_window(make_window(target=2, cap=4, wait_ms=10, generation=1))
    deadline = scheduler.next_deadline_s()
    assert deadline is not None
    assert deadline < 0


# -- tail marking --------------------------------------------------------------------------------


def _tail_scheduler(tail_min_samples: int) -> Scheduler:
    """Four requests admitted by target after a 2 ms wait (P50 = 2 ms), all finished by t = 3 ms."""
    scheduler = make_scheduler(target=4, cap=8, wait_ms=100, ratio=2.0, tail_min_samples=tail_min_samples)
    add_all(scheduler, make_requests(4, max_new=1))
    step(scheduler, 0.002)
    assert not scheduler.has_unfinished
    return scheduler


def test_tail_marked_request_is_admitted_with_reason_tail() -> None:
    scheduler = _tail_scheduler(tail_min_samples=4)
    scheduler.add_request(make_requests(1, max_new=1, arrival_s=0.010, start=4)[0])
    assert scheduler.next_deadline_s() == pytest.approx(0.014)  # 2 x P50 before the 100 ms wait
    assert scheduler.schedule(0.0139).is_empty
    plan = scheduler.schedule(0.0141)
    assert plan.stats.tail_marked == 1
    assert dict(plan.stats.admissions) == {"tail": 1}
    outputs = scheduler.update_from_output(plan, sampled_for(plan), 0.0141)
    timings = outputs[-1].timings
    assert timings is not None
    assert timings.tail_marked


def test_no_tail_marking_before_enough_wait_samples() -> None:
    scheduler = _tail_scheduler(tail_min_samples=5)
    scheduler.add_request(make_requests(1, arrival_s=0.010, start=4)[0])
    assert scheduler.next_deadline_s() == pytest.approx(0.110)
    plan = scheduler.schedule(0.050)
    assert plan.is_empty
    assert plan.stats.tail_marked == 0


def test_a_request_is_marked_once() -> None:
    scheduler = _tail_scheduler(tail_min_samples=4)
    add_all(scheduler, make_requests(2, max_new=5, arrival_s=0.010, start=4))
    # A cap of 1 keeps the second marked request waiting, marked, across steps.
    scheduler.set_window(make_window(target=1, cap=1, wait_ms=100))
    first, _ = step(scheduler, 0.020)
    assert first.stats.tail_marked == 2
    assert (first.stats.admitted_requests, dict(first.stats.admissions)) == (1, {"cap": 1})
    again, _ = step(scheduler, 0.030)
    assert again.stats.tail_marked == 0
    assert scheduler.waiting_ids() == ("r5",)


def test_a_lane_with_a_tail_marked_request_is_served_before_other_lanes() -> None:
    lanes = {"bulk": make_lane("bulk", target=1, cap=8, wait_ms=100, reserved=0)}
    scheduler = make_scheduler(target=1, cap=1, wait_ms=100, tail_min_samples=4, lanes=lanes)
    add_all(scheduler, make_requests(4, max_new=1, prefix="d"))
    for _ in range(4):  # global cap 1: one per step, each after a 2 ms wait -> default P50 = 2 ms
        step(scheduler, 0.002)
    assert not scheduler.has_unfinished
    scheduler.add_request(make_requests(1, arrival_s=0.010, lane="bulk", prefix="b")[0])
    scheduler.add_request(make_requests(1, arrival_s=0.010, prefix="d", start=4)[0])
    # Both lanes' triggers hold; named lanes go first unless another lane holds a tail-marked request.
    plan = scheduler.schedule(0.200)
    assert plan.stats.tail_marked == 1
    assert scheduler.running_ids() == ("d4",)
    assert scheduler.waiting_ids("bulk") == ("b0",)
