"""The load generator's pure parts (plans, percentiles, summaries) and ``run_load`` over a mock transport."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest

from batchpilot_runtime.replay.loadgen import (
    Endpoint,
    LatencyStats,
    RequestResult,
    percentile,
    plan_requests,
    run_load,
    summarize,
)
from batchpilot_runtime.replay.trace import TraceRequest, TraceScaling


def make_trace(n: int, gap_s: float = 0.01, prompt: int = 5, output: int = 3) -> list[TraceRequest]:
    return [TraceRequest(arrival_s=i * gap_s, prompt_tokens=prompt + i, output_tokens=output) for i in range(n)]


def make_result(
    index: int, outcome: str = "completed", e2e_s: float | None = 1.0, endpoint: int = 0, output_tokens: int = 10
) -> RequestResult:
    return RequestResult(
        index,
        endpoint,
        outcome,
        200 if outcome == "completed" else 429,
        5,
        output_tokens if outcome == "completed" else 0,
        0.1 if e2e_s else None,
        e2e_s,
        0.0,
    )


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("http://127.0.0.1:8000", Endpoint("http://127.0.0.1:8000")),
        ("http://h:1/,model=chat", Endpoint("http://h:1", model="chat")),
        ("https://h,model=a,lane=critical", Endpoint("https://h", model="a", lane="critical")),
    ],
)
def test_endpoint_parse(spec: str, expected: Endpoint) -> None:
    assert Endpoint.parse(spec) == expected


@pytest.mark.parametrize("spec", ["127.0.0.1:8000", "http://h,colour=red", "http://h,model=", "http://h,model"])
def test_endpoint_parse_refuses_with_the_reason(spec: str) -> None:
    with pytest.raises(ValueError, match="--endpoint"):
        Endpoint.parse(spec)


def test_plan_is_deterministic_and_sized_by_the_trace() -> None:
    trace = make_trace(5)
    first = plan_requests(trace, 1, seed=7)
    assert first == plan_requests(trace, 1, seed=7)
    assert first != plan_requests(trace, 1, seed=8)
    assert [len(p.prompt_token_ids) for p in first] == [5, 6, 7, 8, 9]
    assert [p.max_tokens for p in first] == [3] * 5
    assert all(32 <= t < 127 for p in first for t in p.prompt_token_ids)


def test_fanout_each_sends_the_same_prompts_to_every_endpoint() -> None:
    plan = plan_requests(make_trace(3), 2, fanout="each")
    assert len(plan) == 6
    by_endpoint = [[p.prompt_token_ids for p in plan if p.endpoint == e] for e in (0, 1)]
    assert by_endpoint[0] == by_endpoint[1]
    assert [p.send_at_s for p in plan] == sorted(p.send_at_s for p in plan)


def test_fanout_round_robin_spreads_the_trace() -> None:
    plan = plan_requests(make_trace(5), 2, fanout="round-robin")
    assert [p.endpoint for p in plan] == [0, 1, 0, 1, 0]


def test_plan_refuses_a_bad_token_range() -> None:
    with pytest.raises(ValueError, match="token_id_range"):
        plan_requests(make_trace(1), 1, token_id_range=(10, 10))


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99.9) == 3.0
    with pytest.raises(ValueError, match="q must"):
        percentile(values, 101)


def test_latency_stats_of_nothing_is_none_not_zero() -> None:
    assert LatencyStats.of([]).p99_s is None


def test_summary_counts_outcomes_and_throughput() -> None:
    results = [
        make_result(0),
        make_result(1, e2e_s=3.0),
        make_result(2, "rejected_429", e2e_s=None),
        make_result(3, endpoint=1),
    ]
    summary = summarize(results, 2.0, [Endpoint("http://a"), Endpoint("http://b")], {"time_scale": 2.0})
    assert summary.outcomes["completed"] == 3
    assert summary.outcomes["rejected_429"] == 1
    assert summary.throughput.output_tokens_per_s == pytest.approx(30 / 2.0)
    assert summary.throughput.requests_per_s == pytest.approx(2.0)
    assert summary.e2e.count == 3
    assert summary.e2e.max_s == 3.0
    assert summary.endpoints[1]["requests"] == 1
    data = json.loads(summary.to_json())
    assert "results" not in data
    assert data["scaling"] == {"time_scale": 2.0}
    assert len(json.loads(summary.to_json(include_results=True))["results"]) == 4


def _sse(*payloads: object) -> bytes:
    return b"".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n".encode() for p in payloads)


def fake_runtime(request: httpx.Request) -> httpx.Response:
    """Answers like a runtime: /v1/models, 429 for long prompts, SSE streams otherwise."""
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
    body = json.loads(request.content)
    assert body["model"] == "fake-model"
    assert body["stream"] is True
    if len(body["prompt"]) >= 8:
        return httpx.Response(429, headers={"Retry-After": "1"}, json={"error": {"message": "full"}})
    if len(body["prompt"]) == 7:
        return httpx.Response(200, content=_sse({"choices": [{"text": "a", "finish_reason": None}]}))  # no [DONE]
    chunks = [{"choices": [{"text": "x", "finish_reason": None}]} for _ in range(body["max_tokens"])]
    usage = {
        "choices": [],
        "usage": {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": body["max_tokens"],
            "total_tokens": len(body["prompt"]) + body["max_tokens"],
        },
    }
    return httpx.Response(200, content=_sse(*chunks, usage, "[DONE]"), headers={"content-type": "text/event-stream"})


async def test_run_load_over_a_mock_transport() -> None:
    seen: list[RequestResult] = []
    trace = make_trace(5, gap_s=0.005)  # prompts of 5..9 tokens
    summary = await run_load(
        ["http://fake"],
        trace,
        transport=httpx.MockTransport(fake_runtime),
        scaling=TraceScaling(time_scale=3.0),
        on_result=seen.append,
        notes={"rate": 1.5},
    )
    assert summary.requests_sent == 5
    assert summary.outcomes["completed"] == 2
    assert summary.outcomes["incomplete"] == 1
    assert summary.outcomes["rejected_429"] == 2
    assert summary.output_tokens == 2 * 3
    assert summary.ttft.count == 2
    assert summary.e2e.p50_s is not None
    assert summary.scaling["time_scale"] == 3.0
    assert summary.scaling["rate"] == 1.5
    assert "tokens x1" in summary.scaling["description"]
    assert summary.endpoints[0]["model"] == "fake-model"
    assert sorted(r.index for r in seen) == list(range(5))


async def test_run_load_reports_transport_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        raise httpx.ConnectError("connection refused", request=request)

    summary = await run_load(["http://down"], make_trace(2), transport=httpx.MockTransport(refuse))
    assert summary.outcomes["transport_error"] == 2
    assert summary.ttft.p99_s is None


async def test_run_load_names_an_endpoint_without_models() -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="boom")

    with pytest.raises(ValueError, match="http://broken"):
        await run_load(["http://broken"], make_trace(1), transport=httpx.MockTransport(broken))


def test_the_inter_token_gaps_of_completed_requests_are_summarized_together() -> None:
    results = [
        replace(make_result(0), inter_token_s=(0.01, 0.03)),
        replace(make_result(1), inter_token_s=(0.02,)),
        replace(make_result(2, outcome="rejected_429"), inter_token_s=(9.0,)),  # not completed: not counted
    ]
    summary = summarize(results, 1.0, [Endpoint("http://a")])
    assert summary.inter_token.count == 3
    assert summary.inter_token.p50_s == pytest.approx(0.02)
    assert summary.inter_token.max_s == pytest.approx(0.03)
