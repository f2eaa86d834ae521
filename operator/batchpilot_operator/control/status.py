"""Build a BatchProfile's status and the smallest merge patch that writes it.

Pure functions: the controller gathers the facts of one tick into
:class:`StatusFacts`; :func:`build_status` turns them into the status block
(conditions in the metav1.Condition shape, with ``lastTransitionTime`` kept
while a condition's status does not change); :func:`merge_patch` diffs it
against what was last written, so that an unchanged status is never patched
and a patch that failed is simply recomputed, whole, on the next tick.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchpilot_operator.api.canary import CanaryStatus
from batchpilot_operator.api.profile import TuningMode
from batchpilot_operator.api.status import (
    BatchProfileStatus,
    Condition,
    Decision,
    FriendlinessStatus,
    Observed,
    PodsStatus,
    PolicyMemory,
    WindowInForce,
)
from batchpilot_runtime.contract.window import Window

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


def rfc3339(epoch_s: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_s, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class ConditionFact:
    status: str
    reason: str
    message: str = ""


@dataclass(frozen=True)
class StatusFacts:
    """What one tick established about one profile."""

    generation: int | None
    mode: TuningMode | None = None  # the mode in force (spec.tuning.mode or the engine's default)
    window: WindowInForce | None = None
    starting_window: str | None = None  # where the spec's starting window came from
    observed: Observed | None = None
    pods: PodsStatus | None = None
    last_decision: Decision | None = None
    recommended_window: Window | None = None
    friendliness: FriendlinessStatus | None = None
    policy: PolicyMemory | None = None
    canary: CanaryStatus | None = None
    ready: ConditionFact = ConditionFact(UNKNOWN, "Pending")
    synced: ConditionFact = ConditionFact(UNKNOWN, "Pending")
    metrics_available: ConditionFact = ConditionFact(UNKNOWN, "Pending")
    slo_met: ConditionFact = ConditionFact(UNKNOWN, "Pending")


def _condition(
    type_: str, fact: ConditionFact, generation: int | None, previous: Mapping[str, Any] | None, now_iso: str
) -> Condition:
    unchanged = previous is not None and previous.get("status") == fact.status
    transition = str(previous.get("lastTransitionTime")) if unchanged and previous is not None else now_iso
    return Condition(
        type=type_,
        status=fact.status,
        reason=fact.reason,
        message=fact.message[:32768],
        last_transition_time=transition,
        observed_generation=generation,
    )


def build_status(facts: StatusFacts, previous_status: Mapping[str, Any] | None, now_iso: str) -> dict[str, Any]:
    """The status block (camelCase JSON) for these facts, keeping transition times and the
    ``observed.at`` of figures that did not change."""
    previous_status = previous_status or {}
    previous_conditions = {c.get("type"): c for c in previous_status.get("conditions") or [] if isinstance(c, Mapping)}
    conditions = [
        _condition(name, fact, facts.generation, previous_conditions.get(name), now_iso)
        for name, fact in (
            ("Ready", facts.ready),
            ("Synced", facts.synced),
            ("MetricsAvailable", facts.metrics_available),
            ("SLOMet", facts.slo_met),
        )
    ]
    observed = facts.observed
    if observed is not None:
        old = previous_status.get("observed")
        new_figures = observed.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"at"})
        if isinstance(old, Mapping) and {k: v for k, v in old.items() if k != "at"} == new_figures:
            observed = observed.model_copy(update={"at": old.get("at")})
    status = BatchProfileStatus(
        observed_generation=facts.generation,
        mode=facts.mode,
        window=facts.window,
        starting_window=facts.starting_window,
        observed=observed,
        friendliness=facts.friendliness,
        pods=facts.pods,
        last_decision=facts.last_decision,
        recommended_window=facts.recommended_window,
        policy=facts.policy,
        canary=facts.canary,
        conditions=conditions,
    )
    return status.model_dump(by_alias=True, exclude_none=True, mode="json")


def merge_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch turning ``old`` into ``new`` (keys gone become null; lists are replaced)."""
    old = old or {}
    patch: dict[str, Any] = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or before != value:
            patch[key] = value
    return patch


def apply_merge_patch(target: Mapping[str, Any] | None, patch: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 applied to a copy of ``target`` (what the API server does with our patch)."""
    result: dict[str, Any] = dict(target or {})
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping):
            before = result.get(key)
            result[key] = apply_merge_patch(before if isinstance(before, Mapping) else {}, value)
        else:
            result[key] = value
    return result
