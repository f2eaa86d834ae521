"""The Prometheus exporter as the engine's observer, fed by hand-made step stats and timings."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_runtime.contract import metric_names as mn
from batchpilot_runtime.contract.admin_api import LaneWindow, PodCapacity, WindowState
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.engine.watchdog import EngineHealth
from batchpilot_runtime.scheduling.types import RequestTimings, StepStats
from batchpilot_runtime.server.metrics import MetricsExporter, normalize_outcome


def make_stats(**overrides: object) -> StepStats:
    values: dict[str, object] = {
        "batch_size": 4,
        "num_prefill_seqs": 1,
        "num_decode_seqs": 3,
        "num_prefill_tokens": 20,
        "admissions": {"target": 1},
        "admitted_requests": 1,
        "tail_marked": 0,
        "preempted": 0,
        "queue_depth": 2,
        "running": 4,
        "kv_usage_ratio": 0.25,
        "window_generation": 0,
    }
    values.update(overrides)
    return StepStats(**values)  # type: ignore[arg-type]


def make_timings(**overrides: object) -> RequestTimings:
    values: dict[str, object] = {
        "arrival_s": 100.0,
        "first_admitted_s": 100.05,
        "first_token_s": 100.2,
        "finished_s": 101.0,
        "prompt_tokens": 12,
        "output_tokens": 5,
        "lane": "default",
        "tail_marked": False,
        "preemptions": 0,
    }
    values.update(overrides)
    return RequestTimings(**values)  # type: ignore[arg-type]


def samples(exporter: MetricsExporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = exporter.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(exporter: MetricsExporter, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model": "m", **labels}.items())))
    return samples(exporter)[key]


def test_every_metric_of_the_contract_is_exposed_before_any_event() -> None:
    exporter = MetricsExporter("m", ["default", "critical"])
    names = {name for name, _ in samples(exporter)}
    for spec in mn.RUNTIME_METRICS:
        if spec.type == "histogram" and spec.name in (mn.STEP_SECONDS,):
            continue  # its batch_bucket label only exists once a step of that size ran
        assert set(spec.series_names()) <= names, spec.name
    for outcome in mn.OUTCOMES:
        assert value(exporter, mn.REQUESTS_TOTAL, outcome=outcome) == 0.0
    for reason in mn.ADMISSION_REASONS:
        assert value(exporter, mn.ADMISSIONS_TOTAL, reason=reason) == 0.0
    assert value(exporter, f"{mn.TTFT_SECONDS}_count", lane="critical") == 0.0


def test_step_feeds_batch_sizes_step_time_counters_and_gauges() -> None:
    exporter = MetricsExporter("m")
    exporter.on_step(make_stats(admissions={"target": 1, "wait": 2}, tail_marked=1, preempted=2), 0.012, 0.010)
    exporter.on_step(
        make_stats(
            batch_size=3,
            num_prefill_seqs=0,
            num_decode_seqs=3,
            admissions={},
            queue_depth=0,
            running=3,
            kv_usage_ratio=0.5,
        ),
        0.004,
        0.003,
    )
    assert value(exporter, f"{mn.STEP_SECONDS}_count", phase="prefill", batch_bucket="4") == 1.0
    assert value(exporter, f"{mn.STEP_SECONDS}_sum", phase="prefill", batch_bucket="4") == pytest.approx(0.012)
    assert value(exporter, f"{mn.STEP_SECONDS}_count", phase="decode", batch_bucket="4") == 1.0
    assert value(exporter, f"{mn.BATCH_SIZE}_count", phase="prefill") == 1.0
    assert value(exporter, f"{mn.BATCH_SIZE}_sum", phase="decode") == 6.0
    assert value(exporter, mn.ADMISSIONS_TOTAL, reason="wait") == 2.0
    assert value(exporter, mn.ADMISSIONS_TOTAL, reason="target") == 1.0
    assert value(exporter, mn.TAIL_MARKED_TOTAL) == 1.0
    assert value(exporter, mn.PREEMPTIONS_TOTAL) == 2.0
    # Gauges hold the last step's load.
    assert value(exporter, mn.QUEUE_DEPTH) == 0.0
    assert value(exporter, mn.RUNNING_SEQUENCES) == 3.0
    assert value(exporter, mn.KV_CACHE_USAGE_RATIO) == 0.5


def test_an_empty_step_updates_gauges_only() -> None:
    exporter = MetricsExporter("m")
    exporter.on_step(
        make_stats(
            batch_size=0,
            num_prefill_seqs=0,
            num_decode_seqs=0,
            admissions={},
            queue_depth=5,
            running=0,
            kv_usage_ratio=0.0,
        ),
        0.0001,
        0.0,
    )
    assert value(exporter, f"{mn.BATCH_SIZE}_count", phase="prefill") == 0.0
    assert value(exporter, mn.QUEUE_DEPTH) == 5.0


def test_finished_request_feeds_latency_histograms_by_lane() -> None:
    exporter = MetricsExporter("m", ["default", "critical"])
    exporter.on_request_finished(make_timings(lane="critical"), "completed")
    assert value(exporter, f"{mn.REQUEST_LATENCY_SECONDS}_sum", lane="critical") == pytest.approx(1.0)
    # Its queue wait and TTFT were observed when they happened, not again at its end.
    assert value(exporter, f"{mn.QUEUE_WAIT_SECONDS}_count", lane="critical") == 0.0
    assert value(exporter, f"{mn.TTFT_SECONDS}_count", lane="critical") == 0.0
    assert value(exporter, mn.REQUESTS_TOTAL, outcome="completed") == 1.0
    assert value(exporter, mn.PROMPT_TOKENS_TOTAL) == 12.0


def test_cancelled_before_admission_counts_no_latency() -> None:
    exporter = MetricsExporter("m")
    exporter.on_request_finished(make_timings(first_admitted_s=None, first_token_s=None), "cancelled")
    assert value(exporter, mn.REQUESTS_TOTAL, outcome="cancelled") == 1.0
    assert value(exporter, f"{mn.QUEUE_WAIT_SECONDS}_count", lane="default") == 0.0
    assert value(exporter, f"{mn.REQUEST_LATENCY_SECONDS}_count", lane="default") == 0.0
    assert value(exporter, mn.PROMPT_TOKENS_TOTAL) == 0.0


def test_a_lane_first_seen_in_timings_gets_its_series() -> None:
    exporter = MetricsExporter("m")
    exporter.on_request_finished(make_timings(lane="bulk"), "completed")
    assert value(exporter, f"{mn.TTFT_SECONDS}_count", lane="bulk") == 0.0
    assert value(exporter, f"{mn.REQUEST_LATENCY_SECONDS}_count", lane="bulk") == 1.0


def test_queue_wait_is_observed_at_admission_by_lane() -> None:
    exporter = MetricsExporter("m", ["default", "critical"])
    exporter.on_admitted("critical", 0.05)
    assert value(exporter, f"{mn.QUEUE_WAIT_SECONDS}_sum", lane="critical") == pytest.approx(0.05)
    assert value(exporter, f"{mn.QUEUE_WAIT_SECONDS}_count", lane="critical") == 1.0
    assert value(exporter, f"{mn.QUEUE_WAIT_SECONDS}_count", lane="default") == 0.0
    assert value(exporter, mn.REQUESTS_TOTAL, outcome="completed") == 0.0


def test_a_request_still_decoding_has_its_ttft_in_the_histogram() -> None:
    exporter = MetricsExporter("m")
    exporter.on_admitted("bulk", 0.05)
    exporter.on_first_token("bulk", 0.2)
    exporter.on_tokens("bulk", [0.01, 0.01])
    assert value(exporter, f"{mn.TTFT_SECONDS}_sum", lane="bulk") == pytest.approx(0.2)
    assert value(exporter, f"{mn.TTFT_SECONDS}_count", lane="bulk") == 1.0
    assert value(exporter, f"{mn.REQUEST_LATENCY_SECONDS}_count", lane="bulk") == 0.0
    # Its end adds the end-to-end latency and the outcome, not a second TTFT or wait.
    exporter.on_request_finished(make_timings(lane="bulk"), "completed")
    assert value(exporter, f"{mn.TTFT_SECONDS}_count", lane="bulk") == 1.0
    assert value(exporter, f"{mn.QUEUE_WAIT_SECONDS}_count", lane="bulk") == 1.0
    assert value(exporter, f"{mn.REQUEST_LATENCY_SECONDS}_count", lane="bulk") == 1.0


def test_inter_token_gaps_tokens_and_rejections() -> None:
    exporter = MetricsExporter("m")
    exporter.on_tokens("default", [0.01, 0.02, 0.03])
    exporter.on_generated_tokens(3)
    exporter.on_rejected()
    assert value(exporter, f"{mn.INTER_TOKEN_SECONDS}_count", lane="default") == 3.0
    assert value(exporter, f"{mn.INTER_TOKEN_SECONDS}_sum", lane="default") == pytest.approx(0.06)
    assert value(exporter, mn.GENERATED_TOKENS_TOTAL) == 3.0
    assert value(exporter, mn.REQUESTS_TOTAL, outcome="rejected") == 1.0


def test_window_gauges_and_lanes_follow_on_window() -> None:
    exporter = MetricsExporter("m")
    window = Window(target_batch_size=12, hard_cap=24, max_wait_ms=35, generation=7)
    lane = LaneWindow(name="critical", window=Window(target_batch_size=1, hard_cap=2, max_wait_ms=0), reserved_slots=1)
    capacity = PodCapacity(kv_cache_tokens=1024, kv_block_size=16, max_hard_cap=64, max_model_len=1024)
    exporter.on_window(WindowState(model="m", window=window, lanes=[lane], capacity=capacity, batching="continuous"))
    assert value(exporter, mn.WINDOW_TARGET_BATCH_SIZE) == 12.0
    assert value(exporter, mn.WINDOW_HARD_CAP) == 24.0
    assert value(exporter, mn.WINDOW_MAX_WAIT_SECONDS) == pytest.approx(0.035)
    assert value(exporter, mn.WINDOW_GENERATION) == 7.0
    assert value(exporter, f"{mn.TTFT_SECONDS}_count", lane="critical") == 0.0


def test_engine_gauges_read_the_watchdog_at_each_scrape() -> None:
    exporter = MetricsExporter("m")
    assert (value(exporter, mn.ENGINE_STALLED), value(exporter, mn.ENGINE_STALL_SECONDS)) == (0.0, 0.0)
    readings = [EngineHealth(False, 12.5, 2, 60.0)]
    exporter.watch_engine(lambda: readings[-1])
    assert (value(exporter, mn.ENGINE_STALLED), value(exporter, mn.ENGINE_STALL_SECONDS)) == (0.0, 12.5)
    readings.append(EngineHealth(True, 75.0, 2, 60.0))
    assert (value(exporter, mn.ENGINE_STALLED), value(exporter, mn.ENGINE_STALL_SECONDS)) == (1.0, 75.0)


def test_histograms_use_the_contract_buckets() -> None:
    exporter = MetricsExporter("m")
    exporter.on_tokens("default", [0.001])
    text = exporter.exposition().decode()
    for family in text_string_to_metric_families(text):
        spec = next((s for s in mn.RUNTIME_METRICS if s.name == family.name), None)
        if spec is None or spec.type != "histogram":
            continue
        bounds = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
        if bounds:
            assert bounds[:-1] == list(spec.buckets), family.name
            assert bounds[-1] == float("inf")


@pytest.mark.parametrize(
    ("outcome", "label"),
    [
        ("completed", "completed"),
        ("length", "completed"),
        ("stop", "completed"),
        ("cancelled", "cancelled"),
        ("timeout", "timeout"),
        ("error", "error"),
        ("something-new", "error"),
    ],
)
def test_outcomes_stay_within_the_bounded_label_set(outcome: str, label: str) -> None:
    assert normalize_outcome(outcome) == label
