"""Factories for the window scheduler's tests: a scheduler with stated defaults, requests, and a fake
model that samples 1000 + the position (so a recompute samples the same token)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from batchpilot_runtime.contract.admin_api import LaneWindow
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import RequestOutput, SchedRequest, SchedulerConfig, StepPlan
from tests.support.factories import make_window


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
