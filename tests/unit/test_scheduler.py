"""Exact cases of the window scheduler, each named after the rule it pins."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest

from batchpilot_runtime.contract.admin_api import LaneWindow
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import (
    QueueFullError,
    RequestOutput,
    RequestRejected,
    SchedRequest,
    SchedulerConfig,
    SeqStatus,
    StepPlan,
)
from tests.support.factories import make_lane, make_window

# -- factories ---------------------------------------------------------------------------------


def make_scheduler(
    *,
    target: int = 4,
    cap: int = 8,
    wait_ms: int = 10,
    ratio: float = 2.0,
    blocks: int = 64,
    block_size: int = 4,
    budget: int | None = None,
    batching: str = "continuous",
    max_queue: int = 64,
    max_model_len: int = 4096,
    tail_min_samples: int = 20,
    wait_p50_samples: int = 256,
    watermark: float = 0.0,
    lanes: Mapping[str, LaneWindow] | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        num_kv_blocks=blocks,
        kv_block_size=block_size,
        max_model_len=max_model_len,
        max_prefill_tokens_per_step=budget,
        max_queue=max_queue,
        batching=batching,  # type: ignore[arg-type]
        wait_p50_samples=wait_p50_samples,
        tail_min_samples=tail_min_samples,
        kv_watermark_fraction=watermark,
    )
    return Scheduler(config, make_window(target=target, cap=cap, wait_ms=wait_ms, ratio=ratio), lanes)


def make_requests(
    n: int,
    prompt_tokens: int = 4,
    max_new: int = 4,
    *,
    arrival_s: float = 0.0,
    spacing_s: float = 0.0,
    lane: str = "default",
    prefix: str = "r",
    start: int = 0,
) -> list[SchedRequest]:
    return [
        SchedRequest(
            request_id=f"{prefix}{start + i}",
            prompt_token_ids=tuple(range(1, prompt_tokens + 1)),
            max_new_tokens=max_new,
            arrival_s=arrival_s + i * spacing_s,
            lane=lane,
        )
        for i in range(n)
    ]


def add_all(scheduler: Scheduler, requests: Sequence[SchedRequest]) -> None:
    for request in requests:
        scheduler.add_request(request)


def sampled_for(plan: StepPlan) -> dict[str, int]:
    """A fake model: the sampled token is 1000 + its position, so a recompute samples the same token."""
    return {seq.request_id: 1000 + seq.start_pos + len(seq.token_ids) for seq in plan.seqs if seq.sample}


def step(scheduler: Scheduler, now_s: float) -> tuple[StepPlan, list[RequestOutput]]:
    plan = scheduler.schedule(now_s)
    return plan, scheduler.update_from_output(plan, sampled_for(plan), now_s)


def chunks(plan: StepPlan) -> list[tuple[str, int, int, bool, bool]]:
    return [(s.request_id, s.start_pos, len(s.token_ids), s.sample, s.is_prefill) for s in plan.seqs]


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


# -- chunked prefill -----------------------------------------------------------------------------


def test_prompts_are_split_under_the_prefill_budget() -> None:
    scheduler = make_scheduler(target=3, budget=8)
    for i, prompt_tokens in enumerate((10, 3, 7)):
        scheduler.add_request(make_requests(1, prompt_tokens, max_new=3, start=i)[0])
    expected = [
        [("r0", 0, 8, False, True)],
        [("r0", 8, 2, True, True), ("r1", 0, 3, True, True), ("r2", 0, 3, False, True)],
        # decodes first and outside the budget; r2 finishes its prompt
        [("r0", 10, 1, True, False), ("r1", 3, 1, True, False), ("r2", 3, 4, True, True)],
        [("r0", 11, 1, True, False), ("r1", 4, 1, True, False), ("r2", 7, 1, True, False)],
        [("r2", 8, 1, True, False)],
    ]
    for i, want in enumerate(expected):
        plan, _ = step(scheduler, float(i))
        assert chunks(plan) == want, f"step {i}"
    assert not scheduler.has_unfinished


def test_without_a_budget_whole_prompts_run_in_one_step() -> None:
    scheduler = make_scheduler(target=2)
    add_all(scheduler, make_requests(2, prompt_tokens=50, max_new=2))
    plan, _ = step(scheduler, 0.0)
    assert chunks(plan) == [("r0", 0, 50, True, True), ("r1", 0, 50, True, True)]
    assert plan.stats.num_prefill_tokens == 100
    assert plan.stats.num_prefill_seqs == 2


def test_the_window_budget_applies_from_the_next_step_and_overrides_the_pods_own() -> None:
    scheduler = make_scheduler(target=1, budget=30)
    scheduler.add_request(make_requests(1, prompt_tokens=100, max_new=2)[0])
    plan, _ = step(scheduler, 0.0)
    assert chunks(plan) == [("r0", 0, 30, False, True)]  # the pod's start-up budget
    scheduler.set_window(make_window(target=1, cap=8, wait_ms=10, prefill=8, generation=1))
    assert scheduler.prefill_budget_tokens == 30  # staged, not yet in force
    plan, _ = step(scheduler, 1.0)
    assert chunks(plan) == [("r0", 30, 8, False, True)]
    assert scheduler.prefill_budget_tokens == 8
    # A window that leaves the budget unset falls back to the pod's budget.
    scheduler.set_window(make_window(target=1, cap=8, wait_ms=10, generation=2))
    plan, _ = step(scheduler, 2.0)
    assert chunks(plan) == [("r0", 38, 30, False, True)]


def test_a_window_budget_on_a_pod_without_one_chunks_prompts_and_decodes_stay_outside_it() -> None:
    scheduler = make_scheduler(target=2)
    assert scheduler.prefill_budget_tokens is None
    scheduler.set_window(make_window(target=2, cap=8, wait_ms=10, prefill=6, generation=1))
    add_all(scheduler, make_requests(2, prompt_tokens=4, max_new=3))
    plan, _ = step(scheduler, 0.0)
    assert chunks(plan) == [("r0", 0, 4, True, True), ("r1", 0, 2, False, True)]
    plan, _ = step(scheduler, 1.0)
    assert chunks(plan) == [("r0", 4, 1, True, False), ("r1", 2, 2, True, True)]


def test_admissions_stop_when_the_step_has_no_prompt_budget_left() -> None:
    # As vLLM does: a request admitted with no budget left would hold a slot and its KV while it
    # waits for a chunk, and count as running instead of queued.
    scheduler = make_scheduler(target=3, cap=8, wait_ms=0, budget=100, blocks=256)
    add_all(scheduler, make_requests(3, prompt_tokens=80, max_new=2))
    plan, _ = step(scheduler, 0.0)
    assert chunks(plan) == [("r0", 0, 80, True, True), ("r1", 0, 20, False, True)]
    assert (plan.stats.running, plan.stats.queue_depth, plan.stats.admitted_requests) == (2, 1, 2)
    plan, _ = step(scheduler, 1.0)
    # Running sequences first (r0 decodes, r1 finishes its prompt), then r2 with what is left.
    assert chunks(plan) == [("r0", 80, 1, True, False), ("r1", 20, 60, True, True), ("r2", 0, 40, False, True)]
    assert (plan.stats.queue_depth, plan.stats.admitted_requests) == (0, 1)


def test_static_batching_admits_its_whole_group_whatever_the_budget() -> None:
    scheduler = make_scheduler(target=3, cap=8, wait_ms=0, budget=100, blocks=256, batching="static")
    add_all(scheduler, make_requests(3, prompt_tokens=80, max_new=2))
    plan, _ = step(scheduler, 0.0)
    assert (plan.stats.running, plan.stats.queue_depth) == (3, 0)


def test_a_step_budget_rule_lowers_the_budget_to_what_fits_after_the_decodes() -> None:
    scheduler = make_scheduler(target=1, cap=4, budget=100)
    seen: list[tuple[int, int]] = []

    def rule(decodes: int, kv_tokens: int) -> float:
        seen.append((decodes, kv_tokens))
        return 12 - 4 * decodes

    scheduler.set_step_budget_rule(rule)
    scheduler.add_request(make_requests(1, prompt_tokens=5, max_new=4)[0])
    plan, _ = step(scheduler, 0.0)
    assert chunks(plan) == [("r0", 0, 5, True, True)]  # nothing decodes: the window's budget alone
    assert seen == []
    scheduler.add_request(make_requests(1, prompt_tokens=30, max_new=2, start=1)[0])
    plan, _ = step(scheduler, 1.0)
    assert chunks(plan) == [("r0", 5, 1, True, False), ("r1", 0, 8, False, True)]  # 12 - 4 x 1 decode
    assert seen == [(1, 6)]  # one decode, whose KV holds 5 prompt tokens + the token it feeds


def test_chunks_carry_the_prompt_tokens_and_the_whole_block_table() -> None:
    scheduler = make_scheduler(target=1, budget=3, block_size=4)
    scheduler.add_request(SchedRequest("a", (5, 6, 7, 8, 9), 2, 0.0))
    first = scheduler.schedule(0.0)
    assert first.seqs[0].token_ids == (5, 6, 7)
    assert len(first.seqs[0].block_table) == 2  # the whole prompt's blocks at admission
    scheduler.update_from_output(first, {}, 0.0)
    second = scheduler.schedule(0.1)
    assert second.seqs[0].token_ids == (8, 9)
    assert second.seqs[0].start_pos == 3
    assert second.seqs[0].sample


# -- preemption ----------------------------------------------------------------------------------


def test_preemption_takes_the_youngest_and_recomputes_prompt_plus_generated() -> None:
    # 4 blocks of 2 tokens. Two 2-token prompts decode until the 5th token needs a 3rd block each.
    scheduler = make_scheduler(target=2, cap=2, blocks=4, block_size=2)
    scheduler.add_request(SchedRequest("old", (1, 2), 5, 0.0))
    scheduler.add_request(SchedRequest("young", (3, 4), 5, 0.0))
    for t in range(3):
        plan, _ = step(scheduler, float(t))
        assert plan.preempted == ()
    plan, _ = step(scheduler, 3.0)
    assert plan.preempted == ("young",)
    assert plan.stats.preempted == 1
    assert [s.request_id for s in plan.seqs] == ["old"]
    assert scheduler.status_of("young") is SeqStatus.WAITING
    assert scheduler.waiting_ids() == ("young",)
    assert scheduler.kv.block_table("young") == ()
    # "old" finishes at step 4 (5 tokens) and frees its blocks; "young" is resumed at step 5.
    _, outputs = step(scheduler, 4.0)
    assert [o.finish_reason for o in outputs] == ["length"]
    plan, outputs = step(scheduler, 5.0)
    (recompute,) = plan.seqs
    assert recompute.request_id == "young"
    assert recompute.token_ids == (3, 4, 1002, 1003, 1004)  # prompt + the 3 tokens generated before
    assert (recompute.start_pos, recompute.sample, recompute.is_prefill) == (0, True, True)
    assert plan.stats.admitted_requests == 0  # a resume is not a new admission
    assert outputs[0].token_id == 1005
    _, outputs = step(scheduler, 6.0)
    timings = outputs[0].timings
    assert outputs[0].finish_reason == "length"
    assert timings is not None
    assert (timings.preemptions, timings.output_tokens, timings.first_admitted_s) == (1, 5, 0.0)


def test_an_older_sequence_needing_a_block_preempts_the_youngest() -> None:
    scheduler = make_scheduler(target=1, cap=2, blocks=3, block_size=2)
    scheduler.add_request(SchedRequest("a", (1, 2, 3), 3, 0.0))  # 2 blocks
    step(scheduler, 0.0)
    scheduler.add_request(SchedRequest("b", (1,), 3, 0.0))  # 1 block
    step(scheduler, 1.0)  # a decodes at pos 3 (fits its 2 blocks), b joins and prefills
    plan, _ = step(scheduler, 2.0)  # a needs a 3rd block at pos 4: b, the youngest, goes
    assert plan.preempted == ("b",)
    assert [s.request_id for s in plan.seqs] == ["a"]


def test_the_youngest_needing_a_block_preempts_itself() -> None:
    scheduler = make_scheduler(target=2, cap=2, blocks=3, block_size=2)
    scheduler.add_request(SchedRequest("old", (1, 2, 3), 2, 0.0))  # 2 blocks, enough for its whole life
    scheduler.add_request(SchedRequest("young", (1, 2), 2, 0.0))  # 1 block, needs a 2nd at pos 2
    step(scheduler, 0.0)
    plan, outputs = step(scheduler, 1.0)
    assert plan.preempted == ("young",)
    assert [s.request_id for s in plan.seqs] == ["old"]
    assert [o.finish_reason for o in outputs] == ["length"]
    plan, _ = step(scheduler, 2.0)
    assert chunks(plan) == [("young", 0, 3, True, True)]


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(target=2, cap=4, blocks=4, block_size=2)
    scheduler.add_request(SchedRequest("old", (1, 2), 5, 0.0))
    scheduler.add_request(SchedRequest("young", (3, 4), 5, 0.0))
    for t in range(3):
        step(scheduler, float(t))
    scheduler.add_request(SchedRequest("new", (1,), 1, 2.5))
    plan = scheduler.schedule(3.0)
    assert plan.preempted == ("young",)
    assert plan.stats.admitted_requests == 0
    assert scheduler.status_of("new") is SeqStatus.WAITING


def test_preempted_requests_go_before_fresh_ones_of_their_lane() -> None:
    scheduler = make_scheduler(target=1, cap=2, blocks=4, block_size=2)
    scheduler.add_request(SchedRequest("old", (1, 2), 5, 0.0))
    scheduler.add_request(SchedRequest("young", (3, 4), 5, 0.0))
    for t in range(4):
        step(scheduler, float(t))
    scheduler.add_request(SchedRequest("fresh", (9,), 1, 3.5))
    assert scheduler.waiting_ids() == ("young", "fresh")


# -- static mode ---------------------------------------------------------------------------------


def test_static_batch_runs_to_completion_before_the_next_is_admitted() -> None:
    scheduler = make_scheduler(target=2, cap=4, wait_ms=0, batching="static")
    add_all(scheduler, make_requests(2, max_new=3))
    plan, _ = step(scheduler, 0.0)
    assert plan.stats.admitted_requests == 2
    scheduler.add_request(make_requests(1, max_new=3, arrival_s=0.5, start=2)[0])
    for t in (1.0, 2.0):
        plan, outputs = step(scheduler, t)
        assert plan.stats.admitted_requests == 0
        assert scheduler.status_of("r2") is SeqStatus.WAITING
    assert [o.finish_reason for o in outputs] == ["length", "length"]
    plan = scheduler.schedule(3.0)
    assert plan.stats.admitted_requests == 1
    assert dict(plan.stats.admissions) == {"wait": 1}


def test_static_batch_is_formed_by_the_same_target_rule() -> None:
    scheduler = make_scheduler(target=3, cap=4, wait_ms=1000, batching="static")
    add_all(scheduler, make_requests(2))
    assert scheduler.schedule(0.0).stats.admitted_requests == 0
    scheduler.add_request(make_requests(1, start=2)[0])
    plan = scheduler.schedule(0.1)
    assert (plan.stats.admitted_requests, dict(plan.stats.admissions)) == (3, {"target": 1})


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


# -- requests in and out ---------------------------------------------------------------------------


def test_abort_of_a_running_request_frees_its_kv() -> None:
    scheduler = make_scheduler(target=1)
    add_all(scheduler, make_requests(1, prompt_tokens=9, max_new=5))
    step(scheduler, 0.0)
    assert scheduler.kv_usage_ratio > 0
    output = scheduler.abort("r0", 1.0)
    assert output is not None
    assert output.finish_reason == "cancelled"
    assert output.token_id is None
    assert output.timings is not None
    assert output.timings.output_tokens == 1
    assert scheduler.kv_usage_ratio == 0.0
    assert scheduler.num_running == 0
    assert scheduler.abort("r0", 1.0) is None


def test_abort_of_a_waiting_request_removes_it_from_the_queue() -> None:
    scheduler = make_scheduler(target=5, wait_ms=1000)
    add_all(scheduler, make_requests(3))
    output = scheduler.abort("r1", 0.5)
    assert output is not None
    assert output.timings is not None
    assert output.timings.first_admitted_s is None
    assert scheduler.waiting_ids() == ("r0", "r2")
    assert scheduler.num_waiting == 2


def test_a_request_aborted_between_schedule_and_update_is_skipped() -> None:
    scheduler = make_scheduler(target=2)
    add_all(scheduler, make_requests(2))
    plan = scheduler.schedule(0.0)
    scheduler.abort("r0", 0.0)
    outputs = scheduler.update_from_output(plan, sampled_for(plan), 0.0)
    assert [o.request_id for o in outputs] == ["r1"]


def test_stop_token_finishes_with_stop_and_max_new_tokens_with_length() -> None:
    scheduler = make_scheduler(target=2)
    scheduler.add_request(SchedRequest("s", (1, 2), 10, 0.0, stop_token_ids=frozenset({1003})))
    scheduler.add_request(SchedRequest("l", (1, 2), 2, 0.0))
    _, first = step(scheduler, 0.0)
    assert [(o.request_id, o.token_id, o.finish_reason) for o in first] == [("s", 1002, None), ("l", 1002, None)]
    _, second = step(scheduler, 1.0)
    assert [(o.request_id, o.token_id, o.finish_reason) for o in second] == [("s", 1003, "stop"), ("l", 1003, "length")]
    timings = second[1].timings
    assert timings is not None
    assert (timings.arrival_s, timings.first_admitted_s, timings.first_token_s, timings.finished_s) == (
        0.0,
        0.0,
        0.0,
        1.0,
    )
    assert (timings.prompt_tokens, timings.output_tokens, timings.lane) == (2, 2, "default")
    assert timings.ttft_s == 0.0
    assert timings.e2e_s == 1.0


def test_finish_ends_a_request_for_an_outside_reason() -> None:
    scheduler = make_scheduler(target=1)
    add_all(scheduler, make_requests(1))
    step(scheduler, 0.0)
    output = scheduler.finish("r0", "stop", 0.5)
    assert output is not None
    assert output.finish_reason == "stop"
    assert not scheduler.has_unfinished
    with pytest.raises(ValueError, match="reason"):
        scheduler.finish("r0", "bored", 0.5)


def test_missing_sampled_token_is_an_error_naming_the_request() -> None:
    scheduler = make_scheduler(target=1)
    add_all(scheduler, make_requests(1))
    plan = scheduler.schedule(0.0)
    with pytest.raises(ValueError, match="r0"):
        scheduler.update_from_output(plan, {}, 0.0)


def test_queue_full_raises_with_a_retry_after() -> None:
    scheduler = make_scheduler(target=8, wait_ms=1000, max_queue=2)
    add_all(scheduler, make_requests(2))
    with pytest.raises(QueueFullError) as raised:
        scheduler.add_request(make_requests(1, start=2)[0])
    assert raised.value.retry_after_s == 1.0  # no admission rate yet: 1 s
    assert scheduler.num_waiting == 2


def test_retry_after_follows_the_admission_rate() -> None:
    scheduler = make_scheduler(target=1, cap=1, wait_ms=0, max_queue=20)
    for i in range(5):  # one admission every 0.5 s
        scheduler.add_request(make_requests(1, max_new=1, start=i)[0])
        step(scheduler, 0.5 * i)
    add_all(scheduler, make_requests(20, start=10))
    with pytest.raises(QueueFullError) as raised:
        scheduler.add_request(make_requests(1, start=40)[0])
    assert raised.value.retry_after_s == pytest.approx(2 * 0.5)  # a tenth of 20 at 2 per second


@pytest.mark.parametrize(
    ("prompt_tokens", "max_new", "field"),
    [
        (0, 4, "prompt_token_ids"),
        (4, 0, "max_new_tokens"),
        (100, 1, "prompt_token_ids"),  # prompt alone reaches max_model_len 100
        (60, 41, "max_new_tokens"),  # 101 > max_model_len
        (60, 30, "max_new_tokens"),  # 89 tokens in KV > 80
    ],
)
def test_requests_that_can_never_fit_are_rejected_naming_the_field(
    prompt_tokens: int, max_new: int, field: str
) -> None:
    scheduler = make_scheduler(blocks=20, block_size=4, max_model_len=100)
    request = SchedRequest("x", tuple(range(prompt_tokens)), max_new, 0.0)
    with pytest.raises(RequestRejected, match=field) as raised:
        scheduler.add_request(request)
    assert raised.value.field == field
    assert not scheduler.has_unfinished


def test_a_request_filling_the_kv_exactly_is_accepted() -> None:
    scheduler = make_scheduler(target=1, blocks=20, block_size=4, max_model_len=100)
    scheduler.add_request(SchedRequest("x", tuple(range(60)), 21, 0.0))  # 80 tokens in KV
    for t in range(30):
        step(scheduler, float(t))
    assert not scheduler.has_unfinished


def test_duplicate_and_unknown_lane_requests_are_rejected() -> None:
    scheduler = make_scheduler()
    add_all(scheduler, make_requests(1))
    with pytest.raises(RequestRejected, match="request_id"):
        scheduler.add_request(make_requests(1)[0])
    with pytest.raises(RequestRejected, match="lane"):
        scheduler.add_request(make_requests(1, lane="nope", start=5)[0])


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_prefill_tokens_per_step": 0}, "max_prefill_tokens_per_step"),
        ({"batching": "dynamic"}, "batching"),
        ({"tail_min_samples": 300}, "tail_min_samples"),
        ({"kv_watermark_fraction": 1.0}, "kv_watermark_fraction"),
    ],
)
def test_bad_config_names_the_field(overrides: dict[str, object], field: str) -> None:
    values: dict[str, object] = {"num_kv_blocks": 8, **overrides}
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**values)  # type: ignore[arg-type]
