"""The controller's records (control/records.py): what a profile keeps of its pods, and the window read
back from the status an earlier operator wrote."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest

from batchpilot_operator.control.conditions import PodFailure
from batchpilot_operator.control.controller import Controller, Settings
from batchpilot_operator.control.records import PodSync, StatusWindow, read_status_window, window_from_status
from batchpilot_operator.frontends.local import LocalSink
from batchpilot_operator.io.push import AdminClient
from batchpilot_runtime.contract.admin_api import WindowState
from tests.support.factories import make_spec_dict, make_window, make_window_dict


def pod_sync_knowing(*pods: str) -> PodSync:
    """A profile's sync that knows everything a pod can leave on it, for each of ``pods``."""
    sync = PodSync()
    for pod in pods:
        sync.pod_states[pod] = WindowState.model_construct(model="chat", window=make_window(generation=2))
        sync.pod_errors[pod] = PodFailure("refused", "cap over the pod's KV")
        sync.refused[pod] = 2
        sync.clamped[pod] = "cap clamped to 12"
        sync.verified_s[pod] = 100.0
        sync.applied[pod] = 2
    return sync


def per_pod(sync: PodSync) -> list[set[str]]:
    keyed = (sync.pod_states, sync.pod_errors, sync.refused, sync.clamped, sync.verified_s, sync.applied)
    return [set(known) for known in keyed]


def test_forgetting_a_pod_drops_all_that_is_known_of_it_and_nothing_of_the_others() -> None:
    sync = pod_sync_knowing("ml/chat-0", "ml/chat-1")
    sync.forget("ml/chat-0")
    assert per_pod(sync) == [{"ml/chat-1"}] * 6
    sync.forget("ml/chat-9")  # a pod it never knew: nothing to drop
    assert per_pod(sync) == [{"ml/chat-1"}] * 6


def test_a_status_window_is_read_back_with_its_generation() -> None:
    written = {"window": {**make_window_dict(generation=7), "appliedAt": "2026-01-01T00:00:00Z"}}
    assert read_status_window(written) == StatusWindow(make_window(generation=7))
    assert window_from_status(written) == make_window(generation=7)


@pytest.mark.parametrize("status", [None, {}, {"window": None}], ids=["no-status", "no-window", "null-window"])
def test_no_status_window_is_no_problem(status: dict[str, Any] | None) -> None:
    assert read_status_window(status) == StatusWindow(None)


@pytest.mark.parametrize(
    ("window", "problem"),
    [
        (make_window_dict(cap=0), "status.window.hardCap: Input should be greater than or equal to 1"),
        ({**make_window_dict(), "targetBatchSize": "many"}, "status.window.targetBatchSize: Input should be a valid"),
        ({"hardCap": 16}, "status.window.targetBatchSize: Field required"),
        ("8/16/40", "status.window is a str, not an object"),
    ],
    ids=["out-of-range", "not-a-number", "missing-field", "not-an-object"],
)
def test_a_malformed_status_window_is_dropped_with_what_was_wrong(window: Any, problem: str) -> None:
    read = read_status_window({"window": window})
    assert read.window is None and read.problem is not None and read.problem.startswith(problem)
    assert window_from_status({"window": window}) is None


async def test_a_profile_adopted_with_a_malformed_status_window_says_so_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    admin = AdminClient(timeout_s=1.0)
    controller = Controller(Settings(), None, admin, LocalSink(io.StringIO()))
    status = {"window": make_window_dict(cap=0, generation=4)}
    with caplog.at_level(logging.WARNING, "batchpilot.operator"):
        record = controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1, status=status)
    await admin.aclose()
    assert "profile ml/chat: window in status not used: status.window.hardCap: Input should be" in caplog.text
    assert record.loop.window is not None and record.loop.window.generation == 1  # numbered past none
