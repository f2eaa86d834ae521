"""Names, types, labels and buckets of every metric the runtime exports.

This is the metric contract: the runtime's exporter, the operator's PromQL, the
Grafana dashboard and the alert rules all take their names from here, and a
test checks that they name nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "histogram"]

LABEL_MODEL = "model"
LABEL_LANE = "lane"
LABEL_PHASE = "phase"
LABEL_BATCH_BUCKET = "batch_bucket"
LABEL_OUTCOME = "outcome"
LABEL_REASON = "reason"

PHASES = ("prefill", "decode")
ADMISSION_REASONS = ("target", "wait", "tail", "cap")
OUTCOMES = ("completed", "cancelled", "rejected", "error", "timeout")


def _geometric(start: float, stop: float, factor: float) -> tuple[float, ...]:
    bounds: list[float] = []
    value = start
    while value < stop * (1 + 1e-9):
        bounds.append(float(f"{value:.6g}"))
        value *= factor
    return tuple(bounds)


# 1 ms to ~150 s in 20 % steps: a quantile read from these buckets is within
# 10 % of the true value, fine enough for P99 and P999 from a chat SLO of a few
# hundred ms to an offline job's minutes.
LATENCY_BUCKETS_S = _geometric(0.001, 150.0, 1.2)
# Inter-token gaps and step times are shorter: 0.1 ms to ~30 s.
STEP_BUCKETS_S = _geometric(0.0001, 30.0, 1.2)
# Batch sizes: every power of two and the midpoints between them, up to 4096.
BATCH_SIZE_BUCKETS = tuple(sorted({float(b) for p in range(13) for b in (2**p, 3 * 2 ** (p - 1) if p >= 1 else 1)}))


def batch_bucket(batch_size: int) -> str:
    """The bounded ``batch_bucket`` label of a step: the power of two at or above its size.

    Bounded to 13 values (1..4096) so the label never explodes the series count.
    """
    if batch_size <= 1:
        return "1"
    bucket = 1
    while bucket < batch_size and bucket < 4096:
        bucket *= 2
    return str(bucket)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = (LABEL_MODEL,)
    buckets: tuple[float, ...] = ()

    def series_names(self) -> tuple[str, ...]:
        """The names that appear in the exposition (and so in PromQL) for this metric."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.type == "counter":
            return (self.name,)
        return (self.name,)


QUEUE_WAIT_SECONDS = "batchpilot_queue_wait_seconds"
TTFT_SECONDS = "batchpilot_ttft_seconds"
REQUEST_LATENCY_SECONDS = "batchpilot_request_latency_seconds"
INTER_TOKEN_SECONDS = "batchpilot_inter_token_seconds"
BATCH_SIZE = "batchpilot_batch_size"
STEP_SECONDS = "batchpilot_step_seconds"
QUEUE_DEPTH = "batchpilot_queue_depth"
RUNNING_SEQUENCES = "batchpilot_running_sequences"
KV_CACHE_USAGE_RATIO = "batchpilot_kv_cache_usage_ratio"
WINDOW_TARGET_BATCH_SIZE = "batchpilot_window_target_batch_size"
WINDOW_HARD_CAP = "batchpilot_window_hard_cap"
WINDOW_MAX_WAIT_SECONDS = "batchpilot_window_max_wait_seconds"
WINDOW_GENERATION = "batchpilot_window_generation"
WINDOW_MAX_PREFILL_TOKENS = "batchpilot_window_max_prefill_tokens"
REQUESTS_TOTAL = "batchpilot_requests_total"
GENERATED_TOKENS_TOTAL = "batchpilot_generated_tokens_total"
PROMPT_TOKENS_TOTAL = "batchpilot_prompt_tokens_total"
PREFILL_TOKENS_TOTAL = "batchpilot_prefill_tokens_total"
TAIL_MARKED_TOTAL = "batchpilot_tail_marked_total"
ADMISSIONS_TOTAL = "batchpilot_admissions_total"
PREEMPTIONS_TOTAL = "batchpilot_preemptions_total"
ENGINE_STALLED = "batchpilot_engine_stalled"
ENGINE_STALL_SECONDS = "batchpilot_engine_stall_seconds"

