"""The status conditions as pure functions: a table of inputs and the ConditionFact each must give."""

from __future__ import annotations

from typing import Any

import pytest

from batchpilot_operator.control.conditions import (
    PodFailure,
    SyncView,
    invalid_spec_facts,
    metrics_fact,
    ready_fact,
    slo_fact,
    synced_fact,
)
from batchpilot_operator.control.status import FALSE, TRUE, UNKNOWN, ConditionFact
from batchpilot_operator.io.push import CONFLICT, ERROR, REFUSED, UNAUTHORIZED
from batchpilot_operator.tuning.observations import Observations
from tests.support.factories import make_spec

# A refusal is an outcome, whatever its text says: a failure whose detail reads "refused" is still a failure.
REFUSAL = PodFailure(REFUSED, "HTTP 422: hardCap 64 over capacity")
TIMEOUT = PodFailure(ERROR, "timed out after 3 attempts")
ERROR_SAYING_REFUSED = PodFailure(ERROR, "connection refused: 10.0.0.7:8001")


def make_view(**overrides: Any) -> SyncView:
    fields: dict[str, Any] = {"model": "chat", "ready": 2, "synced": 2, "generation": 3}
    fields.update(overrides)
    return SyncView(**fields)


SYNCED_CASES = [
    pytest.param(
        make_view(ready=0, synced=0),
        ConditionFact(FALSE, "NoReadyPods", "no Ready pod matches the selector of model 'chat'"),
        id="no-ready-pod",
    ),
    pytest.param(
        make_view(sync_error="KeyError: 'x'", failures={"ml/a": REFUSAL}),
        ConditionFact(FALSE, "PushFailed", "sync failed: KeyError: 'x'"),
        id="a-sync-that-raised-wins-over-pod-failures",
    ),
    pytest.param(
        make_view(recommend=True, synced=0, failures={"ml/a": TIMEOUT}),
        ConditionFact(TRUE, "RecommendOnly", "recommend mode: the operator never pushes"),
        id="recommend-mode-never-pushes",
    ),
    pytest.param(
        make_view(synced=1, failures={"ml/a": REFUSAL}),
        ConditionFact(FALSE, "PushRefused", "ml/a: refused: HTTP 422: hardCap 64 over capacity"),
        id="refused-push",
    ),
    pytest.param(
        make_view(synced=1, failures={"ml/a": TIMEOUT}),
        ConditionFact(FALSE, "PushFailed", "ml/a: error: timed out after 3 attempts"),
        id="failed-push",
    ),
    pytest.param(
        make_view(synced=1, failures={"ml/a": ERROR_SAYING_REFUSED}),
        ConditionFact(FALSE, "PushFailed", "ml/a: error: connection refused: 10.0.0.7:8001"),
        id="failed-push-whose-text-says-refused-is-not-a-refusal",
    ),
    pytest.param(
        make_view(synced=0, failures={"ml/b": TIMEOUT, "ml/a": REFUSAL}),
        ConditionFact(
            FALSE,
            "PushRefused",
            "ml/a: refused: HTTP 422: hardCap 64 over capacity; ml/b: error: timed out after 3 attempts",
        ),
        id="one-refusal-among-failures-makes-it-refused-pods-sorted",
    ),
    pytest.param(
        make_view(synced=1, failures={"ml/a": PodFailure(UNAUTHORIZED, "not sent: no token")}),
        ConditionFact(FALSE, "PushFailed", "ml/a: unauthorized: not sent: no token"),
        id="withheld-token",
    ),
    pytest.param(
        make_view(synced=1, failures={"ml/a": PodFailure(CONFLICT, "pod holds a newer generation")}),
        ConditionFact(FALSE, "PushFailed", "ml/a: conflict: pod holds a newer generation"),
        id="conflict-left-after-the-retry",
    ),
    pytest.param(
        make_view(synced=1),
        ConditionFact(FALSE, "Pending", "1 of 2 Ready pods run the window"),
        id="a-pod-behind",
    ),
    pytest.param(
        make_view(clamped={"ml/b": "hardCap 64 -> 32", "ml/a": "hardCap 64 -> 48"}),
        ConditionFact(TRUE, "Clamped", "ml/a: hardCap 64 -> 48; ml/b: hardCap 64 -> 32"),
        id="clamped-pods",
    ),
    pytest.param(make_view(), ConditionFact(TRUE, "Synced", "2 Ready pods run generation 3"), id="in-sync"),
]


