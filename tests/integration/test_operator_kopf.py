"""``batchpilot-operator run`` (kopf) against the kmock emulator, with emulated runtime admin endpoints.

Each emulated pod answers on its own loopback address (127.0.0.x) on one shared
admin port, like pods on a cluster network. The operator runs as a subprocess
with a 1 s interval (``--interval-override``; the resource itself allows >= 5 s).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.fake_admin import ROOT_POD, FakeAdminServer, FakePod
from tests.integration.kmock_cluster import (
    PROFILES,
    KubeCluster,
    OperatorProcess,
    free_port_on_all,
    pod_body,
    profile_body,
    running_cluster,
    wait_for,
)
from tests.support.factories import make_spec_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

POD_IPS = ["127.0.0.2", "127.0.0.3"]
TOKEN = "kopf-test-token"


def spec(admin_port: int, **overrides: Any) -> dict[str, Any]:
    return make_spec_dict(**{"runtime": {"adminPort": admin_port, "servePort": admin_port}, **overrides})


def condition(cluster: KubeCluster, name: str, type_: str, namespace: str = "ml") -> dict[str, Any] | None:
    obj = cluster.get(PROFILES, namespace, name) or {}
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[KubeCluster, str, dict[str, FakeAdminServer], int]]:
    port = free_port_on_all(POD_IPS)
    fakes: dict[str, FakeAdminServer] = {}
    for ip in POD_IPS:
        fake = FakeAdminServer(0)
        fake.add_pod(ROOT_POD, model="chat", token=TOKEN, max_hard_cap=64)
        await fake.start(port, host=ip)
        fakes[ip] = fake
    async with running_cluster() as (cluster, url):
        yield cluster, url, fakes, port
    for fake in fakes.values():
        await fake.stop()


async def assert_a_new_profile_reaches_the_ready_pod_only(
    cluster: KubeCluster, api: httpx.AsyncClient, port: int, first: FakePod, second: FakePod
) -> None:
    """A new profile: the Ready pod gets the spec's window; status says so."""
    await create(api, PROFILES_PATH, profile_body("ml", "chat", spec(port)))
    await wait_for(lambda: first.state.window.generation >= 1, 60, "the Ready pod to get the window")
    assert first.state.window.hard_cap == 16 and second.puts == 0
    synced = await wait_for(
        lambda: (c := condition(cluster, "chat", "Synced")) and c["status"] == "True" and c, 30, "Synced=True"
    )
    assert synced["observedGeneration"] == 1
    status = cluster.get(PROFILES, "ml", "chat")["status"]  # type: ignore[index]
    assert status["pods"] == {"total": 2, "ready": 1, "synced": 1, "summary": "1/1"}
    # The push on create can land before the first observation tick (MetricsAvailable
    # is Unknown/Pending until then); the fake Prometheus has no series for the model.
    await wait_for(
        lambda: (c := condition(cluster, "chat", "MetricsAvailable")) and c["status"] == "False" and c,
        30,
        "MetricsAvailable=False",
    )


async def assert_status_conflicts_and_failed_pushes_leave_a_complete_status(
    cluster: KubeCluster, second: FakePod
) -> None:
    """A status patch that conflicts (409) twice: the loop goes on and the status ends complete."""
    cluster.fail_status_patches = 2
    second.fail_next = 100  # and a pod whose pushes fail (5xx)
    second.restart()
    await wait_for(
        lambda: (c := condition(cluster, "chat", "Synced")) and c["reason"] == "PushFailed", 30, "PushFailed"
    )
    assert cluster.fail_status_patches == 0
    status = cluster.get(PROFILES, "ml", "chat")["status"]  # type: ignore[index]
    for key in ("window", "pods", "conditions", "observedGeneration", "lastDecision"):
        assert key in status, key
    await wait_for(lambda: any(e["reason"] == "PushFailed" for e in cluster.events_for("ml", "chat")), 30,
                   "a PushFailed Event")  # fmt: skip
    second.fail_next = 0
    await wait_for(lambda: second.state.window.hard_cap == 12, 30, "the restarted pod to heal")


async def assert_an_invalid_profile_is_named_without_a_crash(
    cluster: KubeCluster, api: httpx.AsyncClient, port: int
) -> None:
    """An invalid profile that slipped past validation: condition and Event naming the field."""
    bad = spec(port, window={"targetBatchSize": 64, "hardCap": 16, "maxWaitMs": 40})
    bad["selector"] = {"matchLabels": {"app": "nothing"}}
    await create(api, PROFILES_PATH, profile_body("ml", "bad", bad))
    ready = await wait_for(lambda: condition(cluster, "bad", "Ready"), 30, "the invalid profile's condition")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec" and "spec.window" in ready["message"]
    await wait_for(lambda: any(e["reason"] == "InvalidSpec" for e in cluster.events_for("ml", "bad")), 30,
                   "an InvalidSpec Event")  # fmt: skip


