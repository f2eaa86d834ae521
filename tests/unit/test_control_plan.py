"""The per-profile plan (control/plan.py): the decision and the window in force per mode, the canary it
starts, the sync path per mode and engine, and the one place windows are numbered."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.control.plan import (
    STATIC_REASON,
    CanaryEvaluation,
    SyncPath,
    followed,
    past_conflict,
    plan,
    push_groups,
    relaned,
    screen,
    starting_window,
    sync_path,
    window_for_spec,
)
from batchpilot_operator.control.records import PodRecord, ProfileRecord, ProfileRef
from batchpilot_operator.tuning.canary import CanaryRun
from batchpilot_runtime.contract.window import Window
from tests.support.factories import make_observations, make_spec, make_window

NOW_S = 10_000.0
OVER_SLO = make_observations(p99_s=2.0)  # the spec's P99 is 500 ms: the policy lowers the window
CANARY = {"cooldownSeconds": 0, "canary": {"enabled": True, "share": 0.5}}
PODS = ("ml/chat-0", "ml/chat-1", "ml/chat-2", "ml/chat-3")


def make_record(spec: BatchProfileSpec, *, written: dict[str, Any] | None = None) -> ProfileRecord:
    """A profile ``ml/chat`` with ``spec`` and its starting window in force (past ``written``'s window)."""
    record = ProfileRecord(ref=ProfileRef("ml", "chat"), generation=1, spec=spec, error=None)
    record.status.written = dict(written or {})
    record.loop.window = starting_window(spec, None, record.status.written)
    return record


def status_with(window: Window) -> dict[str, Any]:
    return {"window": window.model_dump(by_alias=True)}


# ---- numbering --------------------------------------------------------------------------------------


def test_the_starting_window_is_numbered_past_the_one_last_written_to_status() -> None:
    assert make_record(make_spec()).loop.window == Window.from_fields(make_spec().window, 1)
    written = status_with(make_window(generation=7))
    assert make_record(make_spec(), written=written).loop.window == Window.from_fields(make_spec().window, 8)


def test_a_window_in_force_is_kept_outside_static_mode() -> None:
    in_force = make_window(target=4, cap=8, generation=5)
    assert starting_window(make_spec(), in_force, {}) is in_force


def test_static_mode_keeps_the_spec_window_while_its_fields_hold_and_renumbers_it_when_they_change() -> None:
    spec = make_spec(tuning={"mode": "static"})
    same = Window.from_fields(spec.window, 4)
    assert starting_window(spec, same, {}) is same
    other = make_window(target=2, cap=4, generation=4)
    assert starting_window(spec, other, {}) == Window.from_fields(spec.window, 5)
    assert starting_window(spec, None, status_with(other)) == Window.from_fields(spec.window, 5)


LANES = [{"name": "critical", "window": {"targetBatchSize": 1, "hardCap": 2, "maxWaitMs": 0}, "reservedSlots": 1}]


def test_a_new_spec_keeps_the_window_in_force_unless_its_window_or_lanes_change() -> None:
    spec, in_force = make_spec(), make_window(target=4, cap=8, generation=5)
    written = status_with(make_window(generation=3))
    assert window_for_spec(spec, None, None, written) == Window.from_fields(spec.window, 4)  # a new profile
    assert window_for_spec(make_spec(slo={"p99Ms": 300}), spec, in_force, written) is in_force
    new_window = make_spec(window={"targetBatchSize": 2, "hardCap": 4, "maxWaitMs": 10})
    assert window_for_spec(new_window, spec, in_force, written) == Window.from_fields(new_window.window, 4)
    assert window_for_spec(make_spec(lanes=LANES), spec, in_force, written) == in_force.with_generation(6)


def test_new_lanes_move_the_window_one_generation_on() -> None:
    assert relaned(make_window(generation=3)) == make_window(generation=4)


@pytest.mark.parametrize(
    ("newest", "expected"),
    [(None, None), (2, None), (3, 4), (9, 10)],
    ids=["no-conflict", "older-than-in-force", "as-new-as-in-force", "newer"],
)
def test_a_conflict_numbers_the_window_past_the_newest_generation_a_pod_holds(
    newest: int | None, expected: int | None
) -> None:
    moved = past_conflict(make_window(generation=3), newest)
    assert (moved.generation if moved is not None else None) == expected
    assert moved is None or moved.fields_equal(make_window())


def test_restart_mode_follows_the_workload_numbered_past_the_window_in_force() -> None:
    in_force = make_window(generation=3)
    assert followed(in_force, None) is in_force  # args that make no window: the window in force stays
    assert followed(in_force, make_window(generation=1)) is in_force  # the same fields: no new generation
    assert followed(in_force, make_window(cap=32, generation=1)) == make_window(cap=32, generation=4)
    assert followed(None, make_window(cap=32, generation=9)) == make_window(cap=32, generation=1)


# ---- the plan per mode ------------------------------------------------------------------------------


def test_static_mode_holds_the_spec_window() -> None:
    record = make_record(make_spec(tuning={"mode": "static"}))
    planned = plan(record, OVER_SLO, NOW_S)
    assert (planned.decision.direction, planned.decision.reason) == ("hold", STATIC_REASON)
    assert (planned.window, planned.changed, planned.canary_pods) == (record.loop.window, 0, ())


@pytest.mark.parametrize("mode", ["recommend", "restart"])
def test_recommending_modes_number_the_recommendation_and_keep_the_window_in_force(mode: str) -> None:
    restart = {"workload": {"kind": "Deployment", "name": "chat", "container": "engine"}} if mode == "restart" else None
    engine = "vllm" if mode == "restart" else "batchpilot"
    record = make_record(make_spec(tuning={"mode": mode, "cooldownSeconds": 0}, restart=restart, engine=engine))
    planned = plan(record, OVER_SLO, NOW_S)
    assert planned.decision.changed and planned.decision.window.generation == 2
    assert (planned.window, planned.changed, planned.recommends) == (record.loop.window, 0, True)
    assert planned.recommended == planned.decision.window


def test_adaptive_mode_puts_a_changed_window_in_force_one_generation_on() -> None:
    record = make_record(make_spec())
    planned = plan(record, OVER_SLO, NOW_S, ready_pods=PODS)
    assert planned.decision.changed and planned.decision.direction == "down"
    assert (planned.window, planned.window.generation, planned.changed) == (planned.decision.window, 2, 1)
    assert (planned.canary_pods, planned.recommends) == ((), False)


def test_adaptive_mode_holds_without_latency_data() -> None:
    record = make_record(make_spec())
    planned = plan(record, make_observations(p99_s=math.nan, samples=0.0), NOW_S, ready_pods=PODS)
    assert not planned.decision.changed and (planned.window, planned.changed) == (record.loop.window, 0)


def test_a_canary_takes_the_new_window_to_half_the_pods_and_the_window_in_force_stays() -> None:
    record = make_record(make_spec(tuning=CANARY))
    planned = plan(record, OVER_SLO, NOW_S, ready_pods=PODS)
    assert len(planned.canary_pods) == 2 and set(planned.canary_pods) <= set(PODS)
    assert (planned.window, planned.changed) == (record.loop.window, 1)
    assert planned.decision.window.generation == 2


def test_a_canary_without_a_ready_pod_to_try_it_on_puts_the_window_in_force_at_once() -> None:
    record = make_record(make_spec(tuning=CANARY))
    planned = plan(record, OVER_SLO, NOW_S, ready_pods=())
    assert planned.canary_pods == () and planned.window == planned.decision.window


def test_a_running_canary_holds_the_policy() -> None:
    record = make_record(make_spec(tuning=CANARY))
    planned = plan(record, OVER_SLO, NOW_S, CanaryEvaluation(hold_reason="Holding while the canary runs."))
    assert (planned.decision.direction, planned.decision.reason) == ("hold", "Holding while the canary runs.")
    assert (planned.window, planned.changed) == (record.loop.window, 0)


def test_a_promoted_canary_goes_in_force_as_numbered_and_a_rolled_back_one_past_its_generation() -> None:
    record = make_record(make_spec(tuning=CANARY))
    tried = make_window(cap=8, target=4, generation=2)
    promoted = plan(record, OVER_SLO, NOW_S, CanaryEvaluation("promoted", ended=tried))
    assert (promoted.window, promoted.changed, promoted.decision.window) == (tried, 1, tried)
    assert record.loop.window is not None
    back = plan(record, OVER_SLO, NOW_S, CanaryEvaluation("rolled back", ended=record.loop.window, past=2))
    assert back.window.fields_equal(record.loop.window) and back.window.generation == 3


def test_a_window_a_canary_rolled_back_is_not_proposed_again_before_its_hold_ends() -> None:
    record = make_record(make_spec(tuning=CANARY))
    proposed = plan(record, OVER_SLO, NOW_S, ready_pods=PODS).decision
    record.canary.rejected, record.canary.rejected_until_s = proposed.window, NOW_S + 60
    held = screen(record, proposed, NOW_S)
    assert held.direction == "hold" and "was rolled back by its canary" in held.reason
    assert held.window == record.loop.window and held.state is record.memory.policy_state
    assert screen(record, proposed, NOW_S + 60) is proposed


def test_a_profile_without_a_window_has_no_plan() -> None:
    record = make_record(make_spec())
    record.loop.window = None
    with pytest.raises(ValueError, match="no window in force"):
        plan(record, OVER_SLO, NOW_S)


# ---- the sync path and the pods it pushes -----------------------------------------------------------


@pytest.mark.parametrize(
    ("tuning", "engine", "has_window", "path"),
    [
        ({"mode": "adaptive"}, "batchpilot", True, SyncPath.PUSH),
        ({"mode": "adaptive"}, "llamacpp", True, SyncPath.PUSH),
        ({"mode": "adaptive"}, "sglang", True, SyncPath.SGLANG),
        ({"mode": "static"}, "sglang", True, SyncPath.SGLANG),
        ({"mode": "static"}, "batchpilot", False, SyncPath.NONE),
        ({"mode": "recommend"}, "batchpilot", False, SyncPath.READ),
        ({"mode": "recommend"}, "llamacpp", True, SyncPath.READ),
        ({"mode": "recommend"}, "vllm", True, SyncPath.NONE),
        ({"mode": "restart"}, "vllm", True, SyncPath.RESTART),
        ({"mode": "restart"}, "vllm", False, SyncPath.NONE),
    ],
)
def test_each_mode_and_engine_has_its_sync_path(
    tuning: dict[str, Any], engine: str, has_window: bool, path: SyncPath
) -> None:
    restart = (
        {"workload": {"kind": "Deployment", "name": "chat", "container": "engine"}}
        if tuning["mode"] == "restart"
        else None
    )
    spec = make_spec(tuning=tuning, engine=engine, restart=restart)
    assert sync_path(spec, make_window() if has_window else None) == path


def test_no_spec_has_no_sync_path() -> None:
    assert sync_path(None, make_window()) == SyncPath.NONE


def test_the_canary_pods_are_pushed_the_canary_window_and_the_others_the_window_in_force() -> None:
    record = make_record(make_spec(tuning=CANARY))
    pods = [PodRecord("ml", key.split("/")[1], ready=True) for key in PODS]
    assert record.loop.window is not None
    assert push_groups(record, pods, record.loop.window) == [(pods, record.loop.window)]
    tried = make_window(cap=8, target=4, generation=2)
    record.canary.run = CanaryRun(window=tried, previous=record.loop.window, pods=PODS[:2], started_s=NOW_S)
    assert push_groups(record, pods, record.loop.window) == [(pods[2:], record.loop.window), (pods[:2], tried)]
    record.spec = make_spec()  # the spec no longer wants a canary: every pod gets the window in force
    assert push_groups(record, pods, record.loop.window) == [(pods, record.loop.window)]


# ---- generations only increase ----------------------------------------------------------------------

STEPS = st.one_of(
    st.tuples(st.just("decide"), st.sampled_from([0.05, 0.3, 0.45, 0.8, 2.0, 5.0])),
    st.tuples(st.just("conflict"), st.integers(min_value=0, max_value=40)),
    st.tuples(st.just("restart"), st.integers(min_value=1, max_value=64)),
    st.tuples(st.just("relane"), st.just(0)),
    st.tuples(st.just("respec"), st.sampled_from([4, 8, 16])),
    st.tuples(st.just("canary_rollback"), st.integers(min_value=0, max_value=40)),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(STEPS, max_size=25), st.integers(min_value=0, max_value=30))
def test_the_generation_in_force_strictly_increases_with_every_new_window(
    steps: list[tuple[str, float]], written_generation: int
) -> None:
    """Whatever happens (the policy's decisions, conflicts, restarts, new lanes, a new spec.window, canaries
    rolled back), a window put in force is numbered past the one before it, and a window kept keeps its
    generation."""
    written = status_with(make_window(generation=written_generation)) if written_generation else {}
    record = make_record(make_spec(), written=written)
    assert record.loop.window is not None and record.loop.window.generation == written_generation + 1
    now_s = NOW_S
    for kind, value in steps:
        before = record.loop.window
        assert before is not None
        now_s += 15.0
        if kind == "decide":
            planned = plan(record, make_observations(p99_s=value), now_s, ready_pods=PODS)
            record.loop.window, record.memory.policy_state = planned.window, planned.decision.state
        elif kind == "conflict":
            record.loop.window = past_conflict(before, int(value)) or before
        elif kind == "restart":
            running = make_window(target=min(8, int(value)), cap=int(value), generation=1)
            record.loop.window = followed(before, running)
        elif kind == "relane":
            record.loop.window = relaned(before)
        elif kind == "respec":  # a new spec.window, with the status the tick wrote for the window in force
            old_spec, cap = record.spec, int(value)
            record.spec = make_spec(window={"targetBatchSize": cap // 2, "hardCap": cap, "maxWaitMs": 40})
            record.loop.window = window_for_spec(record.spec, old_spec, before, status_with(before))
        else:  # a canary numbered past the window in force (or past a newer one) rolled back
            past = before.generation + int(value)
            planned = plan(record, make_observations(), now_s, CanaryEvaluation("back", ended=before, past=past))
            record.loop.window = planned.window
        after = record.loop.window
        assert after.generation >= before.generation
        assert after == before or after.generation > before.generation
