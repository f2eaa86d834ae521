"""/metrics of a runtime under real traffic: it parses, it carries every metric of the contract
with its labels and buckets, and the buckets resolve P99 and P999 of what the traffic produced."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from batchpilot_runtime.contract import metric_names as mn
from batchpilot_runtime.contract.admin_api import LaneWindow
from batchpilot_runtime.contract.window import Window
from tests.integration.runtime_process import ThreadRuntime, runtime_thread

REQUESTS = 32
MAX_TOKENS = 8
# The geometric buckets grow by 20 %: a quantile read from them is within that of the truth.
BUCKET_GROWTH = 1.2


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    critical = LaneWindow(
        name="critical", window=Window(target_batch_size=1, hard_cap=2, max_wait_ms=0), reserved_slots=1
    )
    with runtime_thread(
        tmp_path_factory.mktemp("metrics"), lanes=(critical,), target_batch_size=4, hard_cap=8, max_wait_ms=10
    ) as started:
        _traffic(started.serve_url)
        yield started


def _traffic(serve_url: str) -> None:
    def one(i: int) -> int:
        body = {
            "prompt": [40 + i % 50] * (4 + i % 13),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "lane": "critical" if i % 4 == 0 else "default",
        }
        return httpx.post(f"{serve_url}/v1/completions", json=body, timeout=120.0).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = list(pool.map(one, range(REQUESTS)))
    assert statuses == [200] * REQUESTS


@pytest.fixture(scope="module")
def samples(runtime: ThreadRuntime) -> list[Sample]:
    response = httpx.get(f"{runtime.serve_url}/metrics", timeout=30.0)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return [s for family in text_string_to_metric_families(response.text) for s in family.samples]


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    matching = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, (name, labels, matching)
    return matching[0]


def test_every_contract_metric_is_present_with_its_labels(samples: list[Sample]) -> None:
    for spec in mn.RUNTIME_METRICS:
        for series in spec.series_names():
            found = [s for s in samples if s.name == series]
            assert found, f"{series} missing from /metrics"
            for sample in found:
                assert set(sample.labels) - {"le"} == set(spec.labels), (series, sample.labels)
                assert sample.labels["model"] == "tiny-test"


def test_counters_match_the_traffic(samples: list[Sample]) -> None:
    assert _value(samples, mn.REQUESTS_TOTAL, outcome="completed") == REQUESTS
    assert _value(samples, mn.GENERATED_TOKENS_TOTAL) == REQUESTS * MAX_TOKENS
    assert _value(samples, mn.PROMPT_TOKENS_TOTAL) == sum(4 + i % 13 for i in range(REQUESTS))
    admissions = sum(_value(samples, mn.ADMISSIONS_TOTAL, reason=r) for r in mn.ADMISSION_REASONS)
    assert admissions >= 1
    assert _value(samples, f"{mn.TTFT_SECONDS}_count", lane="critical") == REQUESTS / 4
    assert _value(samples, f"{mn.TTFT_SECONDS}_count", lane="default") == REQUESTS * 3 / 4
    assert _value(samples, f"{mn.INTER_TOKEN_SECONDS}_count", lane="default") == REQUESTS * 3 / 4 * (MAX_TOKENS - 1)
    # Idle now: the load gauges are back to zero.
    assert _value(samples, mn.QUEUE_DEPTH) == 0.0
    assert _value(samples, mn.RUNNING_SEQUENCES) == 0.0
    assert _value(samples, mn.KV_CACHE_USAGE_RATIO) == 0.0


def _buckets(samples: list[Sample], name: str, **labels: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of one histogram series, in order."""
    rows = [
        (float(s.labels["le"]), s.value)
        for s in samples
        if s.name == f"{name}_bucket" and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sorted(rows)


def quantile_bucket(buckets: list[tuple[float, float]], q: float) -> tuple[float, float]:
    """The (lower, upper) bounds of the bucket holding the q-quantile."""
    total = buckets[-1][1]
    rank = q * total
    lower = 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            return lower, upper
        lower = upper
    raise AssertionError("the +Inf bucket holds every observation")


@pytest.mark.parametrize(
    ("name", "labels"),
    [
        (mn.TTFT_SECONDS, {"lane": "default"}),
        (mn.REQUEST_LATENCY_SECONDS, {"lane": "default"}),
        (mn.QUEUE_WAIT_SECONDS, {"lane": "default"}),
        (mn.INTER_TOKEN_SECONDS, {"lane": "default"}),
        (mn.TTFT_SECONDS, {"lane": "critical"}),
    ],
)
@pytest.mark.parametrize("q", [0.99, 0.999])
def test_buckets_resolve_tail_quantiles(samples: list[Sample], name: str, labels: dict[str, str], q: float) -> None:
    buckets = _buckets(samples, name, **labels)
    assert buckets[-1][1] > 0, "the traffic produced no observation"
    lower, upper = quantile_bucket(buckets, q)
    assert math.isfinite(upper), f"P{q * 100:g} of {name} is beyond the last finite bucket"
    spec = next(s for s in mn.RUNTIME_METRICS if s.name == name)
    if lower == 0.0:
        assert upper == spec.buckets[0]  # below the finest bucket: resolved to "under 1 ms" (or 0.1 ms)
    else:
        assert upper / lower <= BUCKET_GROWTH * (1 + 1e-4)  # bounds are rounded to 6 digits


def test_step_time_is_labelled_by_phase_and_batch_bucket(samples: list[Sample]) -> None:
    series = {
        (s.labels["phase"], s.labels["batch_bucket"])
        for s in samples
        if s.name == f"{mn.STEP_SECONDS}_count" and s.value > 0
    }
    assert {phase for phase, _ in series} == {"prefill", "decode"}
    allowed = {str(2**p) for p in range(13)}
    assert {bucket for _, bucket in series} <= allowed
