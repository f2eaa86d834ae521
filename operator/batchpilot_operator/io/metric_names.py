"""Names, types, labels and buckets of every metric the operator exports.

The operator's own half of the metric contract (the runtime's half is
:mod:`batchpilot_runtime.contract.metric_names`). The operator's exporter, the Grafana
dashboard and the alert rules take their names from here, and a test checks
that the dashboard and the rules name nothing else.

Every per-profile series carries ``namespace``, ``profile`` and ``model`` so
that alerts can join them with the runtime's series on ``(namespace, model)``
(the runtime's ``namespace`` label comes from the scrape: PodMonitor and the
usual ``kubernetes-pods`` relabelling both add it).
"""

from __future__ import annotations

from batchpilot_runtime.contract.metric_names import MetricSpec

LABEL_NAMESPACE = "namespace"
LABEL_PROFILE = "profile"
LABEL_MODEL = "model"
LABEL_DIRECTION = "direction"
LABEL_OUTCOME = "outcome"
LABEL_QUERY = "query"
LABEL_STATE = "state"
LABEL_CONDITION = "condition"
LABEL_LATENCY_METRIC = "latency_metric"
LABEL_QUANTILE = "quantile"

PROFILE_LABELS = (LABEL_NAMESPACE, LABEL_PROFILE, LABEL_MODEL)

# Values of the bounded labels.
DIRECTIONS = ("up", "down", "hold", "reset", "recommend")
PUSH_OUTCOMES = ("ok", "conflict", "refused", "unauthorized", "error")
POD_STATES = ("total", "ready", "synced")
CONDITIONS = ("Ready", "Synced", "MetricsAvailable", "SLOMet")
# batchpilot_operator_profile_condition's value for each metav1.Condition status.
CONDITION_VALUES = {"True": 1.0, "False": 0.0, "Unknown": -1.0}
LATENCY_METRICS = ("ttft", "queueWait", "e2e")
SLO_QUANTILES = ("0.99", "0.999")

# Prometheus queries and one whole tick take from a few ms (a handful of
# profiles) to several seconds (1,000 profiles): 5 ms to ~60 s in 1.5x steps.
OPERATOR_SECONDS_BUCKETS = (
    0.005, 0.0075, 0.01, 0.015, 0.025, 0.04, 0.06, 0.1, 0.15, 0.25, 0.4, 0.6,
    1.0, 1.5, 2.5, 4.0, 6.0, 10.0, 15.0, 25.0, 40.0, 60.0,
)  # fmt: skip

DECISIONS_TOTAL = "batchpilot_operator_decisions_total"
PUSHES_TOTAL = "batchpilot_operator_pushes_total"
PUSH_ERRORS_TOTAL = "batchpilot_operator_push_errors_total"
QUERY_ERRORS_TOTAL = "batchpilot_operator_query_errors_total"
QUERY_SECONDS = "batchpilot_operator_query_seconds"
TICK_SECONDS = "batchpilot_operator_tick_seconds"
PROFILES_MANAGED = "batchpilot_operator_profiles_managed"
PROFILE_PODS = "batchpilot_operator_profile_pods"
PROFILE_CONDITION = "batchpilot_operator_profile_condition"
SLO_SECONDS = "batchpilot_operator_slo_seconds"
WINDOW_TARGET_BATCH_SIZE = "batchpilot_operator_window_target_batch_size"
WINDOW_HARD_CAP = "batchpilot_operator_window_hard_cap"
WINDOW_MAX_WAIT_SECONDS = "batchpilot_operator_window_max_wait_seconds"
WINDOW_GENERATION = "batchpilot_operator_window_generation"
WINDOW_MAX_PREFILL_TOKENS = "batchpilot_operator_window_max_prefill_tokens"
WATCH_CHECKS_TOTAL = "batchpilot_operator_watch_checks_total"

OPERATOR_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        DECISIONS_TOTAL,
        "counter",
        "Tuning decisions, by direction (up, down, hold, reset, recommend).",
        (*PROFILE_LABELS, LABEL_DIRECTION),
    ),
    MetricSpec(PUSHES_TOTAL, "counter", "Window pushes to runtime pods, by outcome.", (*PROFILE_LABELS, LABEL_OUTCOME)),
    MetricSpec(
        PUSH_ERRORS_TOTAL, "counter", "Window pushes that failed (connection, timeout, 5xx, refused).", PROFILE_LABELS
    ),
    MetricSpec(QUERY_ERRORS_TOTAL, "counter", "Prometheus queries that failed or timed out, by query.", (LABEL_QUERY,)),
    MetricSpec(
        QUERY_SECONDS,
        "histogram",
        "Duration of one Prometheus query, by query.",
        (LABEL_QUERY,),
        OPERATOR_SECONDS_BUCKETS,
    ),
    MetricSpec(
        TICK_SECONDS,
        "histogram",
        "Duration of one observation-and-decision tick over all profiles.",
        (),
        OPERATOR_SECONDS_BUCKETS,
    ),
    MetricSpec(PROFILES_MANAGED, "gauge", "BatchProfiles this operator manages.", ()),
    MetricSpec(
        PROFILE_PODS,
        "gauge",
        "Runtime pods of a profile, by state (total, ready, synced).",
        (*PROFILE_LABELS, LABEL_STATE),
    ),
    MetricSpec(
        PROFILE_CONDITION,
        "gauge",
        "A profile's condition: 1 True, 0 False, -1 Unknown.",
        (*PROFILE_LABELS, LABEL_CONDITION),
    ),
    MetricSpec(
        SLO_SECONDS,
        "gauge",
        "A profile's latency SLO, by latency metric and quantile.",
        (*PROFILE_LABELS, LABEL_LATENCY_METRIC, LABEL_QUANTILE),
    ),
    MetricSpec(
        WINDOW_TARGET_BATCH_SIZE, "gauge", "targetBatchSize of the window the operator has in force.", PROFILE_LABELS
    ),
    MetricSpec(WINDOW_HARD_CAP, "gauge", "hardCap of the window the operator has in force.", PROFILE_LABELS),
    MetricSpec(WINDOW_MAX_WAIT_SECONDS, "gauge", "maxWaitMs of the window in force, in seconds.", PROFILE_LABELS),
    MetricSpec(WINDOW_GENERATION, "gauge", "Generation of the window the operator has in force.", PROFILE_LABELS),
    MetricSpec(
        WINDOW_MAX_PREFILL_TOKENS,
        "gauge",
        "maxPrefillTokens of the window in force (0 = unset: the pods' own budget).",
        PROFILE_LABELS,
    ),
    MetricSpec(
        WATCH_CHECKS_TOTAL,
        "counter",
        "Checks of the BatchProfile watch against a fresh list, by outcome (in_sync, behind: a gap seen once, "
        "stuck: the same gap twice, error: the list failed, standby: skipped while peering pauses this replica).",
        (LABEL_OUTCOME,),
    ),
)


def all_series_names() -> frozenset[str]:
    """Every series name the operator exposes."""
    return frozenset(n for spec in OPERATOR_METRICS for n in spec.series_names())
