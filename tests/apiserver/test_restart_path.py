"""The restart path (tuning.mode restart) on the test control plane (a real kube-apiserver): the operator's
KubeClient reads the vLLM Deployment and server-side applies its container's args under the field manager
batchpilot; the server keeps the field ownership, refuses or takes over what it would for a GitOps sync, and
moves the Deployment's ``generation``.

The policy is replaced by a script of recommendations (its own tests cover how it recommends), and the clock is
simulated, so that two days of 10-minute intervals run in seconds: what is under test is what the restart path
writes, when, and what it reports. There is no controller manager: the test reports a rollout done through the
Deployment's status subresource, as the Deployment controller would. Status and Events stay in memory
(tests/e2e covers the operator's own writes).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
import pytest

from batchpilot_operator.control import restart as restart_mod
from batchpilot_operator.control.controller import Controller, PodRecord, Settings
from batchpilot_operator.io.kube import FIELD_MANAGER, KubeClient, load_kube_config
from batchpilot_operator.io.push import AdminClient
from batchpilot_operator.tuning import policy as policy_mod
from tests.support.control_plane import ControlPlane
from tests.support.controller_harness import MemorySink
from tests.support.factories import make_spec_dict

pytestmark = [pytest.mark.timeout(120)]

START = 1_796_083_200.0  # 2026-12-01T00:00:00Z
INTERVAL_S = 600.0
ARGS = ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "128", "--max-num-batched-tokens=4096",
        "--port", "8000", "--enable-prefix-caching"]  # fmt: skip
CAP = "--max-num-seqs"


def deployments_path(namespace: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments"


def deployment(namespace: str) -> dict[str, Any]:
    """The workload as its Git repository holds it."""
    labels = {"app": "chat"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "args": list(ARGS),
                         "ports": [{"name": "http", "containerPort": 8000}],
                         "env": [{"name": "HF_HOME", "value": "/cache"}]},
                        {"name": "gate", "image": "batchpilot-gate:latest", "args": ["--max-num-seqs", "7"]},
                    ]
                },
            },
        },
    }  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Env:
    namespace: str
    api: httpx.AsyncClient  # the API server, as the admin (a GitOps tool's writes)
    server: httpx.Client  # the same, for the test's own reads
    controller: Controller
    sink: MemorySink
    clock: Clock
    script: list[int]  # the recommended cap per interval, the last one repeated

    async def tick(self, *, rolled_out: bool = True) -> None:
        """One interval; by default the Deployment has rolled out its template by then (there is no controller
        manager: its status is set here as the Deployment controller would)."""
        if rolled_out:
            self.roll_out()
        self.clock.now += INTERVAL_S
        await self.controller.tick()
        await self.controller.drain_events()

    def roll_out(self) -> None:
        generation = self.workload()["metadata"]["generation"]
        status = {
            "observedGeneration": generation,
            "replicas": 2,
            "updatedReplicas": 2,
            "readyReplicas": 2,
            "availableReplicas": 2,
        }
        response = self.server.patch(
            f"{deployments_path(self.namespace)}/chat/status",
            content=json.dumps({"status": status}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert response.status_code == 200, response.text

    def workload(self) -> dict[str, Any]:
        response = self.server.get(f"{deployments_path(self.namespace)}/chat")
        response.raise_for_status()
        return dict(response.json())

    def args(self, container: str = "vllm") -> list[str]:
        containers = self.workload()["spec"]["template"]["spec"]["containers"]
        return list(next(c for c in containers if c["name"] == container)["args"])

    @property
    def status(self) -> dict[str, Any]:
        return self.sink.status[f"{self.namespace}/chat"]

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.status["conditions"] if c["type"] == type_)


def scripted_policy(script: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """policy.decide recommends the next cap of ``script`` (the last one once it runs out)."""

    def decide(spec: Any, window: Any, obs: Any, state: Any, now_s: float, *_: Any) -> policy_mod.Decision:
        cap = script.pop(0) if len(script) > 1 else script[0]
        if cap == window.hard_cap:
            return policy_mod.Decision(window, "hold", "scripted hold", state)
        wanted = window.model_copy(update={"hard_cap": cap, "target_batch_size": min(window.target_batch_size, cap)})
        return policy_mod.Decision(wanted, "up" if cap > window.hard_cap else "down", f"scripted {cap}", state)

    monkeypatch.setattr(policy_mod, "decide", decide)


def profile_spec(**restart: Any) -> dict[str, Any]:
    budget = {"workload": {"kind": "Deployment", "name": "chat", "container": "vllm"}, **restart}
    return make_spec_dict(
        engine="vllm",
        window={"targetBatchSize": 32, "hardCap": 128, "maxWaitMs": 0, "maxPrefillTokens": 4096},
        tuning={"mode": "restart", "bounds": {"hardCap": {"min": 16, "max": 512}}},
        restart=budget,
    )


@pytest.fixture
async def env(control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Callable[..., Any]]:
    clients: list[tuple[KubeClient, AdminClient, httpx.AsyncClient, httpx.Client]] = []

    async def make(script: list[int], **restart: Any) -> Env:
        namespace = control_plane.namespace("restart-path")
        api, server = control_plane.async_client(), control_plane.client()
        created = await api.post(
            f"{deployments_path(namespace)}?fieldManager=argocd-controller", json=deployment(namespace)
        )
        assert created.status_code in (200, 201), created.text
        client, admin, clock, sink = (
            KubeClient(load_kube_config(control_plane.kubeconfig)),
            AdminClient(),
            Clock(),
            MemorySink(),
        )
        clients.append((client, admin, api, server))
        scripted_policy(script, monkeypatch)
        controller = Controller(
            Settings(interval_override_s=INTERVAL_S), None, admin, sink,
            wall_clock=clock, monotonic=clock, workloads=client,
        )  # fmt: skip
        controller.upsert_profile(namespace, "chat", profile_spec(**restart), generation=1)
        for index in range(2):  # the Deployment's pods (no rollout happens: they stay as they are)
            controller.upsert_pod(PodRecord(namespace, f"chat-{index}", {"app": "chat"}, ready=True, uid=f"u{index}"))
        return Env(namespace, api, server, controller, sink, clock, script)

    yield make
    for client, admin, api, server in clients:
        await client.aclose()
        await admin.aclose()
        await api.aclose()
        server.close()


def fields_of(workload: Mapping[str, Any], manager: str) -> dict[str, Any]:
    entry = next(m for m in workload["metadata"]["managedFields"] if m["manager"] == manager)
    return dict(entry["fieldsV1"])


def container_fields(fields: Mapping[str, Any], name: str) -> dict[str, Any]:
    return dict(fields["f:spec"]["f:template"]["f:spec"]["f:containers"][f'k:{{"name":"{name}"}}'])


async def test_a_retune_held_three_intervals_patches_only_the_args_under_batchpilot(env: Any) -> None:
    e: Env = await env([192])
    before = e.workload()
    await e.tick()
    await e.tick()
    assert e.args() == ARGS  # held 2 of 3 intervals
    assert "held 2 of 3 intervals" in e.condition("Synced")["message"]
    await e.tick()
    assert e.args() == ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "192",
                        "--max-num-batched-tokens=4096", "--port", "8000", "--enable-prefix-caching"]  # fmt: skip
    after = e.workload()
    assert e.args("gate") == ["--max-num-seqs", "7"]  # another container's flags are not the engine's
    unchanged = copy.deepcopy(after)
    unchanged["spec"]["template"]["spec"]["containers"][0]["args"] = ARGS
    assert unchanged["spec"] == before["spec"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1  # the template changed: it rolls
    # batchpilot owns the engine container's args and nothing else; the creator no longer owns them.
    assert container_fields(fields_of(after, FIELD_MANAGER), "vllm") == {".": {}, "f:name": {}, "f:args": {}}
    assert "f:args" not in container_fields(fields_of(after, "argocd-controller"), "vllm")
    assert "f:image" in container_fields(fields_of(after, "argocd-controller"), "vllm")

    restart = e.status["restart"]
    assert restart["workload"] == "Deployment/chat"
    assert restart["appliedArgs"] == {CAP: 192, "--max-num-batched-tokens": 4096}
    assert (restart["lastAt"], restart["count24h"]) == ("2026-12-01T00:30:00Z", 1)
    assert restart["nextAllowedAt"] == "2026-12-01T01:30:00Z"  # minIntervalSeconds 3600
    assert [m for m in e.sink.messages("Restarted")] == [
        "Deployment/chat restarted with --max-num-seqs 192 --max-num-batched-tokens 4096: "
        "--max-num-seqs 128 -> 192 (held 3 intervals)"
    ]
    assert e.condition("Synced")["reason"] == "Restarted"
    await e.tick()
    assert e.status["window"]["hardCap"] == 192  # the window in force is what the workload now runs
    assert e.condition("Synced")["reason"] == "WorkloadRuns"


async def test_a_flapping_recommendation_restarts_no_more_than_the_budget(env: Any) -> None:
    # Every interval flips between 64 and 256, and one interval is enough: only the budget holds it back.
    e: Env = await env([64, 256] * 150, stableIntervals=1, maxPerDay=3, minIntervalSeconds=7200)
    restarts: list[float] = []
    for _ in range(2 * 144):  # two days of 10-minute intervals
        before = e.args()
        await e.tick()
        if e.args() != before:
            restarts.append(e.clock.now)
    assert len(e.sink.messages("Restarted")) == len(restarts)
    for index, moment in enumerate(restarts):
        assert sum(1 for t in restarts if moment - 86_400 < t <= moment) <= 3
        assert index == 0 or moment - restarts[index - 1] >= 7200
    assert len(restarts) == 6  # the budget, used in full: 3 a day


async def test_allowed_hours_defer_a_restart_to_the_window(env: Any) -> None:
    e: Env = await env([256], stableIntervals=1, allowedHours={"start": "02:00", "end": "04:00"})
    await e.tick()
    assert e.args() == ARGS
    assert e.status["restart"]["nextAllowedAt"] == "2026-12-01T02:00:00Z"
    while e.clock.now < START + 2 * 3600 - INTERVAL_S:
        await e.tick()
        assert e.args() == ARGS
    await e.tick()
    assert e.status["restart"]["lastAt"] == "2026-12-01T02:00:00Z"


async def sync_with_put(e: Env) -> None:
    """A GitOps sync without server-side apply: the manifest from Git replaces the object."""
    manifest = deployment(e.namespace)
    response = await e.api.put(f"{deployments_path(e.namespace)}/chat?fieldManager=argocd-controller", json=manifest)
    assert response.status_code == 200, response.text


async def sync_with_forced_apply(e: Env) -> None:
    """Argo CD with ServerSideApply=true (or Flux): the manifest applied with force under its own manager."""
    response = await e.api.patch(
        f"{deployments_path(e.namespace)}/chat?fieldManager=argocd-controller&force=true",
        json=deployment(e.namespace),
        headers={"Content-Type": "application/apply-patch+yaml"},
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("sync", [sync_with_put, sync_with_forced_apply], ids=["replace", "server-side-apply"])
async def test_a_gitops_sync_that_undoes_a_retune_is_reported_and_not_fought(env: Any, sync: Any) -> None:
    e: Env = await env([192], stableIntervals=1, maxPerDay=2, minIntervalSeconds=7200)
    await e.tick()
    assert CAP in e.args() and e.args()[e.args().index(CAP) + 1] == "192"
    await sync(e)
    assert e.args() == ARGS
    await e.tick()
    synced = e.condition("Synced")
    assert (synced["status"], synced["reason"]) == ("False", "RetuneReverted")
    assert (
        "runs --max-num-seqs 128 --max-num-batched-tokens 4096, not the applied --max-num-seqs 192"
        in (synced["message"])
    )
    assert "field manager batchpilot" in synced["message"]
    assert e.status["restart"]["revertedAt"] == "2026-12-01T00:20:00Z"
    assert len(e.sink.messages("RetuneReverted")) == 1
    # The recommendation still stands; the operator re-applies only when the budget allows (2 h after the first),
    # and every sync that undoes it is reported, never more than maxPerDay re-applies in a day.
    applied_at = []
    for _ in range(36):  # six hours
        before = e.args()
        await e.tick()
        if e.args() != before and e.args() != ARGS:
            applied_at.append(e.clock.now)
            await sync(e)
    assert applied_at == [START + 7200 + INTERVAL_S]  # the budget's second restart; the third waits a day
    assert len(e.sink.messages("RetuneReverted")) == 2
    assert e.status["restart"]["count24h"] == 2


async def test_batchpilot_owns_no_field_git_sets_unless_it_changes_them(env: Any) -> None:
    """An Argo CD ignoreDifferences on managedFieldsManagers [batchpilot] hides exactly the engine's args."""
    e: Env = await env([192], stableIntervals=1)
    await e.tick()
    owned = fields_of(e.workload(), FIELD_MANAGER)
    assert owned == {"f:spec": {"f:template": {"f:spec": {"f:containers": {'k:{"name":"vllm"}': {
        ".": {}, "f:name": {}, "f:args": {}}}}}}}  # fmt: skip


