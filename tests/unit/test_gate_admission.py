"""The gate's admission (pure, clock-injected): the runtime's window rules applied to requests in flight."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot_runtime.contract.admin_api import LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.gate.admission import GateAdmission, GateLimits
from batchpilot_runtime.scheduling.types import QueueFullError, RequestRejected


def make_gate(
    target: int = 1, cap: int = 4, wait_ms: int = 0, lanes: tuple[LaneWindow, ...] = (), **limits: int
) -> GateAdmission:
    settings_ = {"max_queue": 64, "max_hard_cap": 64, "wait_p50_samples": 2, "tail_min_samples": 2, **limits}
    window = Window(target_batch_size=target, hard_cap=cap, max_wait_ms=wait_ms)
    return GateAdmission(window, {lane.name: lane for lane in lanes}, GateLimits(**settings_))


def admitted_ids(gate: GateAdmission, now_s: float) -> list[str]:
    return [a.request_id for a in gate.admit(now_s).admitted]


def test_target_admits_when_enough_have_arrived() -> None:
    gate = make_gate(target=3, cap=4, wait_ms=100)
    for name in ("a", "b"):
        gate.enqueue(name, "default", 0.0)
    assert admitted_ids(gate, 0.0) == []
    gate.enqueue("c", "default", 0.01)
    result = gate.admit(0.01)
    assert [a.request_id for a in result.admitted] == ["a", "b", "c"]
    assert result.admissions == {"target": 1}


def test_wait_admits_the_oldest_at_its_deadline() -> None:
    gate = make_gate(target=3, cap=4, wait_ms=100)
    gate.enqueue("a", "default", 0.0)
    assert admitted_ids(gate, 0.0) == []
    assert gate.next_deadline_s() == pytest.approx(0.1)
    assert admitted_ids(gate, 0.099) == []
    result = gate.admit(0.1)
    assert [a.request_id for a in result.admitted] == ["a"] and result.admissions == {"wait": 1}


def test_the_cap_bounds_requests_in_flight_and_a_release_frees_a_slot() -> None:
    gate = make_gate(target=1, cap=2)
    for index in range(5):
        gate.enqueue(f"r{index}", "default", 0.0)
    result = gate.admit(0.0)
    assert [a.request_id for a in result.admitted] == ["r0", "r1"] and result.admissions == {"cap": 1}
    assert (gate.num_running, gate.num_waiting) == (2, 3)
    assert gate.release("r0")
    assert admitted_ids(gate, 0.1) == ["r2"]
    assert gate.release("r4")  # a waiting request leaves the queue
    assert (gate.num_running, gate.num_waiting) == (2, 1)
    assert not gate.release("r4")


def test_a_lower_cap_evicts_nothing_and_admits_once_below_it() -> None:
    gate = make_gate(target=1, cap=4)
    for index in range(6):
        gate.enqueue(f"r{index}", "default", 0.0)
    assert len(admitted_ids(gate, 0.0)) == 4
    gate.set_window(Window(target_batch_size=1, hard_cap=2, max_wait_ms=0, generation=1))
    for released in ("r0", "r1"):
        gate.release(released)
        assert admitted_ids(gate, 0.1) == []
    gate.release("r2")
    assert admitted_ids(gate, 0.2) == ["r4"]
    assert gate.num_running == 2


def test_a_tail_marked_request_goes_first_across_lanes() -> None:
    batch = LaneWindow(name="batch", window=Window(target_batch_size=1, hard_cap=2, max_wait_ms=0), reserved_slots=0)
    gate = make_gate(target=1, cap=1, lanes=(batch,))
    for name in ("d1", "d2"):  # two waits of 0 s: the default lane's P50 is 0, its threshold 2 x 1 ms
        gate.enqueue(name, "default", 0.0)
        assert admitted_ids(gate, 0.0) == [name]
        gate.release(name)
    gate.enqueue("d3", "default", 0.0)
    assert admitted_ids(gate, 0.0) == ["d3"]  # holds the only slot
    gate.enqueue("b1", "batch", 0.001)
    gate.enqueue("d4", "default", 0.002)
    result = gate.admit(0.010)
    assert result.admitted == [] and result.tail_marked == 1
    gate.release("d3")
    (admitted,) = gate.admit(0.010).admitted
    assert admitted.request_id == "d4" and admitted.tail_marked  # ahead of b1, which arrived first


def test_reserved_slots_are_only_their_lanes() -> None:
    critical = LaneWindow(
        name="critical", window=Window(target_batch_size=1, hard_cap=2, max_wait_ms=0), reserved_slots=1
    )
    gate = make_gate(target=1, cap=3, lanes=(critical,))
    for index in range(4):
        gate.enqueue(f"d{index}", "default", 0.0)
    assert admitted_ids(gate, 0.0) == ["d0", "d1"]
    gate.enqueue("c0", "critical", 0.0)
    assert admitted_ids(gate, 0.0) == ["c0"]
    assert gate.running_in("critical") == 1


def test_a_full_queue_is_refused_with_the_runtimes_retry_after() -> None:
    gate = make_gate(target=1, cap=1, max_queue=2)
    gate.enqueue("r0", "default", 0.0)
    gate.enqueue("r1", "default", 0.0)
    assert admitted_ids(gate, 0.0) == ["r0"]
    gate.enqueue("r2", "default", 0.0)
    with pytest.raises(QueueFullError) as refused:
        gate.enqueue("r3", "default", 0.0)
    assert refused.value.retry_after_s == 1.0  # one admission so far: no rate yet, the 1 s fallback
    for step, running in ((1, "r0"), (2, "r1")):
        gate.release(running)
        gate.admit(step * 0.5)
    gate.enqueue("r4", "default", 1.0)
    gate.enqueue("r5", "default", 1.0)
    with pytest.raises(QueueFullError) as refused:
        gate.enqueue("r6", "default", 1.0)
    assert refused.value.retry_after_s == pytest.approx(0.5)  # a tenth of 2 (at least 1) at 2 admissions/s


def test_bad_lanes_and_windows_are_named() -> None:
    gate = make_gate(max_hard_cap=8)
    with pytest.raises(RequestRejected, match="unknown lane 'nope'") as unknown:
        gate.enqueue("a", "nope", 0.0)
    assert unknown.value.field == "lane"
    gate.enqueue("a", "default", 0.0)
    with pytest.raises(RequestRejected, match="already queued"):
        gate.enqueue("a", "default", 0.0)
    with pytest.raises(ValueError, match="hardCap: 9 exceeds"):
        gate.set_window(Window(target_batch_size=1, hard_cap=9, max_wait_ms=0, generation=1))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["enqueue", "enqueue", "release", "admit", "cap"]), st.integers(0, 7), st.integers(1, 5)
        ),
        max_size=60,
    )
)
def test_no_admission_pass_leaves_more_in_flight_than_the_cap(ops: list[tuple[str, int, int]]) -> None:
    lane = LaneWindow(name="fast", window=Window(target_batch_size=1, hard_cap=2, max_wait_ms=0), reserved_slots=0)
    gate = make_gate(target=2, cap=3, wait_ms=5, lanes=(lane,))
    live: set[str] = set()
    now_s, generation, serial = 0.0, 0, 0
    for op, index, cap in ops:
        now_s += 0.001 * index
        if op == "enqueue":
            serial += 1
            gate.enqueue(f"r{serial}", "fast" if index % 2 else "default", now_s)
            live.add(f"r{serial}")
        elif op == "release" and live:
            victim = sorted(live)[index % len(live)]
            assert gate.release(victim)
            live.discard(victim)
        elif op == "cap":
            generation += 1
            gate.set_window(
                Window(target_batch_size=min(2, cap + 1), hard_cap=cap + 1, max_wait_ms=5, generation=generation)
            )
        result = gate.admit(now_s)
        if result.admitted:
            assert gate.num_running <= gate.window.hard_cap
            assert gate.running_in("fast") <= 2
        assert gate.num_running + gate.num_waiting == len(live)
