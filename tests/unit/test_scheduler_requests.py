"""Exact cases of the window scheduler's requests in and out: aborts, finishes, the queue's limits and
the refusals that name a field; each named after the rule it pins."""

from __future__ import annotations

import pytest

from batchpilot_runtime.scheduling.types import (
    QueueFullError,
    RequestRejected,
    SchedRequest,
    SchedulerConfig,
)
from tests.support.scheduler_factories import add_all, make_requests, make_scheduler, sampled_for, step

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
