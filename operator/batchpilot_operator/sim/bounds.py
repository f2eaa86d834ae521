"""What no batching policy can beat on a replay: a goodput ceiling and a per-request latency floor.

The benchmark checks its relative targets against these before blaming the policy. Both hold
for any window and any admission order on the simulator's engine:

* goodput counts the output tokens of requests that met the SLO, so no policy's goodput exceeds
  the output tokens offered over the same span (every request served within the SLO);
* a request's latency is at least what it takes on an otherwise idle engine: its prompt's
  prefill step(s) alone for TTFT, those plus one decode step per further token for e2e
  (a step shared with other sequences only costs more, since every cost coefficient is >= 0).
  Because each request's latency is at or above its own floor, every order statistic of the
  latencies is at or above the same order statistic of the floors: P99 included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from batchpilot_operator.api.profile import LatencyMetric
from batchpilot_operator.sim.metrics import exact_quantile
from batchpilot_runtime.replay.cost_model import CostModel, StepComposition
from batchpilot_runtime.replay.trace import TraceRequest


def prefill_floor_s(prompt_tokens: int, cost: CostModel, max_prefill_tokens_per_step: int | None = None) -> float:
    """Time to prefill ``prompt_tokens`` alone, in chunks of at most ``max_prefill_tokens_per_step``."""
    chunk = max_prefill_tokens_per_step or max(1, prompt_tokens)
    total, done = 0.0, 0
    while done < prompt_tokens:
        fed = min(chunk, prompt_tokens - done)
        total += cost.step_seconds(StepComposition(prefill_tokens=fed, decode_seqs=0, kv_tokens=done + fed))
        done += fed
    return total


def decode_floor_s(prompt_tokens: int, output_tokens: int, cost: CostModel) -> float:
    """Time for the decode steps after the first token, alone: step k reads prompt + k cached tokens."""
    steps = max(0, output_tokens - 1)
    kv_sum = steps * prompt_tokens + steps * (steps + 1) // 2
    return steps * (cost.fixed_s + cost.per_decode_seq_s) + cost.per_kv_token_s * kv_sum


def latency_floor_s(
    request: TraceRequest,
    cost: CostModel,
    metric: LatencyMetric,
    max_prefill_tokens_per_step: int | None = None,
) -> float:
    """The least latency ``request`` can have under any policy (queueWait: 0)."""
    if metric == LatencyMetric.QUEUE_WAIT:
        return 0.0
    ttft = prefill_floor_s(request.prompt_tokens, cost, max_prefill_tokens_per_step)
    if metric == LatencyMetric.TTFT:
        return ttft
    return ttft + decode_floor_s(request.prompt_tokens, max(1, request.output_tokens), cost)


def latency_floor_quantile_s(
    requests: Sequence[TraceRequest],
    cost: CostModel,
    metric: LatencyMetric,
    q: float,
    max_prefill_tokens_per_step: int | None = None,
) -> float:
    """The ``q`` quantile (nearest rank, as the benchmark's) of the per-request floors."""
    floors = sorted(latency_floor_s(r, cost, metric, max_prefill_tokens_per_step) for r in requests)
    return exact_quantile(floors, q)


def offered_tokens_per_s(requests: Sequence[TraceRequest], span_s: float) -> float:
    """Output tokens offered per second of the span: the goodput ceiling of every policy."""
    if span_s <= 0:
        return math.nan
    return sum(r.output_tokens for r in requests) / span_s