RUNTIME_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        QUEUE_WAIT_SECONDS,
        "histogram",
        "Time a request waited before its first admission.",
        (LABEL_MODEL, LABEL_LANE),
        LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        TTFT_SECONDS,
        "histogram",
        "Time from arrival to the first generated token.",
        (LABEL_MODEL, LABEL_LANE),
        LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        REQUEST_LATENCY_SECONDS,
        "histogram",
        "Time from arrival to the last generated token.",
        (LABEL_MODEL, LABEL_LANE),
        LATENCY_BUCKETS_S,
    ),
    MetricSpec(
        INTER_TOKEN_SECONDS,
        "histogram",
        "Time between two generated tokens of one request.",
        (LABEL_MODEL, LABEL_LANE),
        STEP_BUCKETS_S,
    ),
    MetricSpec(
        BATCH_SIZE, "histogram", "Sequences in one engine step.", (LABEL_MODEL, LABEL_PHASE), BATCH_SIZE_BUCKETS
    ),
    MetricSpec(
        STEP_SECONDS,
        "histogram",
        "Duration of one engine step, by phase and batch-size bucket.",
        (LABEL_MODEL, LABEL_PHASE, LABEL_BATCH_BUCKET),
        STEP_BUCKETS_S,
    ),
    MetricSpec(QUEUE_DEPTH, "gauge", "Requests waiting for admission."),
    MetricSpec(RUNNING_SEQUENCES, "gauge", "Sequences in the running set."),
    MetricSpec(KV_CACHE_USAGE_RATIO, "gauge", "Fraction of KV-cache blocks in use."),
    MetricSpec(WINDOW_TARGET_BATCH_SIZE, "gauge", "targetBatchSize of the window in force."),
    MetricSpec(WINDOW_HARD_CAP, "gauge", "hardCap of the window in force."),
    MetricSpec(WINDOW_MAX_WAIT_SECONDS, "gauge", "maxWaitMs of the window in force, in seconds."),
    MetricSpec(WINDOW_GENERATION, "gauge", "Generation of the window in force."),
    MetricSpec(
        WINDOW_MAX_PREFILL_TOKENS,
        "gauge",
        "Prompt tokens one step may prefill under the window in force (0 = whole prompts).",
    ),
    MetricSpec(REQUESTS_TOTAL, "counter", "Requests that ended, by outcome.", (LABEL_MODEL, LABEL_OUTCOME)),
    MetricSpec(GENERATED_TOKENS_TOTAL, "counter", "Tokens generated."),
    MetricSpec(PROMPT_TOKENS_TOTAL, "counter", "Prompt tokens of admitted requests."),
    MetricSpec(
        PREFILL_TOKENS_TOTAL,
        "counter",
        "Prompt tokens run through the model in prefill steps (chunks and recomputation after a preemption included).",
    ),
    MetricSpec(TAIL_MARKED_TOTAL, "counter", "Requests marked as tail requests."),
    MetricSpec(
        ADMISSIONS_TOTAL, "counter", "Admission decisions, by the rule that fired.", (LABEL_MODEL, LABEL_REASON)
    ),
    MetricSpec(PREEMPTIONS_TOTAL, "counter", "Sequences preempted for lack of KV cache (recomputed later)."),
    MetricSpec(
        ENGINE_STALLED,
        "gauge",
        "1 while the engine is stalled (pending requests, no step for longer than the stall timeout; "
        "/healthz fails), else 0.",
    ),
    MetricSpec(
        ENGINE_STALL_SECONDS,
        "gauge",
        "Seconds pending requests have gone without an engine step (0 when idle or waiting for an admission deadline).",
    ),
)


def all_series_names() -> frozenset[str]:
    """Every series name the runtime exposes (counters carry their ``_total`` name)."""
    return frozenset(n for spec in RUNTIME_METRICS for n in spec.series_names())
