"""Observation layer: quantiles from bucket increments, grouped PromQL, scraping deltas."""

from __future__ import annotations

import math
import re

import pytest

from batchpilot_operator.io import promql
from batchpilot_operator.io.exposition import parse_exposition
from batchpilot_operator.io.scrape import Scrape, metrics_from_scrapes
from batchpilot_operator.tuning.model_metrics import (
    INTER_TOKEN,
    HistogramWindow,
    MetricsBuilder,
    ModelMetrics,
    histogram_from_buckets,
    lookup,
    to_observations,
)
from batchpilot_runtime.contract import metric_names as rm
from batchpilot_runtime.scheduling.types import StepStats
from batchpilot_runtime.server.metrics import MetricsExporter


def hist(counts: dict[float, float]) -> HistogramWindow:
    return histogram_from_buckets(counts)


def test_quantile_interpolates_within_bucket_like_prometheus() -> None:
    h = hist({0.1: 50, 0.2: 100, 0.4: 100, math.inf: 100})
    assert h.quantile(0.5).value_s == pytest.approx(0.1)
    assert h.quantile(0.75).value_s == pytest.approx(0.15)
    assert not h.quantile(0.75).saturated


def test_quantile_in_inf_bucket_is_saturated_not_a_value() -> None:
    h = hist({0.1: 10, 0.2: 20, math.inf: 100})
    q = h.quantile(0.99)
    assert q.saturated
    assert q.value_s == pytest.approx(0.2)


@pytest.mark.parametrize(("name", "bounds"), [("ttft", rm.LATENCY_BUCKETS_S), (INTER_TOKEN, rm.STEP_BUCKETS_S)])
def test_a_prometheus_quantile_at_the_top_finite_bound_of_its_own_buckets_is_saturated(
    name: str, bounds: tuple[float, ...]
) -> None:
    """histogram_quantile answers a quantile in +Inf with the top finite bound, which differs between
    latencies and gaps (the exporter counts gaps on the shorter step buckets)."""
    metrics = ModelMetrics(
        window_s=60.0,
        latency_quantiles_s={name: {0.5: bounds[0], 0.99: bounds[-1], 0.999: bounds[-1]}},
        latency_count_per_s={name: 10.0},
    )
    obs = to_observations(metrics, "ttft", 0.0)
    saturated = obs.itl_p99_saturated if name == INTER_TOKEN else obs.p99_saturated
    assert saturated


def test_no_observations_is_unknown_not_zero() -> None:
    q = hist({0.1: 0, math.inf: 0}).quantile(0.99)
    assert q.value_s is None and not q.saturated
    obs = to_observations(None, "ttft", 5.0)
    assert math.isnan(obs.p99_s) and math.isnan(obs.queue_depth)


def test_non_monotone_buckets_are_made_monotone() -> None:
    h = hist({0.1: 5, 0.2: 4, math.inf: 6})
    assert h.cumulative == (5, 5, 6)


def test_queries_name_only_runtime_metrics_and_stay_grouped() -> None:
    queries = promql.build_queries(60)
    assert len(queries) == 3
    # Three quantiles of each of the four latency histograms (ttft, queueWait, e2e, interToken).
    assert queries["latency"].count("histogram_quantile(") == 12
    known = rm.all_series_names()
    for expr in queries.values():
        assert "[60s]" in expr or "rate" not in expr
        for name in re.findall(r"\bbatchpilot_[a-z_]+", expr):
            assert name in known, name
        assert "by (namespace, model" in expr


def test_rate_window_is_at_least_four_scrapes() -> None:
    assert promql.rate_window_s(15, 15) == 60
    assert promql.rate_window_s(1, 3) == 4
    assert promql.rate_window_s(1, 10) == 10


def _sample(labels: dict[str, str], value: float) -> dict[str, object]:
    return {"metric": labels, "value": [1.0, str(value)]}


