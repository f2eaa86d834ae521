"""The one exposition reader: samples, buckets, counter resets; the scraping source and the demo agree."""

from __future__ import annotations

import math

import pytest

from batchpilot_operator.demo.series import histogram_between, quantile_ms, snapshot_from_exposition
from batchpilot_operator.io.exposition import bucket_bound, counter_increase, parse_exposition
from batchpilot_operator.io.scrape import Scrape, metrics_from_scrapes
from batchpilot_operator.tuning.model_metrics import MetricsBuilder
from batchpilot_runtime.contract import metric_names as rm

EXPOSITION = """# TYPE batchpilot_ttft_seconds histogram
batchpilot_ttft_seconds_bucket{{model="m",lane="default",le="0.1"}} {a}
batchpilot_ttft_seconds_bucket{{model="m",lane="default",le="1.0"}} {b}
batchpilot_ttft_seconds_bucket{{model="m",lane="default",le="+Inf"}} {c}
batchpilot_ttft_seconds_bucket{{model="m",lane="critical",le="0.1"}} {a}
batchpilot_ttft_seconds_bucket{{model="m",lane="critical",le="1.0"}} {a}
batchpilot_ttft_seconds_bucket{{model="m",lane="critical",le="+Inf"}} {a}
# TYPE batchpilot_requests_total counter
batchpilot_requests_total{{model="m",outcome="completed"}} {c}
# TYPE batchpilot_queue_depth gauge
batchpilot_queue_depth{{model="m"}} 3
"""


def test_samples_are_keyed_by_name_and_sorted_labels_with_escapes_undone() -> None:
    text = (
        "# TYPE batchpilot_requests_total counter\n"
        'batchpilot_requests_total{outcome="completed",model="a \\"b\\"\\\\c"} 7\n'
        "# TYPE batchpilot_ttft_seconds histogram\n"
        'batchpilot_ttft_seconds_bucket{model="m",le="+Inf"} 2\n'
        "# TYPE batchpilot_queue_depth gauge\n"
        'batchpilot_queue_depth{model="m"} NaN\n'
    )
    series = parse_exposition(text)
    assert series[("batchpilot_requests_total", (("model", 'a "b"\\c'), ("outcome", "completed")))] == 7.0
    assert series[("batchpilot_ttft_seconds_bucket", (("le", "+Inf"), ("model", "m")))] == 2.0
    assert math.isnan(series[("batchpilot_queue_depth", (("model", "m"),))])


@pytest.mark.parametrize(
    ("name", "labels", "expected"),
    [
        pytest.param("h_bucket", {"le": "0.5"}, ("h", 0.5), id="finite-bound"),
        pytest.param("h_bucket", {"le": "+Inf"}, ("h", math.inf), id="inf-bound"),
        pytest.param("other_bucket", {"le": "0.5"}, None, id="another-histogram"),
        pytest.param("h_count", {}, None, id="not-a-bucket"),
        pytest.param("h_bucket", {}, None, id="no-le"),
        pytest.param("h_bucket", {"le": "wide"}, None, id="le-not-a-number"),
        pytest.param("h_bucket", {"le": "NaN"}, None, id="le-nan"),
    ],
)
def test_bucket_bound(name: str, labels: dict[str, str], expected: tuple[str, float] | None) -> None:
    assert bucket_bound(name, labels, {"h"}) == expected


@pytest.mark.parametrize(
    ("now", "before", "expected"),
    [
        pytest.param(30.0, 10.0, 20.0, id="grew"),
        pytest.param(10.0, 10.0, 0.0, id="unchanged"),
        pytest.param(5.0, 100.0, 5.0, id="reset-counts-current-value"),
        pytest.param(4.0, None, 4.0, id="new-series"),
    ],
)
def test_counter_increase(now: float, before: float | None, expected: float) -> None:
    assert counter_increase(now, before) == expected


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param((10, 10, 10), (10, 30, 30), id="grew"),
        pytest.param((100, 100, 100), (4, 20, 20), id="restart"),
        pytest.param((5, 50, 50), (10, 40, 60), id="one-bucket-reset-made-monotone"),
    ],
)
def test_scraping_source_and_demo_read_the_same_quantile_from_the_same_counters(
    before: tuple[int, int, int], after: tuple[int, int, int]
) -> None:
    first_text = EXPOSITION.format(a=before[0], b=before[1], c=before[2])
    second_text = EXPOSITION.format(a=after[0], b=after[1], c=after[2])
    builder = MetricsBuilder(10.0)
    metrics_from_scrapes(
        Scrape(10.0, parse_exposition(second_text)), Scrape(0.0, parse_exposition(first_text)), builder
    )
    operator_p99 = builder.build()[("", "m")].latency["ttft"].quantile(0.99)
    demo = histogram_between(
        snapshot_from_exposition(first_text, "m", 0.0),
        snapshot_from_exposition(second_text, "m", 10.0),
        rm.TTFT_SECONDS,
    )
    assert operator_p99.value_s is not None
    assert quantile_ms(demo, 0.99) == pytest.approx(1000.0 * operator_p99.value_s, rel=1e-3)