@pytest.mark.parametrize(("view", "expected"), SYNCED_CASES)
def test_synced(view: SyncView, expected: ConditionFact) -> None:
    assert synced_fact(view) == expected


def test_a_long_failure_message_is_cut_to_4000_characters() -> None:
    failures = {f"ml/pod-{i:04d}": TIMEOUT for i in range(200)}
    fact = synced_fact(make_view(synced=0, failures=failures))
    assert fact.reason == "PushFailed" and len(fact.message) == 4000


@pytest.mark.parametrize(
    ("synced", "expected"),
    [
        pytest.param(ConditionFact(TRUE, "Synced", "2 Ready"), ConditionFact(TRUE, "Ready", "2 Ready"), id="synced"),
        pytest.param(ConditionFact(TRUE, "Clamped", "c"), ConditionFact(TRUE, "Ready", "c"), id="clamped-is-ready"),
        pytest.param(ConditionFact(FALSE, "PushRefused", "r"), ConditionFact(FALSE, "PushRefused", "r"), id="refused"),
        pytest.param(ConditionFact(FALSE, "Pending", "p"), ConditionFact(FALSE, "Pending", "p"), id="pending"),
    ],
)
def test_ready_follows_synced(synced: ConditionFact, expected: ConditionFact) -> None:
    assert ready_fact(synced) == expected


KNOWN = Observations(p99_s=0.2, samples=120.0)


@pytest.mark.parametrize(
    ("error", "window_s", "obs", "expected"),
    [
        pytest.param(
            "prometheus: connection refused",
            60.0,
            KNOWN,
            ConditionFact(FALSE, "MetricsUnavailable", "prometheus: connection refused"),
            id="source-failed",
        ),
        pytest.param(
            None,
            None,
            Observations(),
            ConditionFact(FALSE, "NoSeries", "no series for model 'chat' in namespace 'ml'"),
            id="no-series",
        ),
        pytest.param(
            None,
            60.0,
            Observations(),
            ConditionFact(FALSE, "NoData", "no e2e observations in the last 60 s"),
            id="series-without-data",
        ),
        pytest.param(
            None,
            60.0,
            KNOWN,
            ConditionFact(TRUE, "MetricsAvailable", "P99 from 120 requests over 60 s"),
            id="data",
        ),
    ],
)
def test_metrics_available(
    error: str | None, window_s: float | None, obs: Observations, expected: ConditionFact
) -> None:
    fact = metrics_fact(error, window_s, obs, model="chat", namespace="ml", latency_metric="e2e")
    assert fact == expected


@pytest.mark.parametrize(
    ("slo", "obs", "status", "reason"),
    [
        pytest.param({"p99Ms": 500}, None, UNKNOWN, "NoData", id="no-observations"),
        pytest.param({"p99Ms": 500}, Observations(), UNKNOWN, "NoData", id="no-latency"),
        pytest.param({"p99Ms": 500}, Observations(p99_s=0.2, samples=500.0), TRUE, "SLOMet", id="under"),
        pytest.param({"p99Ms": 500}, Observations(p99_s=0.9, samples=500.0), FALSE, "SLOMissed", id="over"),
    ],
)
def test_slo_met(slo: dict[str, Any], obs: Observations | None, status: str, reason: str) -> None:
    fact = slo_fact(make_spec(slo=slo), obs)
    assert (fact.status, fact.reason) == (status, reason)


def test_an_invalid_spec_is_not_ready_and_nothing_else_is_known() -> None:
    ready, synced, metrics, slo = invalid_spec_facts("spec.window.hardCap: must be >= targetBatchSize")
    assert ready == ConditionFact(FALSE, "InvalidSpec", "spec.window.hardCap: must be >= targetBatchSize")
    assert {synced.status, metrics.status, slo.status} == {UNKNOWN}