def test_parse_results_groups_by_namespace_and_model() -> None:
    base = {"namespace": "ml", "model": "chat"}
    results = {
        "latency": [
            _sample({**base, "bp_quantile": "0.5", "bp_series": "ttft"}, 0.05),
            _sample({**base, "bp_quantile": "0.99", "bp_series": "ttft"}, 0.3),
            _sample({**base, "bp_quantile": "0.999", "bp_series": "ttft"}, float("nan")),
            _sample({**base, "bp_series": "ttft_count"}, 10.0),
            _sample({**base, "bp_quantile": "0.99", "bp_series": "e2e"}, 150.0),
        ],
        "rates": [
            _sample({**base, "bp_series": "requests"}, 2.5),
            _sample({**base, "bp_series": "admissions", "reason": "target"}, 3.0),
            _sample({**base, "bp_series": "admissions", "reason": "wait"}, 1.0),
            _sample({**base, "bp_series": "batch_sum"}, 40.0),
            _sample({**base, "bp_series": "batch_count"}, 10.0),
            _sample({**base, "bp_series": "step_sum", "batch_bucket": "4"}, 0.2),
            _sample({**base, "bp_series": "step_count", "batch_bucket": "4"}, 10.0),
            _sample({**base, "bp_series": "preemptions"}, float("nan")),
        ],
        "gauges": [
            _sample({**base, "bp_series": "queue_depth"}, 7),
            _sample({**base, "bp_series": "kv_usage"}, 0.4),
            _sample({**base, "bp_series": "pods"}, 2),
        ],
    }
    metrics = promql.parse_results(results, 60)
    m = lookup(metrics, "ml", "chat")
    assert m is not None
    assert lookup(metrics, "other", "chat") is None
    obs = to_observations(m, "ttft", 100.0)
    assert obs.p50_s == pytest.approx(0.05) and obs.p99_s == pytest.approx(0.3) and not obs.p99_saturated
    assert math.isnan(obs.p999_s)
    assert obs.samples == pytest.approx(600)
    # Prometheus answers the top finite bucket bound for a quantile in +Inf: that is saturation.
    assert to_observations(m, "e2e", 100.0).p99_saturated
    assert obs.arrival_rate_per_s == 2.5
    assert obs.batch_hit_ratio == pytest.approx(0.75)
    assert obs.mean_batch_size == pytest.approx(4.0)
    assert obs.step_s_by_batch == {4: pytest.approx(0.02)}
    assert obs.queue_depth == 7 and obs.kv_usage_ratio == 0.4
    assert math.isnan(obs.preemptions_per_s)


def test_the_gaps_hour_has_a_query_of_its_own_whose_answer_gives_the_policy_its_buckets() -> None:
    assert promql.build_gap_hour_query() == (
        "label_replace(sum by (namespace, model, le) (increase(batchpilot_inter_token_seconds_bucket[3600s])), "
        '"bp_series", "interTokenWindow", "", "")'
    )
    assert "increase(" not in " ".join(promql.build_queries(60).values())  # the three stay cheap
    base = {"namespace": "ml", "model": "chat", "bp_series": "interTokenWindow"}
    results = {
        "gapHour": [
            _sample({**base, "le": "0.05"}, 600.0),
            _sample({**base, "le": "0.1"}, 990.0),
            _sample({**base, "le": "+Inf"}, 1000.0),
            _sample({**base, "le": "not-a-number"}, 5.0),  # ignored, not an error
        ],
        "latency": [
            _sample({"namespace": "ml", "model": "chat", "bp_quantile": "0.99", "bp_series": "interToken"}, 0.09)
        ],
    }
    obs = to_observations(lookup(promql.parse_results(results, 60), "ml", "chat"), "ttft", 100.0)
    assert obs.itl_window_buckets == ((0.05, 600.0), (0.1, 990.0), (math.inf, 1000.0))
    assert obs.itl_p99_s == pytest.approx(0.09)
    # Without the hour's answer (a failed query) the policy has no hour to judge by.
    without = promql.parse_results({"latency": results["latency"]}, 60)
    assert to_observations(lookup(without, "ml", "chat"), "ttft", 1.0).itl_window_buckets == ()


async def test_the_gaps_hour_is_read_once_a_minute_and_its_failure_is_not_the_intervals() -> None:
    source = promql.PrometheusSource("http://127.0.0.1:9", interval_s=15.0)
    asked: list[str] = []
    fail_hour = True
    hour_answer = [_sample({"namespace": "ml", "model": "chat", "bp_series": "interTokenWindow", "le": "+Inf"}, 50.0)]

    def answer(expr: str) -> list[dict[str, object]]:
        asked.append(expr)
        if "increase(" in expr:
            if fail_hour:
                raise RuntimeError("query processing would load too many samples into memory")
            return hour_answer
        return (
            [_sample({"namespace": "ml", "model": "chat", "bp_series": "queue_depth"}, 3.0)] if "queue" in expr else []
        )

    source._query = answer  # type: ignore[method-assign]
    try:
        first = await source.collect({})
        assert to_observations(lookup(first, "ml", "chat"), "ttft", 0.0).queue_depth == 3.0  # the interval's
        assert to_observations(lookup(first, "ml", "chat"), "ttft", 0.0).itl_window_buckets == ()
        assert sum("increase(" in e for e in asked) == 1 and source.last_stats.queries == 3
        fail_hour = False
        await source.collect({})  # within the minute: the hour is not asked again
        assert sum("increase(" in e for e in asked) == 1
        with_vllm = await source.collect({}, ["batchpilot", "vllm"])  # another engine: asked at once
        assert sum("increase(" in e for e in asked) == 2
        assert to_observations(lookup(with_vllm, "ml", "chat"), "ttft", 0.0).itl_window_buckets == ((math.inf, 50.0),)
    finally:
        source.close(wait=True)


