"""The tick's one collection: every due profile's model metrics from the metric source in one call.

Profiles of the same model (in the same namespace, or anywhere in local mode) share one key, so their
pods' /metrics URLs are collected together; a source that fails, or a bug in it, is the tick's missing
data (``metrics_error``), never a stop of the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from batchpilot_operator.api.kinds import EngineKind
from batchpilot_operator.control.canary import metrics_url
from batchpilot_operator.control.records import MetricsSource, PodRecord, ProfileRecord, TickReport
from batchpilot_operator.io.observe import MetricsUnavailable
from batchpilot_operator.io.opmetrics import OperatorMetrics
from batchpilot_operator.tuning.model_metrics import ModelKey, ModelMetrics


def metric_targets(
    due: Sequence[ProfileRecord], pods_of: Callable[[ProfileRecord], list[PodRecord]], match_by_model: bool
) -> dict[ModelKey, list[str]]:
    """Per model key, the /metrics URLs of the Ready pods of the due profiles (their engine's too)."""
    targets: dict[ModelKey, list[str]] = {}
    for record in due:
        spec = record.spec
        if spec is None:
            continue
        urls = [
            url
            for p in pods_of(record)
            if p.ready
            for url in (metrics_url(p, spec), p.engine_metrics_url)
            if url is not None
        ]
        key = (record.ref.namespace if not match_by_model else "", spec.model)
        targets.setdefault(key, []).extend(urls)
    return targets


async def collect(
    source: MetricsSource | None,
    due: Sequence[ProfileRecord],
    pods_of: Callable[[ProfileRecord], list[PodRecord]],
    match_by_model: bool,
    metrics: OperatorMetrics,
    monotonic: Callable[[], float],
    report: TickReport,
) -> tuple[dict[ModelKey, ModelMetrics], str | None]:
    """Every due model's metrics from ``source`` in one call, or why there are none."""
    if not due:
        return {}, None
    if source is None:
        return {}, "no metric source configured"
    targets = metric_targets(due, pods_of, match_by_model)
    collected: dict[ModelKey, ModelMetrics] = {}
    metrics_error: str | None = None
    collect_started = monotonic()
    try:
        engines = sorted({record.spec.engine.value for record in due if record.spec is not None})
        # batchpilot alone is every source's default: sources that know no other engine need not take it.
        collected = await (
            source.collect(targets) if engines == [EngineKind.BATCHPILOT] else source.collect(targets, engines)
        )
    except MetricsUnavailable as error:
        metrics_error = str(error)
        metrics.query_errors.labels(query="all").inc()
    except Exception as error:  # a source bug must not stop the loop
        metrics_error = f"{type(error).__name__}: {error}"
        metrics.query_errors.labels(query="all").inc()
    metrics.query_seconds.labels(query="all").observe(monotonic() - collect_started)
    report.queries = getattr(getattr(source, "last_stats", None), "queries", 0)
    return collected, metrics_error
