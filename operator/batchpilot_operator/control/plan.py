"""One profile's plan for a tick, and every window generation the operator assigns: pure functions.

:func:`plan` takes a profile's record, its observations and the time (with what its canary's evaluation
asks and the Ready pods a canary may start on) and returns a :class:`Plan`: the decision, the window in
force afterwards with its generation, and the canary to start, if any. One branch per mode: static holds
the spec's window, recommend and restart report what the policy would put in force, adaptive puts it in
force (or tries it on a canary first). :func:`sync_path` then says how the window reaches the pods, per mode
and engine, and :func:`push_groups` which pods get which window. The controller applies the plan
(control/controller.py) and runs the sync path (control/sync_paths.py).

This module alone numbers windows (:func:`numbered`): the starting window (:func:`starting_window`, and
:func:`window_for_spec` on a new spec), a new set of lanes (:func:`relaned`), the policy's and the canary's
windows (:func:`plan`), a window past a pod's conflict (:func:`past_conflict`) and the window a restarted
workload runs (:func:`followed`). Each is one past the generation it replaces (a new spec.window: past the one
last written to status, which the pods run), so the generations of the window in force only increase; the
policy never numbers.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchpilot_operator.api.profile import RECOMMENDING, BatchProfileSpec, EngineKind, TuningMode
from batchpilot_operator.control.facts import pods_window
from batchpilot_operator.control.records import PodRecord, ProfileRecord, window_from_status
from batchpilot_operator.control.status import rfc3339
from batchpilot_operator.tuning import policy as policy_mod
from batchpilot_operator.tuning.canary import choose_pods
from batchpilot_operator.tuning.observations import Observations
from batchpilot_runtime.contract.window import Window

# Engines whose pods answer the admin API: batchpilot's runtime, and the gate in front of llama-server.
ADMIN_API_ENGINES = frozenset({EngineKind.BATCHPILOT, EngineKind.LLAMACPP})

STATIC_REASON = "Static mode: the spec's window is pushed as it is."


# ---- numbering --------------------------------------------------------------------------------------


def numbered(window: Window, *, past: int | None) -> Window:
    """``window`` numbered one past generation ``past`` (1 when there is none)."""
    return window.with_generation((past or 0) + 1)


def starting_window(spec: BatchProfileSpec, in_force: Window | None, written: Mapping[str, Any]) -> Window:
    """The window in force once ``spec`` is known. Static mode: the spec's window, renumbered when its
    fields change. Otherwise ``in_force``, or the spec's window when none is in force.

    A new window is numbered past the one in force or, when none is (a new spec.window clears it, and an
    adopted profile has none yet), past the one last written to status (``written``), never from 1
    again: the pods run that generation, and a runtime keeps the window it has for a generation it
    already holds."""
    if spec.mode == TuningMode.STATIC:
        current = in_force or window_from_status(written)
        if current is not None and current.fields_equal(spec.window):
            return current
        return numbered(Window.from_fields(spec.window, 1), past=current.generation if current else None)
    if in_force is not None:
        return in_force
    previous = window_from_status(written)
    return numbered(Window.from_fields(spec.window, 1), past=previous.generation if previous else None)


def window_for_spec(
    spec: BatchProfileSpec, old_spec: BatchProfileSpec | None, in_force: Window | None, written: Mapping[str, Any]
) -> Window:
    """The window in force once ``spec`` replaces ``old_spec`` (None: a new profile, or one whose spec was
    invalid): a new spec.window starts again from it (numbered past the window in status), new lanes
    renumber the window in force, anything else keeps it (see :func:`starting_window`)."""
    if old_spec is not None and spec.window != old_spec.window:
        in_force = None
    elif old_spec is not None and spec.lanes != old_spec.lanes and in_force is not None:
        in_force = relaned(in_force)
    return starting_window(spec, in_force, written)


def relaned(in_force: Window) -> Window:
    """``in_force`` again, one generation on: the pods must take the spec's new lanes with it."""
    return numbered(in_force, past=in_force.generation)


def past_conflict(in_force: Window, newest: int | None) -> Window | None:
    """``in_force`` numbered past ``newest``, the newest generation a pod answered a conflict with (an
    earlier operator, a lost status); None when no pod holds a generation as new as it."""
    if newest is None or newest < in_force.generation:
        return None
    return numbered(in_force, past=newest)


def followed(in_force: Window | None, running: Window | None) -> Window | None:
    """Restart mode: the window in force becomes the one the workload runs (``running``, None when its
    args make none), numbered past the last one when its fields changed."""
    if running is None or (in_force is not None and in_force.fields_equal(running)):
        return in_force
    return numbered(running, past=in_force.generation if in_force else None)


def _numbered(decision: policy_mod.Decision, in_force: Window) -> policy_mod.Decision:
    """A changed decision's window numbered past the one in force: what is pushed, recommended and
    announced carries the generation it would go out with."""
    if not decision.changed:
        return decision
    return dataclasses.replace(decision, window=numbered(decision.window, past=in_force.generation))


# ---- the plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CanaryEvaluation:
    """What a tick's canary evaluation (control/canary.py) asks of the plan: hold the policy
    (``hold_reason``), and, when the canary ended, put ``ended`` in force on every pod, numbered past
    ``past`` (None: promoted, as it was numbered when its canary started)."""

    hold_reason: str | None = None
    ended: Window | None = None
    past: int | None = None