async def test_a_new_operator_keeps_the_budget_from_status(env: Any) -> None:
    e: Env = await env([192, 256], stableIntervals=1, maxPerDay=2, minIntervalSeconds=7200)
    await e.tick()
    assert e.status["restart"]["count24h"] == 1
    # A new operator (kopf hands it the status as written) with the same workloads client.
    successor = Controller(
        Settings(interval_override_s=INTERVAL_S), None, e.controller.admin, e.sink,
        wall_clock=e.clock, monotonic=e.clock, workloads=e.controller.restart.workloads,
    )  # fmt: skip
    successor.upsert_profile(e.namespace, "chat", profile_spec(stableIntervals=1, maxPerDay=2, minIntervalSeconds=7200),
                             generation=1, status=copy.deepcopy(e.status))  # fmt: skip
    for index in range(2):
        successor.upsert_pod(PodRecord(e.namespace, f"chat-{index}", {"app": "chat"}, ready=True, uid=f"u{index}"))
    e.controller = successor
    await e.tick()
    assert e.args()[e.args().index(CAP) + 1] == "192"  # 256 is recommended, but the last restart was 10 min ago
    assert e.status["restart"]["nextAllowedAt"] == "2026-12-01T02:10:00Z"
    assert e.status["restart"]["history"] == ["2026-12-01T00:10:00Z"]
    while e.clock.now < START + 7200 + INTERVAL_S:
        await e.tick()
    assert e.args()[e.args().index(CAP) + 1] == "256"
    assert e.status["restart"]["count24h"] == 2


