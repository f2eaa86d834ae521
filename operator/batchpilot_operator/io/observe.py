"""What the two metric sources (Prometheus, scraping the runtimes) share beside the arithmetic.

Both read the same runtime counters as rates and fill a
:class:`~batchpilot_operator.tuning.model_metrics.ModelMetrics` through its
:class:`~batchpilot_operator.tuning.model_metrics.MetricsBuilder`; the arithmetic on those
figures (quantiles, ratios, the policy's observations) is pure and lives beside the policy.
"""

from __future__ import annotations

from batchpilot_runtime.contract import metric_names as rm

# The runtime counters both sources turn into rates, by the rate series of MetricsBuilder.add_rate
# (admissions by reason; the others summed over every label but namespace and model).
RATE_COUNTERS: dict[str, str] = {
    "requests": rm.REQUESTS_TOTAL,
    "generated_tokens": rm.GENERATED_TOKENS_TOTAL,
    "prompt_tokens": rm.PROMPT_TOKENS_TOTAL,
    "prefill_tokens": rm.PREFILL_TOKENS_TOTAL,
    "tail_marked": rm.TAIL_MARKED_TOTAL,
    "preemptions": rm.PREEMPTIONS_TOTAL,
    "admissions": rm.ADMISSIONS_TOTAL,
}


class MetricsUnavailable(Exception):
    """The metric source could not answer this interval (the message says why)."""
