"""One profile's :class:`StatusFacts`, a pure function of its record and its pods."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from batchpilot_operator.api.canary import CanaryStatus
from batchpilot_operator.api.profile import TuningMode
from batchpilot_operator.api.status import PodsStatus, WindowInForce
from batchpilot_operator.control import conditions
from batchpilot_operator.control.conditions import SyncView
from batchpilot_operator.control.records import PodRecord, ProfileRecord
from batchpilot_operator.control.status import StatusFacts
from batchpilot_operator.tuning import policy_memo
from batchpilot_runtime.contract.window import Window


def pods_window(record: ProfileRecord) -> Window | None:
    """The window some pod of the profile was last seen running (recommend mode shows it)."""
    for state in record.sync.pod_states.values():
        return state.window
    return None


RESTARTED_CANARY = (
    "the operator restarted during this canary (its per-pod figures went with it): its pods are sent the "
    "window in force"
)


def _written_canary(status: Mapping[str, object] | None) -> CanaryStatus | None:
    """status.canary as written, None when there is none or it does not validate."""
    written = status.get("canary") if status else None
    if not isinstance(written, Mapping):
        return None
    try:
        return CanaryStatus.model_validate(written)
    except ValueError:
        return None


def ended_by_restart(status: Mapping[str, object] | None) -> CanaryStatus | None:
    """The canary an earlier operator left running in ``status`` (status.canary, verdict running), reported
    rolled back; None when there is none (or it had ended).

    A restart does not resume it: what judges a canary (its pods' rate windows, the intervals without
    data) was the earlier operator's memory. The loop puts the window in force (the baseline's) on every
    pod, past the canary's generation, when the canary pods answer it with a conflict."""
    old = _written_canary(status)
    if old is None or old.verdict != "running":
        return None
    return old.model_copy(update={"verdict": "rolledBack", "reason": RESTARTED_CANARY})


def canary_status(record: ProfileRecord) -> CanaryStatus | None:
    """status.canary: the last canary in memory, else the one an earlier operator wrote (one it left running
    is reported rolled back, see :func:`ended_by_restart`)."""
    if record.canary.last is not None:
        return record.canary.last
    return ended_by_restart(record.status.written) or _written_canary(record.status.written)


def status_facts(record: ProfileRecord, pods: Sequence[PodRecord]) -> StatusFacts:
    """What the status of ``record`` says, given its pods (all of them, Ready or not)."""
    spec = record.spec
    policy = policy_memo.to_status(record.memory.policy_state, record.generation)
    if spec is None:
        ready, synced, metrics_available, slo_met = conditions.invalid_spec_facts(record.error)
        return StatusFacts(
            generation=record.generation,
            ready=ready,
            synced=synced,
            metrics_available=metrics_available,
            slo_met=slo_met,
            policy=policy,
        )
    pods = pods
    ready_pods = [p for p in pods if p.ready]
    window = record.loop.window
    recommend = spec.mode == TuningMode.RECOMMEND
    if recommend:
        shown = pods_window(record)
        synced_pods = [p for p in ready_pods if p.key in record.sync.pod_states]
    else:
        shown = window
        synced_pods = [
            p
            for p in ready_pods
            if window is not None
            and (
                (
                    (state := record.sync.pod_states.get(p.key)) is not None
                    and state.window.generation >= window.generation
                )
                or record.sync.applied.get(p.key, 0) >= window.generation
            )
            and p.key not in record.sync.pod_errors
        ]
    ready_keys = {p.key for p in ready_pods}
    synced = conditions.synced_fact(
        SyncView(
            model=spec.model,
            ready=len(ready_pods),
            synced=len(synced_pods),
            generation=window.generation if window else 0,
            recommend=recommend,
            sync_error=record.sync.error,
            failures={pod: failure for pod, failure in record.sync.pod_errors.items() if pod in ready_keys},
            clamped=record.sync.clamped,
        )
    )
    obs = record.memory.observations
    return StatusFacts(
        generation=record.generation,
        mode=spec.mode,
        window=WindowInForce(**shown.model_dump(), applied_at=None) if shown is not None else None,
        starting_window=spec.window_source,
        observed=obs.to_status() if obs is not None else None,
        pods=PodsStatus(
            total=len(pods),
            ready=len(ready_pods),
            synced=len(synced_pods),
            summary=f"{len(synced_pods)}/{len(ready_pods)}",
        ),
        last_decision=record.memory.last_decision,
        recommended_window=record.memory.recommended,
        friendliness=record.memory.friendliness,
        policy=policy,
        canary=canary_status(record),
        ready=conditions.ready_fact(synced),
        synced=synced,
        metrics_available=record.memory.metrics_fact,
        slo_met=conditions.slo_fact(spec, obs),
    )
