"""The operator's own metrics (names from :mod:`batchpilot_operator.io.metric_names`), on their own registry."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from batchpilot_operator.io import metric_names as om


def _help(name: str) -> str:
    for spec in om.OPERATOR_METRICS:
        if spec.name == name:
            return spec.help
    raise KeyError(name)


def _labels(name: str) -> list[str]:
    for spec in om.OPERATOR_METRICS:
        if spec.name == name:
            return list(spec.labels)
    raise KeyError(name)


class OperatorMetrics:
    """One instance per operator process; a fresh registry so that tests can make many."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # prometheus_client appends _total to counters itself.
        self.decisions = Counter(
            om.DECISIONS_TOTAL.removesuffix("_total"),
            _help(om.DECISIONS_TOTAL),
            _labels(om.DECISIONS_TOTAL),
            registry=r,
        )
        self.pushes = Counter(
            om.PUSHES_TOTAL.removesuffix("_total"), _help(om.PUSHES_TOTAL), _labels(om.PUSHES_TOTAL), registry=r
        )
        self.push_errors = Counter(
            om.PUSH_ERRORS_TOTAL.removesuffix("_total"),
            _help(om.PUSH_ERRORS_TOTAL),
            _labels(om.PUSH_ERRORS_TOTAL),
            registry=r,
        )
        self.query_errors = Counter(
            om.QUERY_ERRORS_TOTAL.removesuffix("_total"),
            _help(om.QUERY_ERRORS_TOTAL),
            _labels(om.QUERY_ERRORS_TOTAL),
            registry=r,
        )
        self.query_seconds = Histogram(
            om.QUERY_SECONDS,
            _help(om.QUERY_SECONDS),
            _labels(om.QUERY_SECONDS),
            buckets=om.OPERATOR_SECONDS_BUCKETS,
            registry=r,
        )
        self.tick_seconds = Histogram(
            om.TICK_SECONDS, _help(om.TICK_SECONDS), buckets=om.OPERATOR_SECONDS_BUCKETS, registry=r
        )
        self.profiles_managed = Gauge(om.PROFILES_MANAGED, _help(om.PROFILES_MANAGED), registry=r)
        self.profile_pods = Gauge(om.PROFILE_PODS, _help(om.PROFILE_PODS), _labels(om.PROFILE_PODS), registry=r)
        self.profile_condition = Gauge(
            om.PROFILE_CONDITION, _help(om.PROFILE_CONDITION), _labels(om.PROFILE_CONDITION), registry=r
        )
        self.slo_seconds = Gauge(om.SLO_SECONDS, _help(om.SLO_SECONDS), _labels(om.SLO_SECONDS), registry=r)
        self.window_target = Gauge(
            om.WINDOW_TARGET_BATCH_SIZE,
            _help(om.WINDOW_TARGET_BATCH_SIZE),
            _labels(om.WINDOW_TARGET_BATCH_SIZE),
            registry=r,
        )
        self.window_cap = Gauge(om.WINDOW_HARD_CAP, _help(om.WINDOW_HARD_CAP), _labels(om.WINDOW_HARD_CAP), registry=r)
        self.window_wait = Gauge(
            om.WINDOW_MAX_WAIT_SECONDS,
            _help(om.WINDOW_MAX_WAIT_SECONDS),
            _labels(om.WINDOW_MAX_WAIT_SECONDS),
            registry=r,
        )
        self.window_generation = Gauge(
            om.WINDOW_GENERATION, _help(om.WINDOW_GENERATION), _labels(om.WINDOW_GENERATION), registry=r
        )
        self.window_budget = Gauge(
            om.WINDOW_MAX_PREFILL_TOKENS,
            _help(om.WINDOW_MAX_PREFILL_TOKENS),
            _labels(om.WINDOW_MAX_PREFILL_TOKENS),
            registry=r,
        )
        self.watch_checks = Counter(
            om.WATCH_CHECKS_TOTAL.removesuffix("_total"),
            _help(om.WATCH_CHECKS_TOTAL),
            _labels(om.WATCH_CHECKS_TOTAL),
            registry=r,
        )
        self._per_profile: tuple[Counter | Gauge, ...] = (
            self.profile_pods,
            self.profile_condition,
            self.slo_seconds,
            self.window_target,
            self.window_cap,
            self.window_wait,
            self.window_generation,
            self.window_budget,
        )

    def forget_profile(self, namespace: str, profile: str, model: str) -> None:
        """Drop a deleted profile's gauges so they do not linger at their last value."""
        for gauge in self._per_profile:
            for labels in _label_sets(gauge):
                if labels[:3] == (namespace, profile, model):
                    gauge.remove(*labels)

    def serve(self, port: int, address: str = "0.0.0.0") -> threading.Thread | None:
        """Serve /metrics on ``port`` (0 disables). Returns the server thread."""
        if port <= 0:
            return None
        _, thread = start_http_server(port, addr=address, registry=self.registry)
        return thread


def _label_sets(metric: Counter | Gauge) -> Iterable[tuple[str, ...]]:
    # prometheus_client keeps children in a private dict; copying its keys is its documented-free way.
    return list(getattr(metric, "_metrics", {}).keys())