@dataclass(frozen=True)
class Plan:
    """One profile's tick: the decision announced, the window in force afterwards, how many windows
    went in force or on a canary (the tick's ``changed``), the canary to start (pod keys: ``decision``'s
    window goes to them first, ``window`` stays the baseline's), and in recommend and restart modes the
    window the policy recommends (None: none)."""

    decision: policy_mod.Decision
    window: Window
    changed: int = 0
    canary_pods: tuple[str, ...] = ()
    recommends: bool = False
    recommended: Window | None = None


def canary_wanted(spec: BatchProfileSpec | None) -> bool:
    """Whether the profile's new windows go through a canary (its spec allows one: see api/canary.py)."""
    return (
        spec is not None
        and spec.tuning.canary.enabled
        and spec.mode == TuningMode.ADAPTIVE
        and spec.engine == EngineKind.BATCHPILOT
    )


def screen(record: ProfileRecord, decision: policy_mod.Decision, now_s: float) -> policy_mod.Decision:
    """``decision``, or a hold (with the policy's memory as it was) when it proposes the window a canary
    rolled back before ``record.canary.rejected_until_s``."""
    rejected = record.canary.rejected
    if not decision.changed or rejected is None or now_s >= record.canary.rejected_until_s:
        return decision
    if not decision.window.fields_equal(rejected):
        return decision
    reason = (
        f"Holding: {decision.window.describe()} was rolled back by its canary; not tried again before "
        f"{rfc3339(record.canary.rejected_until_s)}."
    )
    return policy_mod.Decision(record.loop.window or decision.window, "hold", reason, record.memory.policy_state)


def plan(
    record: ProfileRecord,
    obs: Observations,
    now_s: float,
    canary: CanaryEvaluation = CanaryEvaluation(),
    ready_pods: Sequence[str] = (),
) -> Plan:
    """The profile's plan for this tick (see the module docstring). ``record`` must have a valid spec and
    a window in force (:func:`starting_window`); ``ready_pods``: the keys of its Ready pods."""
    spec, window = record.spec, record.loop.window
    if spec is None or window is None:
        raise ValueError(f"profile {record.ref.key} has no valid spec or no window in force: nothing to plan")
    state = record.memory.policy_state
    if spec.mode == TuningMode.STATIC:
        return Plan(policy_mod.Decision(window, "hold", STATIC_REASON, state), window)
    if spec.mode in RECOMMENDING:  # restart mode: the window in force is what the workload runs
        in_force = pods_window(record) or window
        decision = _numbered(policy_mod.decide(spec, in_force, obs, state, now_s), in_force)
        return Plan(decision, window, recommends=True, recommended=decision.window if decision.changed else None)
    return _plan_adaptive(record, spec, window, obs, now_s, canary, ready_pods)


def _plan_adaptive(
    record: ProfileRecord,
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    now_s: float,
    canary: CanaryEvaluation,
    ready_pods: Sequence[str],
) -> Plan:
    """Adaptive mode: the policy's decision in force on every pod or (tuning.canary) on the canary pods
    first; while a canary runs the policy holds, and a canary that ends puts its outcome in force."""
    in_force, changed = window, 0
    if canary.ended is not None:  # promoted: numbered when it started; rolled back: past the canary's
        in_force = canary.ended if canary.past is None else numbered(canary.ended, past=canary.past)
        changed = 1
    if canary.hold_reason is not None:
        return Plan(
            policy_mod.Decision(in_force, "hold", canary.hold_reason, record.memory.policy_state), in_force, changed
        )
    proposed = policy_mod.decide(spec, window, obs, record.memory.policy_state, now_s)
    decision = _numbered(screen(record, proposed, now_s), window)
    if not decision.changed:
        return Plan(decision, in_force, changed)
    chosen = choose_pods(record.ref.key, list(ready_pods), spec.tuning.canary.share) if canary_wanted(spec) else ()
    if chosen:
        return Plan(decision, in_force, changed + 1, canary_pods=tuple(chosen))
    return Plan(decision, decision.window, changed + 1)


# ---- how the window reaches the pods ----------------------------------------------------------------


class SyncPath(enum.Enum):
    """How a profile's window reaches its pods (control/sync_paths.py runs each)."""

    NONE = "none"  # nothing to send or read: no valid spec or no window, or recommend mode without an admin API
    RESTART = "restart"  # restart mode: the recommendation goes into the workload's args (control/restart.py)
    READ = "read"  # recommend mode: the pods' windows are read, for status, never written
    SGLANG = "sglang"  # SGLang has no window: its cap and budget go through /set_internal_state
    PUSH = "push"  # the admin API (batchpilot's runtime, the gate): the window is pushed, the canary's to its pods


def sync_path(spec: BatchProfileSpec | None, window: Window | None) -> SyncPath:
    """The profile's sync path, by mode and engine."""
    if spec is None:
        return SyncPath.NONE
    if spec.mode == TuningMode.RESTART:
        return SyncPath.RESTART if window is not None else SyncPath.NONE
    if spec.mode == TuningMode.RECOMMEND:
        return SyncPath.READ if spec.engine in ADMIN_API_ENGINES else SyncPath.NONE
    if window is None:
        return SyncPath.NONE
    return SyncPath.SGLANG if spec.engine == EngineKind.SGLANG else SyncPath.PUSH


def push_groups(
    record: ProfileRecord, pods: Sequence[PodRecord], window: Window
) -> list[tuple[list[PodRecord], Window]]:
    """Which pods get which window: the canary pods the canary's while it runs, the rest ``window``."""
    run = record.canary.run
    if run is None or not canary_wanted(record.spec):  # a canary the spec no longer wants ends at its next decision
        return [(list(pods), window)]
    return [([p for p in pods if p.key not in run.pods], window), ([p for p in pods if p.key in run.pods], run.window)]
