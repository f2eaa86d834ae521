"""The controller's records (control/records.py): what a profile keeps of its pods, and the window read
back from the status an earlier operator wrote."""

from __future__ import annotations

from batchpilot_operator.control.conditions import PodFailure
from batchpilot_operator.control.records import PodSync
from batchpilot_runtime.contract.admin_api import WindowState
from tests.support.factories import make_window


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
