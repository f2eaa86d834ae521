"""Exact cases of the window scheduler's steps: chunked prefill under the prompt budget, preemption and
recompute, and static batching; each named after the rule it pins."""

from __future__ import annotations

from batchpilot_runtime.scheduling.types import (
    SchedRequest,
    SeqStatus,
)
from tests.support.factories import make_window
from tests.support.scheduler_factories import add_all, chunks, make_requests, make_scheduler, step

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
