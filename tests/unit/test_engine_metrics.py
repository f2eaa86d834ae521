"""vLLM's and SGLang's own metrics, read by both sources into the same observations.

The expositions come from prometheus_client with each engine's names, labels and buckets
(tests/support/engine_expositions.py); the Prometheus path is covered end to end in
tests/integration/test_engine_prometheus.py.
"""

from __future__ import annotations

import math

import pytest

from batchpilot_operator.io import promql
from batchpilot_operator.io.engine_metrics import FOREIGN_ENGINES, SGLANG_NAMES, VLLM_NAMES
from batchpilot_operator.io.exposition import parse_exposition
from batchpilot_operator.io.observe import RATE_COUNTERS
from batchpilot_operator.io.scrape import Scrape, metrics_from_scrapes
from batchpilot_operator.tuning.model_metrics import LATENCY_HISTOGRAMS, MetricsBuilder, to_observations
from tests.support.engine_expositions import EngineExposition, Load

WINDOW_S = 60.0


def observe(fixture: EngineExposition, seconds: float = WINDOW_S, latency_metric: str = "ttft") -> object:
    """Two scrapes ``seconds`` apart (the load in between), as the scraping source differences them."""
    first = Scrape(0.0, parse_exposition(fixture.exposition().decode()))
    fixture.advance(seconds)
    second = Scrape(seconds, parse_exposition(fixture.exposition().decode()))
    builder = MetricsBuilder(seconds)
    metrics_from_scrapes(second, first, builder, namespace="ml")
    built = builder.build()
    assert list(built) == [("ml", fixture.model)]
    return built[("ml", fixture.model)]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_scrape_of_the_engines_metrics_gives_the_policy_its_figures(engine: str) -> None:
    load = Load(requests_per_s=10.0, ttft_s=(0.3,) * 9 + (3.0,), itl_s=(0.03,), waiting=30, running=12, kv_usage=0.62)
    fixture = EngineExposition(engine, "llama", load)
    fixture.advance(1.0)  # counters already running at the first scrape
    metrics = observe(fixture)
    obs = to_observations(metrics, "ttft", at_s=0.0)  # type: ignore[arg-type]
    assert obs.arrival_rate_per_s == pytest.approx(10.0)
    assert obs.tokens_per_s == pytest.approx(10.0 * load.output_tokens)
    assert obs.queue_depth == 30
    assert obs.kv_usage_ratio == pytest.approx(0.62)
    assert obs.samples == pytest.approx(600)
    # One request in ten takes 3 s to its first token: P99 lies in the bucket holding 3 s, P50 in the 0.3 s one.
    assert 2.0 < obs.p99_s <= 5.0
    assert obs.p50_s < 0.5
    assert 0.025 <= obs.itl_p99_s <= 0.05  # the bucket holding 30 ms gaps, by either engine's buckets
    # No batch-size histogram: the running set per pod stands for the batch size.
    assert obs.mean_batch_size == 12
    # Not exported by these engines: unknown, never zero.
    assert math.isnan(obs.batch_hit_ratio)
    assert obs.step_s_by_batch == {}


def test_vllm_in_the_middle_of_a_rename_is_read_by_its_new_names_alone() -> None:
    """vLLM 0.11 exports time_per_output_token beside inter_token_latency and 0.9 gpu_cache_usage_perc beside
    kv_cache_usage_perc; the fixture gives the old names other values, which must not show."""
    fixture = EngineExposition("vllm", "llama", Load(itl_s=(0.03,), kv_usage=0.5), legacy=True)
    metrics = observe(fixture)
    obs = to_observations(metrics, "ttft", at_s=0.0)  # type: ignore[arg-type]
    assert 0.025 <= obs.itl_p99_s <= 0.05  # the old name holds 0.3 s gaps
    assert obs.kv_usage_ratio == pytest.approx(0.5)  # the old name holds 0.99


def test_an_engine_that_only_has_the_old_name_is_read_by_it() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    old = Histogram("vllm:time_per_output_token_seconds", "tpot", ["model_name", "engine"], registry=registry)
    for _ in range(100):
        old.labels("llama", "0").observe(0.03)
    second = Scrape(60.0, parse_exposition(generate_latest(registry).decode()))
    builder = MetricsBuilder(60.0)
    metrics_from_scrapes(second, Scrape(0.0, {}), builder)
    obs = to_observations(builder.build()[("", "llama")], "ttft", at_s=0.0)
    assert 0.025 < obs.itl_p99_s <= 0.05


def test_each_engine_maps_every_latency_metric_and_the_counters_the_policy_reads() -> None:
    """vLLM and SGLang alone; llamacpp's latency comes from the gate (tests/unit/test_llamacpp_engine.py)."""
    for names in (FOREIGN_ENGINES["vllm"], FOREIGN_ENGINES["sglang"]):
        assert set(names.latency) == set(LATENCY_HISTOGRAMS)
        assert set(names.counters) <= set(RATE_COUNTERS)
        assert {"requests", "generated_tokens", "prompt_tokens", "preemptions"} <= set(names.counters)
        assert set(names.gauges) == {"queue_depth", "running", "kv_usage"}
        assert names.model_label == "model_name"


def test_the_queries_stay_three_for_every_engine_and_name_each_engines_metrics() -> None:
    alone = promql.build_queries(60)
    every = promql.build_queries(60, engines=("batchpilot", "vllm", "sglang"))
    assert set(alone) == set(every) == {"latency", "rates", "gauges"}
    text = " ".join(every.values())
    for names in (VLLM_NAMES, SGLANG_NAMES):
        for histograms in names.latency.values():
            assert all(f"{name}_bucket[60s]" in text for name in histograms)
        assert all(f"{counter}[60s]" in text for counter in names.counters.values())
        assert all(name in text for gauges in names.gauges.values() for name in gauges)
        # The gaps' hour for the error budget (a query of its own), under each of the engine's names.
        hour = promql.build_gap_hour_query(engines=("batchpilot", "vllm", "sglang"))
        assert all(f"increase({name}_bucket[3600s])" in hour for name in names.latency["interToken"])
    assert "label_replace(" in text and '"model", "$1", "model_name"' in text
    vllm_only = promql.build_queries(60, engines=("vllm",))
    assert "batchpilot_" not in " ".join(vllm_only.values())
    assert "sglang:" not in " ".join(vllm_only.values())


def test_an_unknown_engine_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        promql.build_queries(60, engines=("tgi",))
