"""The figures a simulation is judged by (the benchmark's JSON fields)."""

from __future__ import annotations

import math
from typing import Any

from batchpilot_operator.api.profile import LatencyMetric
from batchpilot_operator.sim.simulator import SimResult


def exact_quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile of exact per-request values (inf for missing requests)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(result: SimResult, slo_p99_s: float, metric: LatencyMetric) -> dict[str, Any]:
    """Goodput, throughput, exact latency quantiles, long-wait share, batch-hit ratios, decisions.

    Rates are per second of the trace's span (the same denominator for every policy).
    Rejected and unfinished requests count with infinite latency: they missed the SLO.
    "Busy" intervals are those whose arrival rate is at or above the median interval's.
    """
    records = result.records
    span_s = max(result.trace_span_s, 1e-9)
    latencies = sorted(r.latency_s(metric) for r in records)
    met_tokens = 0
    all_tokens = 0
    waits_over_1s = 0
    for r in records:
        done = not math.isnan(r.finished_s)
        if done:
            all_tokens += r.output_tokens
            if r.latency_s(metric) <= slo_p99_s:
                met_tokens += r.output_tokens
        if r.queue_wait_s > 1.0:
            waits_over_1s += 1
    rates = sorted(rate for rate, _ in result.interval_admissions)
    median_rate = rates[len(rates) // 2] if rates else 0.0
    busy = {"hit": 0, "all": 0}
    idle = {"hit": 0, "all": 0}
    for rate, admissions in result.interval_admissions:
        bucket = busy if rate >= median_rate else idle
        bucket["hit"] += admissions.get("target", 0) + admissions.get("cap", 0)
        bucket["all"] += sum(admissions.values())
    hours = span_s / 3600.0
    window = result.final_window
    n = len(records)
    return {
        "requests": n,
        "rejected": sum(1 for r in records if r.rejected),
        "unfinished": sum(1 for r in records if math.isnan(r.finished_s) and not r.rejected),
        "goodput_tokens_per_s": met_tokens / span_s,
        "throughput_tokens_per_s": all_tokens / span_s,
        "p50_s": exact_quantile(latencies, 0.5),
        "p99_s": exact_quantile(latencies, 0.99),
        "p999_s": exact_quantile(latencies, 0.999),
        "itl_p99_s": result.gaps.quantile(0.99),
        "slo_met_share": sum(1 for v in latencies if v <= slo_p99_s) / n if n else math.nan,
        "share_wait_over_1s": waits_over_1s / n if n else math.nan,
        "batch_hit_ratio_busy": busy["hit"] / busy["all"] if busy["all"] else math.nan,
        "batch_hit_ratio_idle": idle["hit"] / idle["all"] if idle["all"] else math.nan,
        "decisions_per_hour": result.window_changes / hours if hours > 0 else math.nan,
        "window": {
            "targetBatchSize": window.target_batch_size,
            "hardCap": window.hard_cap,
            "maxWaitMs": window.max_wait_ms,
            "tailMarkRatio": window.tail_mark_ratio,
            **({"maxPrefillTokens": window.max_prefill_tokens} if window.max_prefill_tokens is not None else {}),
        },
        "steps": result.steps,
        "aborted": result.aborted,
    }