async def test_operator_reconciles_profiles_pods_and_failures(
    env: tuple[KubeCluster, str, dict[str, FakeAdminServer], int], tmp_path: Path
) -> None:
    """Needs kmock: step 4 has status patches answered with 409 on demand (``fail_status_patches``), and step 5
    stores a profile that slipped past validation, which the real server's CEL rules refuse."""
    cluster, url, fakes, port = env
    first, second = (fakes[ip].pods[ROOT_POD] for ip in POD_IPS)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    api = _client(url)
    await create(api, "/api/v1/namespaces/ml/pods", pod_body("ml", "chat-a", {"app": "chat"}, POD_IPS[0], ready=True))
    await create(api, "/api/v1/namespaces/ml/pods", pod_body("ml", "chat-b", {"app": "chat"}, POD_IPS[1], ready=False))
    operator = OperatorProcess(
        tmp_path, url, "-A", "--admin-token-file", str(token_file), "--admin-token-namespace", "ml",
        "--interval-override", "1", "--tick", "0.3", "--peering", "off", "--watch-check", "1",
    )  # fmt: skip
    try:
        # 1. A new profile.
        await assert_a_new_profile_reaches_the_ready_pod_only(cluster, api, port, first, second)

        # 2. The second pod becomes Ready: it gets the window at once.
        await patch(api, "/api/v1/namespaces/ml/pods/chat-b/status",
                    {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})  # fmt: skip
        await wait_for(lambda: second.state.window.generation >= 1, 30, "the newly Ready pod to get the window")

        # 3. A spec change is a new starting window, pushed with a new generation.
        await patch(api, f"{PROFILES_PATH}/chat",
                    {"spec": {"window": {"targetBatchSize": 4, "hardCap": 12, "maxWaitMs": 20}}})  # fmt: skip
        await wait_for(
            lambda: first.state.window.hard_cap == 12 and second.state.window.hard_cap == 12, 30, "the new window"
        )
        await wait_for(
            lambda: (c := condition(cluster, "chat", "Synced")) and c["observedGeneration"] == 2, 30, "generation 2"
        )

        # 4. Status conflicts and failing pushes.
        await assert_status_conflicts_and_failed_pushes_leave_a_complete_status(cluster, second)

        # 5. An invalid profile.
        await assert_an_invalid_profile_is_named_without_a_crash(cluster, api, port)

        # 6. Liveness and the operator's own metrics.
        assert await operator.liveness() == 200
        text = await operator.metrics_text()
        assert "batchpilot_operator_profiles_managed 2.0" in text
        assert "batchpilot_operator_push_errors_total" in text
        assert operator.process.poll() is None, operator.log_text()[-3000:]
    finally:
        operator.stop()
        await api.aclose()


async def test_tokens_reach_only_pods_of_their_profiles_namespace(
    env: tuple[KubeCluster, str, dict[str, FakeAdminServer], int], tmp_path: Path
) -> None:
    """A look-alike pod (same labels) in another namespace never gets a request; a profile's Secret is read
    in its own namespace; the operator's own token stays in its namespace (here kubeconfig's: default).

    Needs kmock: the "stranger" profile names ``adminTokenSecret.namespace``, a field the CRD does not have; a
    real server prunes it, so the operator's own refusal of it is reached only on an emulator that stores what
    it is sent (tests/e2e/test_cluster.py checks the admin-token label on the real server)."""
    cluster, url, fakes, port = env
    home, away = (fakes[ip].pods[ROOT_POD] for ip in POD_IPS)
    home.token, away.token = "ml-secret-token", None  # the look-alike would take any token: none may arrive
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    api = _client(url)
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": "chat-admin", "namespace": "ml", "labels": {"batchpilot.dev/admin-token": "true"}},
              "data": {"token": base64.b64encode(b"ml-secret-token").decode()}}  # fmt: skip
    await create(api, "/api/v1/namespaces/ml/secrets", secret)
    await create(api, "/api/v1/namespaces/ml/pods", pod_body("ml", "chat-a", {"app": "chat"}, POD_IPS[0], ready=True))
    await create(api, "/api/v1/namespaces/other/pods",
                 pod_body("other", "chat-a", {"app": "chat"}, POD_IPS[1], ready=True))  # fmt: skip
    operator = OperatorProcess(
        tmp_path, url, "-A", "--admin-token-file", str(token_file), "--interval-override", "1", "--tick", "0.3",
        "--peering", "off",
    )  # fmt: skip
    runtime = {"adminPort": port, "servePort": port}
    try:
        with_secret = spec(port, runtime={**runtime, "adminTokenSecret": {"name": "chat-admin"}})
        await create(api, PROFILES_PATH, profile_body("ml", "chat", with_secret))
        await create(api, "/apis/batchpilot.dev/v1alpha1/namespaces/other/batchprofiles",
                     profile_body("other", "chat", spec(port)))  # fmt: skip
        stranger = {"name": "batchpilot-admin-token", "namespace": "default"}
        await create(api, PROFILES_PATH, profile_body("ml", "stranger", spec(
            port, selector={"matchLabels": {"app": "nothing"}}, runtime={**runtime, "adminTokenSecret": stranger})))  # fmt: skip
        await wait_for(lambda: home.state.window.generation >= 1, 60, "the pod in ml to get the window")
        withheld = await wait_for(
            lambda: (c := condition(cluster, "chat", "Synced", "other")) and c["status"] == "False" and c,
            30,
            "Synced=False for the profile outside the operator's token namespaces",
        )
        assert "the operator's admin token goes only to pods in namespaces default, not 'other'" in withheld["message"]
        refused = await wait_for(lambda: condition(cluster, "stranger", "Ready"), 30, "the stranger's condition")
        assert refused["reason"] == "InvalidSpec" and "adminTokenSecret.namespace: " in refused["message"]
        assert home.authorizations and set(home.authorizations) == {"Bearer ml-secret-token"}
        assert away.authorizations == []
        assert operator.process.poll() is None, operator.log_text()[-3000:]
    finally:
        operator.stop()
        await api.aclose()


PROFILES_PATH = "/apis/batchpilot.dev/v1alpha1/namespaces/ml/batchprofiles"


def _client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=10)


async def create(api: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await api.post(path, json=body)
    assert response.status_code in (200, 201), response.text
    return dict(response.json())


async def patch(api: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await api.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"})
    assert response.status_code == 200, response.text
    return dict(response.json())
