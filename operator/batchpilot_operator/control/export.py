"""The operator's own per-profile metrics, set from the facts of one status: pods, conditions, SLO, window."""

from __future__ import annotations

from batchpilot_operator.control.records import ProfileRecord
from batchpilot_operator.control.status import FALSE, TRUE, StatusFacts
from batchpilot_operator.io.opmetrics import OperatorMetrics
from batchpilot_operator.tuning.model_metrics import INTER_TOKEN


def export_profile(metrics: OperatorMetrics, record: ProfileRecord, facts: StatusFacts) -> None:
    spec = record.spec
    if spec is None:
        return
    labels = (record.ref.namespace, record.ref.name, spec.model)
    if facts.pods is not None:
        for state, value in (
            ("total", facts.pods.total),
            ("ready", facts.pods.ready),
            ("synced", facts.pods.synced),
        ):
            metrics.profile_pods.labels(*labels, state).set(value)
    for name, fact in (
        ("Ready", facts.ready),
        ("Synced", facts.synced),
        ("MetricsAvailable", facts.metrics_available),
        ("SLOMet", facts.slo_met),
    ):
        metrics.profile_condition.labels(*labels, name).set({TRUE: 1.0, FALSE: 0.0}.get(fact.status, -1.0))
    metric = spec.slo.latency_metric.value
    if spec.slo.p99_ms is not None:
        metrics.slo_seconds.labels(*labels, metric, "0.99").set(spec.slo.p99_ms / 1000)
    if spec.slo.p999_ms is not None:
        metrics.slo_seconds.labels(*labels, metric, "0.999").set(spec.slo.p999_ms / 1000)
    if spec.slo.inter_token_p99_ms is not None:
        metrics.slo_seconds.labels(*labels, INTER_TOKEN, "0.99").set(spec.slo.inter_token_p99_ms / 1000)
    if record.loop.window is not None:
        metrics.window_target.labels(*labels).set(record.loop.window.target_batch_size)
        metrics.window_cap.labels(*labels).set(record.loop.window.hard_cap)
        metrics.window_wait.labels(*labels).set(record.loop.window.max_wait_ms / 1000)
        metrics.window_generation.labels(*labels).set(record.loop.window.generation)
        metrics.window_budget.labels(*labels).set(record.loop.window.max_prefill_tokens or 0)
