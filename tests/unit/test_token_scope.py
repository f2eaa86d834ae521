"""Tokens only where they belong: which pod may receive which bearer token, and which Secret may be read.

- A profile names only a Secret of its own namespace: a ``namespace`` is refused at parse (the CRD has no
  such field: the API server refuses or prunes it), and a name that is a path is refused by the pattern.
- A profile's Secret is read in the profile's namespace and sent only to pods of that namespace that match
  its selector; a look-alike pod in another namespace, or one outside the selector, gets no request at all.
- The operator's own token goes only to pods of the namespaces it was given for; elsewhere no request is
  sent, and the profile's status says what to do.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from batchpilot_operator.api.crd import custom_resource_definition
from batchpilot_operator.api.profile import ProfileError, parse_spec
from batchpilot_operator.control.controller import Controller, PodRecord, ProfileRef, Settings
from batchpilot_operator.control.status import apply_merge_patch
from batchpilot_operator.io.kube import KubeClient, KubeConfig, KubeError
from batchpilot_operator.io.push import AdminClient
from batchpilot_operator.io.token_secrets import ADMIN_TOKEN_LABEL, SecretNotOptedIn
from tests.integration.fake_admin import FakeAdminServer
from tests.integration.kmock_cluster import running_cluster
from tests.support.crd_validation import validate_object
from tests.support.factories import make_manifest, make_spec_dict

FLEET_TOKEN = "fleet-token"
SECRETS = {("team-a", "chat-admin", "token"): "team-a-token", ("team-b", "chat-admin", "token"): "team-b-token"}


def make_spec(secret: Mapping[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """The shared spec, reading its admin token from ``secret`` when one is given."""
    runtime = {"runtime": {"adminTokenSecret": dict(secret)}} if secret is not None else {}
    return make_spec_dict(**{**runtime, **overrides})


class SecretSink:
    """Status and Events in memory; Secrets from SECRETS, every read recorded."""

    def __init__(self) -> None:
        self.status: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str, str]] = []
        self.secret_reads: list[tuple[str, str, str]] = []
        self.forbidden = False  # every read fails as one the RBAC does not allow
        self.not_opted_in = False  # every Secret lacks the admin-token label

    async def patch_status(self, ref: ProfileRef, patch: Mapping[str, Any]) -> None:
        self.status[ref.key] = apply_merge_patch(self.status.get(ref.key), patch)

    async def event(self, ref: ProfileRef, type_: str, reason: str, message: str) -> None:
        self.events.append((ref.key, reason, message))

    async def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        self.secret_reads.append((namespace, name, key))
        if self.forbidden:
            raise RuntimeError(f'HTTP 403: secrets "{name}" is forbidden')
        if self.not_opted_in:
            raise SecretNotOptedIn(namespace, name)
        return SECRETS.get((namespace, name, key))

    def condition(self, key: str, type_: str) -> dict[str, Any]:
        return next(c for c in self.status[key]["conditions"] if c["type"] == type_)


class Cluster:
    """A controller, its sink, and emulated pods (each pod a path of one fake admin server, every token accepted
    by pods that have none set: what matters here is which token arrives where)."""

    def __init__(self, fake: FakeAdminServer, controller: Controller, sink: SecretSink) -> None:
        self.fake, self.controller, self.sink = fake, controller, sink

    def add_pod(self, namespace: str, name: str, labels: Mapping[str, str] | None = None) -> str:
        pod_id = f"{namespace}.{name}"
        self.fake.add_pod(pod_id, model="chat", token=None, max_hard_cap=64)
        self.controller.upsert_pod(
            PodRecord(namespace, name, dict(labels or {"app": "chat"}), ip="127.0.0.1", ready=True,
                      admin_url=self.fake.admin_url(pod_id), uid=pod_id)
        )  # fmt: skip
        return pod_id

    def authorizations(self, pod_id: str) -> list[str | None]:
        return self.fake.pods[pod_id].authorizations

    async def tick(self) -> None:
        await self.controller.tick()
        await self.controller.drain_events()


def make_cluster(fake: FakeAdminServer, admin: AdminClient, **settings: Any) -> Cluster:
    sink = SecretSink()
    clock = iter(range(1000, 10**6))
    now = {"s": 1000.0}

    def tick_clock() -> float:
        now["s"] = float(next(clock))
        return now["s"]

    controller = Controller(
        Settings(interval_override_s=1.0, **settings),
        None,
        admin,
        sink,
        wall_clock=lambda: now["s"],
        monotonic=tick_clock,
    )
    return Cluster(fake, controller, sink)


@pytest.fixture
async def parts() -> AsyncIterator[tuple[FakeAdminServer, AdminClient]]:
    async def no_sleep(_: float) -> None:
        await asyncio.sleep(0)

    async with FakeAdminServer(0) as fake:
        admin = AdminClient(timeout_s=0.5, retries=1, sleep=no_sleep)
        yield fake, admin
        await admin.aclose()


@pytest.fixture
async def cluster(parts: tuple[FakeAdminServer, AdminClient]) -> Cluster:
    fake, admin = parts
    return make_cluster(
        fake, admin, default_token=FLEET_TOKEN, default_token_namespaces=frozenset({"batchpilot", "team-a"})
    )


# ---- the Secret reference ------------------------------------------------------------------------------------


def test_a_secret_of_another_namespace_is_refused_at_parse_naming_the_field() -> None:
    with pytest.raises(ProfileError) as caught:
        parse_spec(make_spec({"name": "chat-admin", "namespace": "team-b"}))
    message = str(caught.value)
    assert message.startswith("spec.runtime.adminTokenSecret.namespace: 'team-b' is not allowed")
    assert "only a Secret of its own namespace" in message


@pytest.mark.parametrize("name", ["../team-b/secrets/x", "team-b/chat-admin", "..", "Chat-Admin", "a..b", ".x"])
def test_a_secret_name_that_is_a_path_or_no_name_is_refused_by_parse_and_schema(name: str) -> None:
    with pytest.raises(ProfileError, match=r"spec\.runtime\.adminTokenSecret\.name"):
        parse_spec(make_spec({"name": name}))
    _, errors = validate_object(custom_resource_definition(), make_manifest(make_spec({"name": name})))
    assert any(e.startswith("spec.runtime.adminTokenSecret.name") for e in errors), errors


def test_the_schema_has_no_field_for_another_namespace() -> None:
    schema = custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    secret_ref = schema["properties"]["spec"]["properties"]["runtime"]["properties"]["adminTokenSecret"]
    # Not in a structural schema: strict field validation (kubectl's default) refuses it, pruning drops it.
    assert set(secret_ref["properties"]) == {"name", "key"}
    assert "x-kubernetes-preserve-unknown-fields" not in secret_ref


async def test_a_profile_naming_a_secret_of_another_namespace_reads_and_sends_nothing(cluster: Cluster) -> None:
    pod_a = cluster.add_pod("team-a", "chat-0")
    pod_b = cluster.add_pod("team-b", "chat-0")
    cluster.controller.upsert_profile("team-a", "chat", make_spec({"name": "chat-admin", "namespace": "team-b"}))
    await cluster.tick()
    assert cluster.sink.secret_reads == []
    assert cluster.authorizations(pod_a) == [] and cluster.authorizations(pod_b) == []
    ready = cluster.sink.condition("team-a/chat", "Ready")
    assert ready["reason"] == "InvalidSpec" and "spec.runtime.adminTokenSecret.namespace: " in ready["message"]


async def test_secret_reads_quote_the_path_and_stay_in_the_namespace() -> None:
    """Needs kmock: it records the raw path of every request (a real server would just answer 404)."""
    async with running_cluster() as (cluster, url):
        for namespace in ("team-a", "team-b"):
            cluster.objects["v1/secrets", namespace, "chat-admin"] = {
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "chat-admin", "namespace": namespace, "labels": {ADMIN_TOKEN_LABEL: "true"}},
                "data": {"token": base64.b64encode(f"{namespace}-tok".encode()).decode()},
            }  # fmt: skip
        client = KubeClient(KubeConfig.for_server(url))
        try:
            assert await client.get_secret_value("team-a", "chat-admin", "token") == "team-a-tok"
            with pytest.raises(KubeError) as missing:  # no Secret of that name in team-a, and team-b's unread
                await client.get_secret_value("team-a", "../../team-b/secrets/chat-admin", "token")
            assert missing.value.status == 404
            for bad in ("..", ".", ""):
                with pytest.raises(ValueError, match="is not a name"):
                    await client.get_secret_value("team-a", bad, "token")
        finally:
            await client.aclose()
        paths = [request.url.raw_path for request in cluster if "/secrets" in request.url.raw_path]
    assert paths == [
        "/api/v1/namespaces/team-a/secrets/chat-admin",
        "/api/v1/namespaces/team-a/secrets/..%2F..%2Fteam-b%2Fsecrets%2Fchat-admin",
    ]


async def test_a_profile_naming_a_secret_that_did_not_opt_in_sends_nothing_and_says_why(cluster: Cluster) -> None:
    pod = cluster.add_pod("team-a", "chat-0")
    cluster.sink.not_opted_in = True
    cluster.controller.upsert_profile("team-a", "chat", make_spec({"name": "chat-admin"}))
    await cluster.tick()
    assert cluster.authorizations(pod) == []
    synced = cluster.sink.condition("team-a/chat", "Synced")
    assert synced["status"] == "False"
    assert 'not sent: Secret team-a/chat-admin lacks the label batchpilot.dev/admin-token: "true"' in synced["message"]


# ---- which pod receives which token --------------------------------------------------------------------------


async def test_a_profiles_secret_goes_only_to_its_selected_pods_of_its_namespace(cluster: Cluster) -> None:
    mine = cluster.add_pod("team-a", "chat-0")
    look_alike = cluster.add_pod("team-b", "chat-0")  # same labels, another namespace
    unselected = cluster.add_pod("team-a", "other-0", {"app": "other"})
    cluster.controller.upsert_profile("team-a", "chat", make_spec({"name": "chat-admin"}))
    await cluster.tick()
    assert cluster.sink.secret_reads == [("team-a", "chat-admin", "token")]
    assert cluster.authorizations(mine) and set(cluster.authorizations(mine)) == {"Bearer team-a-token"}
    assert cluster.authorizations(look_alike) == []
    assert cluster.authorizations(unselected) == []
    assert cluster.sink.status["team-a/chat"]["pods"]["total"] == 1


async def test_a_pod_outside_the_namespace_never_gets_a_request_even_when_ready_later(cluster: Cluster) -> None:
    cluster.controller.upsert_profile("team-a", "chat", make_spec({"name": "chat-admin"}))
    look_alike = cluster.add_pod("team-b", "chat-1")
    outside = cluster.add_pod("batchpilot", "chat-2")  # a fleet namespace, still not the profile's
    assert (
        cluster.controller.upsert_pod(PodRecord("team-b", "chat-9", {"app": "chat"}, ip="10.0.0.9", ready=True)) == []
    )
    for _ in range(3):
        await cluster.tick()
    assert cluster.authorizations(look_alike) == [] and cluster.authorizations(outside) == []


async def test_the_fleet_token_goes_only_to_pods_of_its_namespaces(cluster: Cluster) -> None:
    home = cluster.add_pod("batchpilot", "chat-0")
    elsewhere = cluster.add_pod("team-c", "chat-0")
    cluster.controller.upsert_profile("batchpilot", "chat", make_spec())
    cluster.controller.upsert_profile("team-c", "chat", make_spec())
    await cluster.tick()
    assert set(cluster.authorizations(home)) == {f"Bearer {FLEET_TOKEN}"}
    assert cluster.authorizations(elsewhere) == []
    synced = cluster.sink.condition("team-c/chat", "Synced")
    assert synced["status"] == "False" and synced["reason"] == "PushFailed"
    assert (
        "the operator's admin token goes only to pods in namespaces batchpilot, team-a, not 'team-c'"
        in (synced["message"])
    )
    assert "spec.runtime.adminTokenSecret" in synced["message"]
    assert cluster.sink.status["team-c/chat"]["pods"]["synced"] == 0
    assert any(key == "team-c/chat" and reason == "PushFailed" for key, reason, _ in cluster.sink.events)


async def test_a_profile_whose_secret_has_no_token_sends_nothing_not_even_the_fleet_token(cluster: Cluster) -> None:
    pod = cluster.add_pod("team-a", "chat-0")  # team-a is a fleet namespace too
    cluster.controller.upsert_profile("team-a", "chat", make_spec({"name": "missing"}))
    await cluster.tick()
    assert cluster.sink.secret_reads == [("team-a", "missing", "token")]
    assert cluster.authorizations(pod) == []
    synced = cluster.sink.condition("team-a/chat", "Synced")
    assert synced["status"] == "False" and "not sent: Secret team-a/missing has no key 'token'" in synced["message"]


async def test_an_unreadable_secret_sends_nothing_and_says_why(cluster: Cluster) -> None:
    pod = cluster.add_pod("team-a", "chat-0")
    cluster.sink.forbidden = True
    cluster.controller.upsert_profile("team-a", "chat", make_spec({"name": "chat-admin"}))
    await cluster.tick()
    assert cluster.authorizations(pod) == []
    assert (
        'Secret team-a/chat-admin could not be read: HTTP 403: secrets "chat-admin" is forbidden'
        in (cluster.sink.condition("team-a/chat", "Synced")["message"])
    )


async def test_recommend_mode_reads_carry_the_token_and_keep_to_the_scope(cluster: Cluster) -> None:
    home = cluster.add_pod("batchpilot", "chat-0")
    elsewhere = cluster.add_pod("team-c", "chat-0")
    recommend = make_spec(tuning={"mode": "recommend", "cooldownSeconds": 0})
    cluster.controller.upsert_profile("batchpilot", "chat", recommend)
    cluster.controller.upsert_profile("team-c", "chat", recommend)
    await cluster.tick()
    assert cluster.fake.pods[home].gets >= 1 and cluster.fake.pods[home].puts == 0
    assert set(cluster.authorizations(home)) == {f"Bearer {FLEET_TOKEN}"}
    assert cluster.authorizations(elsewhere) == []
    assert "not sent" in cluster.controller.profiles["team-c/chat"].sync.pod_errors["team-c/chat-0"]


async def test_no_fleet_namespaces_means_the_fleet_token_goes_nowhere(
    parts: tuple[FakeAdminServer, AdminClient],
) -> None:
    fake, admin = parts
    cluster = make_cluster(fake, admin, default_token=FLEET_TOKEN)
    pod = cluster.add_pod("default", "chat-0")
    cluster.controller.upsert_profile("default", "chat", make_spec())
    await cluster.tick()
    assert cluster.authorizations(pod) == []
    assert "namespaces none, not 'default'" in cluster.sink.condition("default/chat", "Synced")["message"]


async def test_local_mode_never_sends_a_profiles_secret_to_a_pod_of_another_namespace(
    parts: tuple[FakeAdminServer, AdminClient],
) -> None:
    """Local mode matches pods by model, not namespace: the namespace check in the token lookup still holds."""
    fake, admin = parts
    cluster = make_cluster(fake, admin)
    cluster.controller.match_by_model = True
    fake.add_pod("local.chat", model="chat", token=None)
    cluster.controller.upsert_pod(
        PodRecord("local", "chat", ready=True, admin_url=fake.admin_url("local.chat"), model="chat", uid="1")
    )
    cluster.controller.upsert_profile("team-a", "chat", make_spec({"name": "chat-admin"}))
    await cluster.tick()
    assert cluster.sink.secret_reads == [] and cluster.authorizations("local.chat") == []
    assert (
        "Secret team-a/chat-admin goes only to pods of namespace 'team-a'"
        in (cluster.sink.condition("team-a/chat", "Synced")["message"])
    )
