"""tuning.mode restart through the controller when the workload cannot be restarted: each reason is the Synced
condition's, with one Warning Event per new message, and nothing is written."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from batchpilot_operator.control.controller import Controller, PodRecord, Settings
from batchpilot_operator.io.kube import KubeError
from batchpilot_operator.io.push import AdminClient
from tests.support.controller_harness import MemorySink
from tests.support.factories import make_spec_dict

SPEC = make_spec_dict(
    engine="vllm",
    window={"targetBatchSize": 8, "hardCap": 64, "maxWaitMs": 0},
    tuning={"mode": "restart"},
    restart={"workload": {"kind": "StatefulSet", "name": "chat", "container": "vllm"}},
)


@dataclasses.dataclass
class Workloads:
    container: dict[str, Any] | None = None
    error: Exception | None = None
    applied: list[list[str]] = dataclasses.field(default_factory=list)

    async def read_workload(self, namespace: str, kind: str, name: str) -> dict[str, Any]:
        assert (namespace, kind, name) == ("ml", "StatefulSet", "chat")
        if self.error is not None:
            raise self.error
        containers = [self.container] if self.container is not None else []
        return {"spec": {"template": {"spec": {"containers": containers}}}}

    async def apply_container_args(
        self, namespace: str, kind: str, name: str, container: str, args: list[str]
    ) -> dict[str, Any]:
        self.applied.append(args)
        return {}


async def run(workloads: Workloads | None, ticks: int = 2) -> tuple[dict[str, Any], MemorySink, dict[str, Any]]:
    sink, admin, now = MemorySink(), AdminClient(), [1_796_083_200.0]
    controller = Controller(
        Settings(interval_override_s=60), None, admin, sink,
        wall_clock=lambda: now[0], monotonic=lambda: now[0], workloads=workloads,
    )  # fmt: skip
    controller.upsert_profile("ml", "chat", SPEC, generation=1)
    controller.upsert_pod(PodRecord("ml", "chat-0", {"app": "chat"}, ready=True, uid="u0"))
    for _ in range(ticks):
        now[0] += 60
        await controller.tick()
        await controller.drain_events()
    await admin.aclose()
    status = sink.status["ml/chat"]
    synced = next(c for c in status["conditions"] if c["type"] == "Synced")
    return status, sink, synced


@pytest.mark.parametrize(
    ("workloads", "reason", "text"),
    [
        (Workloads(error=KubeError(403, "statefulsets.apps is forbidden")), "WorkloadUnreadable", "forbidden"),
        (Workloads(container={"name": "other"}), "ContainerNotFound", "StatefulSet/chat has no container 'vllm'"),
        (Workloads(container={"name": "vllm", "args": ["--max-num-seqs", "x"]}), "BadArgs", "is not an integer"),
        (
            Workloads(container={"name": "vllm", "command": ["vllm", "serve", "--max-num-seqs=8"]}),
            "FlagsInCommand",
            "move the engine's flags to args",
        ),
    ],
)
async def test_a_workload_that_cannot_be_restarted_is_named_once(workloads: Workloads, reason: str, text: str) -> None:
    status, sink, synced = await run(workloads)
    assert (synced["status"], synced["reason"]) == ("False", reason)
    assert text in synced["message"]
    assert [e for e in sink.events if e[2] == reason] == [("ml/chat", "Warning", reason, synced["message"])]
    assert workloads.applied == []
    assert status["restart"]["workload"] == "StatefulSet/chat"
    assert status["pods"]["synced"] == 0


async def test_without_a_cluster_restart_mode_says_so() -> None:
    _, _, synced = await run(None, ticks=1)
    assert (synced["status"], synced["reason"]) == ("False", "NoCluster")


async def test_a_workload_that_runs_the_window_is_synced_and_the_window_follows_its_args() -> None:
    workloads = Workloads(container={"name": "vllm", "args": ["--max-num-seqs=48", "--max-num-batched-tokens", "512"]})
    status, _, synced = await run(workloads)
    assert (synced["status"], synced["reason"]) == ("True", "WorkloadRuns")
    assert (status["window"]["hardCap"], status["window"]["maxPrefillTokens"]) == (48, 512)
    assert status["pods"]["summary"] == "1/1"