EXPOSITION = """# TYPE batchpilot_ttft_seconds histogram
batchpilot_ttft_seconds_bucket{{model="m",lane="default",le="0.1"}} {a}
batchpilot_ttft_seconds_bucket{{model="m",lane="default",le="1.0"}} {b}
batchpilot_ttft_seconds_bucket{{model="m",lane="default",le="+Inf"}} {b}
batchpilot_ttft_seconds_sum{{model="m",lane="default"}} 1.0
batchpilot_ttft_seconds_count{{model="m",lane="default"}} {b}
# TYPE batchpilot_requests_total counter
batchpilot_requests_total{{model="m",outcome="completed"}} {b}
# TYPE batchpilot_queue_depth gauge
batchpilot_queue_depth{{model="m"}} 3
"""


def test_scrape_deltas_give_rates_and_quantiles() -> None:
    first = Scrape(0.0, parse_exposition(EXPOSITION.format(a=10, b=10)))
    second = Scrape(10.0, parse_exposition(EXPOSITION.format(a=10, b=30)))
    builder = MetricsBuilder(10.0)
    metrics_from_scrapes(second, first, builder)
    m = builder.build()[("", "m")]
    assert m.requests_per_s == pytest.approx(2.0)
    # 20 new requests, all between 0.1 and 1.0 s: P50 is the bucket's middle.
    assert m.latency["ttft"].quantile(0.5).value_s == pytest.approx(0.55)
    assert m.queue_depth == 3 and m.pods_reporting == 1


def test_scrape_counter_reset_counts_current_value() -> None:
    before = Scrape(0.0, parse_exposition(EXPOSITION.format(a=100, b=100)))
    after = Scrape(5.0, parse_exposition(EXPOSITION.format(a=5, b=5)))
    builder = MetricsBuilder(5.0)
    metrics_from_scrapes(after, before, builder)
    assert builder.build()[("", "m")].requests_per_s == pytest.approx(1.0)


def test_first_scrape_has_gauges_but_no_rates() -> None:
    builder = MetricsBuilder(0.0)
    metrics_from_scrapes(Scrape(0.0, parse_exposition(EXPOSITION.format(a=1, b=1))), None, builder)
    m = builder.build()[("", "m")]
    assert m.requests_per_s is None and not m.latency and m.queue_depth == 3


def test_the_runtime_exporters_steps_give_the_cost_of_a_prompt_token() -> None:
    """From the runtime's own exporter through a scrape to the policy's figure: prefill steps' time
    beyond a decode step of their batch size, per prompt token prefilled."""
    exporter = MetricsExporter("m")
    first = Scrape(0.0, parse_exposition(exporter.exposition().decode()))

    def stats(prefill_seqs: int, prefill_tokens: int) -> StepStats:
        return StepStats(
            batch_size=8,
            num_prefill_seqs=prefill_seqs,
            num_decode_seqs=8 - prefill_seqs,
            num_prefill_tokens=prefill_tokens,
            admissions={},
            admitted_requests=0,
            tail_marked=0,
            preempted=0,
            queue_depth=0,
            running=8,
            kv_usage_ratio=0.1,
            window_generation=0,
        )

    for _ in range(10):
        exporter.on_step(stats(0, 0), 0.02, 0.02)  # a decode step of 8: 20 ms
        exporter.on_step(stats(2, 1000), 0.07, 0.07)  # 1000 prompt tokens add 50 ms
    second = Scrape(10.0, parse_exposition(exporter.exposition().decode()))
    builder = MetricsBuilder(10.0)
    metrics_from_scrapes(second, first, builder)
    obs = to_observations(builder.build()[("", "m")], "ttft", 10.0)
    assert obs.prefill_s_per_token == pytest.approx(0.05 / 1000)
    assert obs.step_s_by_batch == {8: pytest.approx(0.02)}