def scripted_slo(script: list[bool | None], monkeypatch: pytest.MonkeyPatch) -> None:
    """The SLO over (True), met (False) or unknown (None) per interval, the last one repeated."""

    def slo_over(spec: Any, obs: Any) -> bool | None:
        return script.pop(0) if len(script) > 1 else script[0]

    monkeypatch.setattr(restart_mod, "slo_over", slo_over)


async def test_no_restart_and_no_judgement_while_the_last_one_rolls_out(env: Any) -> None:
    e: Env = await env([192, 256], stableIntervals=1, maxPerDay=4, minIntervalSeconds=600)
    await e.tick()
    assert e.status["restart"]["count24h"] == 1
    for _ in range(3):  # 256 is worth a restart and the budget allows one, but the rollout is not done
        await e.tick(rolled_out=False)
        assert e.condition("Synced")["reason"] == "RollingOut"
    assert e.status["restart"]["previousArgs"] == {CAP: 128, "--max-num-batched-tokens": 4096}
    await e.tick()
    assert e.args()[e.args().index(CAP) + 1] == "256"


async def test_a_restart_that_breaks_the_slo_it_met_is_rolled_back(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    e: Env = await env([192], stableIntervals=2, maxPerDay=6, minIntervalSeconds=3600)
    scripted_slo([False, False, True], monkeypatch)  # met at the restart, broken once it has rolled out
    await e.tick()
    await e.tick()
    assert e.args()[e.args().index(CAP) + 1] == "192"
    await e.tick()  # the first interval after the rollout: the SLO broke
    assert e.args() == ARGS  # the args before the restart, 10 minutes later (minIntervalSeconds does not hold it)
    (message,) = e.sink.messages("RestartRolledBack")
    assert "the SLO broke after the restart with --max-num-seqs 192 --max-num-batched-tokens 4096" in message
    assert "rolled back to --max-num-seqs 128 --max-num-batched-tokens 4096" in message
    assert e.condition("Synced")["reason"] == "RolledBack"
    assert e.status["restart"]["count24h"] == 2
    assert "previousArgs" not in e.status["restart"]
    # The same change is not tried again for a day, although the budget would allow it and it is still recommended.
    for _ in range(30):
        await e.tick()
        assert e.args() == ARGS
    assert "not tried again yet" in e.condition("Synced")["message"]


async def test_a_restart_made_while_the_slo_was_broken_is_kept(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    e: Env = await env([192], stableIntervals=3)
    scripted_slo([True], monkeypatch)  # broken before and after: the restart is not what broke it
    await e.tick()  # one interval is enough while the SLO is broken
    assert e.args()[e.args().index(CAP) + 1] == "192"
    for _ in range(4):
        await e.tick()
    assert e.args()[e.args().index(CAP) + 1] == "192"
    assert e.sink.messages("RestartRolledBack") == []
    assert "previousArgs" not in e.status["restart"]  # judged for stableIntervals intervals, then kept
