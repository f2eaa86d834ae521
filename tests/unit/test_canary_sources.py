"""Per-pod latency for canaries from both metric sources: the Prometheus query and its parser, and the
scraping source's per-pod figures from the scrapes it already took."""

from __future__ import annotations

import httpx
import pytest

from batchpilot_operator.io.promql import build_pod_query, build_queries, parse_pod_results
from batchpilot_operator.io.scrape import ScrapeSource
from batchpilot_operator.tuning.model_metrics import to_observations
from tests.integration.fake_admin import render_metrics


def test_the_pod_query_groups_by_pod_and_reads_only_the_canary_models() -> None:
    query = build_pod_query(60, ["chat", "llama-3.1"], "namespace", "pod")
    assert "sum by (namespace, model, pod, le) (rate(batchpilot_ttft_seconds_bucket" in query
    assert '{model=~"chat|llama-3\\\\.1"}' in query  # RE2's \. inside a PromQL string
    assert "histogram_quantile(0.99," in query and "histogram_quantile(0.5," not in query
    assert "batchpilot_inter_token_seconds_bucket" in query
    # Without a namespace label (local mode) it groups by model and pod, like the model-wide queries.
    assert "sum by (model, pod, le)" in build_pod_query(60, ["chat"], None, "pod")
    # The model-wide queries are untouched: three, grouped by namespace and model.
    assert len(build_queries(60)) == 3 and ", pod" not in " ".join(build_queries(60).values())


def sample(pod: str, series: str, value: str, **labels: str) -> dict[str, object]:
    metric = {"namespace": "ml", "model": "chat", "pod": pod, "bp_series": series, **labels}
    return {"metric": metric, "value": [0, value]}


def test_the_pod_answer_is_read_per_pod_by_the_model_wide_parser() -> None:
    answer = [
        sample("chat-0", "ttft", "0.3", bp_quantile="0.99"),
        sample("chat-0", "ttft_count", "2"),
        sample("chat-1", "ttft", "1.2", bp_quantile="0.99"),
        sample("chat-1", "ttft_count", "3"),
        sample("chat-1", "interToken", "0.04", bp_quantile="0.99"),
        sample("chat-1", "interToken_count", "300"),
        sample("chat-2", "ttft", "NaN", bp_quantile="0.99"),  # no traffic: no figure, not zero
        {"metric": {"namespace": "ml", "model": "chat", "bp_series": "ttft"}, "value": [0, "9"]},  # no pod label
    ]
    per_pod = parse_pod_results(answer, 60.0)
    assert sorted(per_pod[("ml", "chat")]) == ["chat-0", "chat-1"]  # chat-2: NaN, no figure (not zero)
    obs = {pod: to_observations(m, "ttft", 0.0) for pod, m in per_pod[("ml", "chat")].items()}
    assert obs["chat-0"].p99_s == pytest.approx(0.3) and obs["chat-0"].samples == pytest.approx(120)
    assert obs["chat-1"].p99_s == pytest.approx(1.2) and obs["chat-1"].itl_p99_s == pytest.approx(0.04)


async def test_the_scraping_source_gives_each_pods_figures_from_the_scrapes_it_took() -> None:
    served = {"pod-a": 0, "pod-b": 0}
    latency = {"pod-a": 0.2, "pod-b": 1.5}
    clock = [0.0]

    def handle(request: httpx.Request) -> httpx.Response:
        pod = request.url.host
        served[pod] += 100
        return httpx.Response(200, text=render_metrics("chat", latency[pod], served[pod]))

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    source = ScrapeSource(rate_window_s=30.0, client=client, clock=lambda: clock[0])
    urls = {"pod-a": "http://pod-a/metrics", "pod-b": "http://pod-b/metrics"}
    try:
        for at in (0.0, 10.0):
            clock[0] = at
            await source.collect({("ml", "chat"): list(urls.values())})
        scrapes = source.scrapes_total
        per_pod = await source.collect_pods({("ml", "chat"): urls})
    finally:
        await client.aclose()
    assert source.scrapes_total == scrapes  # no scrape of its own
    obs = {pod: to_observations(m, "ttft", 10.0) for pod, m in per_pod[("ml", "chat")].items()}
    assert 0.2 <= obs["pod-a"].p99_s <= 0.2 * 1.2 and 1.5 <= obs["pod-b"].p99_s <= 1.5 * 1.2  # one bucket up
    assert obs["pod-a"].samples == pytest.approx(100) and per_pod[("ml", "chat")]["pod-a"].window_s == 10.0
    # A pod not scraped by the last collect has no figures.
    assert await source.collect_pods({("ml", "chat"): {"pod-c": "http://pod-c/metrics"}}) == {}
