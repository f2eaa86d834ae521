"""The four conditions of a BatchProfile's status, as pure functions of plain values.

Each function takes what one tick established (no controller, no clock, no I/O) and returns the
:class:`ConditionFact` that :func:`batchpilot_operator.control.status.build_status` writes. A pod's
failed push is a :class:`PodFailure` value carrying its outcome, so a refusal is recognised by
``outcome == REFUSED``, never by matching text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.control.status import FALSE, TRUE, UNKNOWN, ConditionFact
from batchpilot_operator.io.outcomes import REFUSED
from batchpilot_operator.tuning import policy as policy_mod
from batchpilot_operator.tuning.observations import Observations, known

MAX_MESSAGE_CHARS = 4000


@dataclass(frozen=True)
class PodFailure:
    """Why a pod does not run the window: a push outcome (refused, conflict, unauthorized, error) and its detail."""

    outcome: str
    detail: str

    def __str__(self) -> str:
        return f"{self.outcome}: {self.detail}"

    def __contains__(self, text: str) -> bool:
        """Searching a failure searches its message (``"not sent" in failure``)."""
        return text in str(self)


@dataclass(frozen=True)
class SyncView:
    """What the Synced condition rests on: the profile's Ready pods and how their pushes went.

    ``failures`` holds only Ready pods' failures; ``generation`` is the window in force (0: none).
    """

    model: str
    ready: int
    synced: int
    generation: int = 0
    recommend: bool = False
    sync_error: str | None = None
    failures: Mapping[str, PodFailure] = field(default_factory=dict)
    clamped: Mapping[str, str] = field(default_factory=dict)


PENDING_METRICS = ConditionFact(UNKNOWN, "Pending", "no observation yet")


def metrics_fact(
    error: str | None,
    window_s: float | None,
    obs: Observations,
    *,
    model: str,
    namespace: str,
    latency_metric: str,
) -> ConditionFact:
    """MetricsAvailable: the source failed (``error``), had no series (``window_s`` None), no data, or data."""
    if error:
        return ConditionFact(FALSE, "MetricsUnavailable", error)
    if window_s is None:
        return ConditionFact(FALSE, "NoSeries", f"no series for model {model!r} in namespace {namespace!r}")
    if not known(obs.p99_s):
        return ConditionFact(FALSE, "NoData", f"no {latency_metric} observations in the last {window_s:.0f} s")
    return ConditionFact(TRUE, "MetricsAvailable", f"P99 from {obs.samples:.0f} requests over {window_s:.0f} s")


def synced_fact(view: SyncView) -> ConditionFact:
    """Synced: in order, no Ready pod, a sync that raised, recommend mode, failed pushes, pods behind, in sync."""
    if not view.ready:
        return ConditionFact(FALSE, "NoReadyPods", f"no Ready pod matches the selector of model {view.model!r}")
    if view.sync_error is not None:
        return ConditionFact(FALSE, "PushFailed", f"sync failed: {view.sync_error}"[:MAX_MESSAGE_CHARS])
    if view.recommend:
        return ConditionFact(TRUE, "RecommendOnly", "recommend mode: the operator never pushes")
    if view.failures:
        refused = any(failure.outcome == REFUSED for failure in view.failures.values())
        message = "; ".join(f"{pod}: {failure}" for pod, failure in sorted(view.failures.items()))
        return ConditionFact(FALSE, "PushRefused" if refused else "PushFailed", message[:MAX_MESSAGE_CHARS])
    if view.synced < view.ready:
        return ConditionFact(FALSE, "Pending", f"{view.synced} of {view.ready} Ready pods run the window")
    clamps = "; ".join(f"{pod}: {detail}" for pod, detail in sorted(view.clamped.items()))
    if clamps:
        return ConditionFact(TRUE, "Clamped", clamps)
    return ConditionFact(TRUE, "Synced", f"{view.ready} Ready pods run generation {view.generation}")


def ready_fact(synced: ConditionFact) -> ConditionFact:
    """Ready follows Synced: True as "Ready", otherwise Synced's reason and message."""
    if synced.status == TRUE:
        return ConditionFact(TRUE, "Ready", synced.message)
    return ConditionFact(FALSE, synced.reason, synced.message)


def slo_fact(spec: BatchProfileSpec, obs: Observations | None) -> ConditionFact:
    """SLOMet: False when any objective of the SLO is over, unknown with no data for any."""
    slo = spec.slo
    over = None if obs is None else policy_mod.slo_over(spec, obs)
    if obs is None or over is None:
        return ConditionFact(UNKNOWN, "NoData", "no latency data")
    parts: list[str] = []
    if slo.p99_ms is not None and not math.isnan(policy_mod.latency_ratio(spec, obs)):
        parts.append(
            f"P99 {obs.p99_s * 1000:.0f} ms vs SLO {slo.p99_ms:g} ms" + (" (top bucket)" if obs.p99_saturated else "")
        )
    p999_over = slo.p999_ms is not None and (
        obs.p999_saturated or (known(obs.p999_s) and obs.p999_s * 1000 > slo.p999_ms)
    )
    if slo.inter_token_p99_ms is not None and not math.isnan(policy_mod.itl_ratio(spec, obs)):
        parts.append(f"inter-token P99 {obs.itl_p99_s * 1000:.0f} ms vs {slo.inter_token_p99_ms:g} ms")
    text = "; ".join(parts)
    if over or p999_over:
        return ConditionFact(FALSE, "SLOMissed", text + (" (P99.9 over)" if p999_over and not over else ""))
    return ConditionFact(TRUE, "SLOMet", text)


def invalid_spec_facts(error: str | None) -> tuple[ConditionFact, ConditionFact, ConditionFact, ConditionFact]:
    """Ready, Synced, MetricsAvailable and SLOMet of a profile whose spec did not validate."""
    return (
        ConditionFact(FALSE, "InvalidSpec", error or "invalid spec"),
        ConditionFact(UNKNOWN, "InvalidSpec", "nothing is pushed for an invalid spec"),
        ConditionFact(UNKNOWN, "InvalidSpec", "not observed"),
        ConditionFact(UNKNOWN, "InvalidSpec", "not observed"),
    )
