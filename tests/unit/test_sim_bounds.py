"""The benchmark's reachability bounds: exact for a lone request, never beaten by any window."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot_operator.api.profile import LatencyMetric
from batchpilot_operator.sim.bounds import (
    decode_floor_s,
    latency_floor_quantile_s,
    latency_floor_s,
    offered_tokens_per_s,
    prefill_floor_s,
)
from batchpilot_operator.sim.metrics import summarize
from batchpilot_operator.sim.simulator import SimConfig, Simulator, scheduler_config_for
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import A100_LLAMA2_7B, UNIT, CostModel
from batchpilot_runtime.replay.trace import TraceRequest

METRICS = (LatencyMetric.TTFT, LatencyMetric.E2E, LatencyMetric.QUEUE_WAIT)


def run_alone(request: TraceRequest, cost: CostModel, chunk: int | None = None) -> Simulator:
    config = SimConfig(
        cost=cost,
        scheduler=scheduler_config_for(cost, max_prefill_tokens_per_step=chunk),
        slo_p99_s=1.0,
    )
    return Simulator([request], Window(target_batch_size=1, hard_cap=4, max_wait_ms=0), config)


def test_hand_computed_floors_with_the_unit_cost() -> None:
    # UNIT: 10 ms per step + 1 ms per prompt token + 1 ms per decoding sequence, nothing per KV token.
    assert prefill_floor_s(10, UNIT) == pytest.approx(0.020)
    # Chunks of 4: steps of 4, 4 and 2 tokens, each paying the fixed 10 ms.
    assert prefill_floor_s(10, UNIT, max_prefill_tokens_per_step=4) == pytest.approx(0.040)
    # Two more tokens after the first: two decode steps of 11 ms.
    assert decode_floor_s(10, 3, UNIT) == pytest.approx(0.022)
    assert decode_floor_s(10, 1, UNIT) == 0.0
    request = TraceRequest(0.0, 10, 3)
    assert latency_floor_s(request, UNIT, LatencyMetric.TTFT) == pytest.approx(0.020)
    assert latency_floor_s(request, UNIT, LatencyMetric.E2E) == pytest.approx(0.042)
    assert latency_floor_s(request, UNIT, LatencyMetric.QUEUE_WAIT) == 0.0


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize(("prompt", "output"), [(1, 1), (37, 5), (700, 40)])
def test_a_lone_request_meets_its_floor_exactly(prompt: int, output: int, chunk: int | None) -> None:
    # The KV coefficient matters here: A100's per-KV-token cost checks the decode sum's arithmetic.
    request = TraceRequest(0.0, prompt, output)
    (record,) = run_alone(request, A100_LLAMA2_7B, chunk).run().records
    for metric in METRICS:
        assert record.latency_s(metric) == pytest.approx(latency_floor_s(request, A100_LLAMA2_7B, metric, chunk))


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[TraceRequest], Window]:
    gaps = draw(st.lists(st.floats(0.0, 0.05), min_size=1, max_size=40))
    arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    requests = [TraceRequest(t, draw(st.integers(1, 300)), draw(st.integers(1, 30))) for t in arrivals]
    target = draw(st.integers(1, 16))
    window = Window(
        target_batch_size=target,
        hard_cap=draw(st.integers(target, 32)),
        max_wait_ms=draw(st.sampled_from([0, 5, 50])),
    )
    return requests, window


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_no_window_beats_the_floor(workload: tuple[list[TraceRequest], Window]) -> None:
    requests, window = workload
    config = SimConfig(cost=A100_LLAMA2_7B, scheduler=scheduler_config_for(A100_LLAMA2_7B), slo_p99_s=1.0)
    result = Simulator(requests, window, config).run()
    for metric in METRICS:
        for request, record in zip(requests, result.records, strict=True):
            # Float sums in a different order: allow a rounding error, nothing more.
            assert record.latency_s(metric) >= latency_floor_s(request, A100_LLAMA2_7B, metric) - 1e-9
        p99 = summarize(result, 1.0, metric)["p99_s"]
        assert p99 >= latency_floor_quantile_s(requests, A100_LLAMA2_7B, metric, 0.99) - 1e-9
    summary = summarize(result, 1.0, LatencyMetric.TTFT)
    if result.trace_span_s > 0:
        assert summary["goodput_tokens_per_s"] <= offered_tokens_per_s(requests, result.trace_span_s) + 1e-9


def test_offered_tokens_need_a_span() -> None:
    assert math.isnan(offered_tokens_per_s([TraceRequest(0.0, 5, 5)], 0.0))
    assert offered_tokens_per_s([TraceRequest(0.0, 5, 5), TraceRequest(2.0, 5, 3)], 2.0) == 4.0
