"""The operator's Kubernetes client against the test control plane (a real kube-apiserver): what it writes is
what the server keeps.

- Status patches are JSON merge patches of the status subresource: None deletes a key, a nested mapping merges
  into what is there; a field the status schema does not declare is pruned by the server, and its defaults
  filled in; a missing profile is a KubeError with status 404.
- An Event names its profile (kind, name, namespace, uid) and is stored as written.
- A Secret's value is read out only when the Secret carries ``batchpilot.dev/admin-token: "true"``: without
  the label, or with another value, the client refuses (the operator then sends nothing; the profile's status
  says why, which tests/e2e/test_cluster.py checks end to end).

The client's 409 handling and its failures without an answer stay on kmock (tests/unit/test_operator_kube.py):
a real server gives neither on demand.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from batchpilot_operator import API_VERSION
from batchpilot_operator.control.records import ProfileRef
from batchpilot_operator.io.kube import KubeClient, KubeError, KubeSink, load_kube_config
from batchpilot_operator.io.token_secrets import ADMIN_TOKEN_LABEL, SecretNotOptedIn
from tests.support.control_plane import ControlPlane
from tests.support.factories import make_manifest, make_spec_dict

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
async def profile(control_plane: ControlPlane) -> AsyncIterator[tuple[KubeClient, str, str]]:
    """A KubeClient signed in as the admin, and a profile ``chat`` in a namespace of its own (namespace, uid)."""
    control_plane.install_crd()
    namespace = control_plane.namespace("kube-client")
    control_plane.apply(make_manifest(make_spec_dict(), name="chat", namespace=namespace))
    uid = control_plane.get("batchprofile", "chat", namespace=namespace)["metadata"]["uid"]
    client = KubeClient(load_kube_config(control_plane.kubeconfig))
    try:
        yield client, namespace, uid
    finally:
        await client.aclose()


async def test_status_patches_merge_and_the_server_prunes_what_the_schema_lacks(
    control_plane: ControlPlane, profile: tuple[KubeClient, str, str]
) -> None:
    client, namespace, _ = profile
    await client.patch_profile_status(namespace, "chat", {"observed": {"p99Ms": 120.0, "p50Ms": 40.0}, "phase": "x"})
    # "phase" is no status field: pruned; the schema's default for conditions is filled in (kmock does neither).
    assert control_plane.get("batchprofile", "chat", namespace=namespace)["status"] == {
        "observed": {"p99Ms": 120.0, "p50Ms": 40.0},
        "conditions": [],
    }
    await client.patch_profile_status(namespace, "chat", {"observedGeneration": 1, "observed": {"p99Ms": 90.0}})
    await client.patch_profile_status(namespace, "chat", {"observedGeneration": None})
    served = control_plane.get("batchprofile", "chat", namespace=namespace)
    assert served["status"] == {"observed": {"p99Ms": 90.0, "p50Ms": 40.0}, "conditions": []}
    assert served["metadata"]["generation"] == 1  # a status write is no spec change
    with pytest.raises(KubeError) as missing:
        await client.patch_profile_status(namespace, "nothing", {"observedGeneration": 1})
    assert missing.value.status == 404


async def test_events_name_their_profile(control_plane: ControlPlane, profile: tuple[KubeClient, str, str]) -> None:
    client, namespace, uid = profile
    await KubeSink(client).event(ProfileRef(namespace, "chat", uid), "Normal", "DecisionDown", "P99 over the SLO")
    (event,) = control_plane.get("events", namespace=namespace)["items"]
    assert event["involvedObject"] == {
        "apiVersion": API_VERSION, "kind": "BatchProfile", "name": "chat", "namespace": namespace, "uid": uid,
    }  # fmt: skip
    assert (event["type"], event["reason"], event["message"], event["count"]) == (
        "Normal", "DecisionDown", "P99 over the SLO", 1)  # fmt: skip
    assert event["source"] == {"component": "batchpilot-operator"}
    assert event["metadata"]["name"].startswith("chat.")


async def test_a_secret_without_the_opt_in_label_is_not_read_out(control_plane: ControlPlane) -> None:
    namespace = control_plane.namespace("secrets")
    for name, labels in (("unlabelled", {}), ("labelled-false", {ADMIN_TOKEN_LABEL: "false"}),
                         ("opted-in", {ADMIN_TOKEN_LABEL: "true"})):  # fmt: skip
        control_plane.apply({
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "stringData": {"token": "db-password"},
        })  # fmt: skip
    client = KubeClient(load_kube_config(control_plane.kubeconfig))
    try:
        for name in ("unlabelled", "labelled-false"):
            with pytest.raises(SecretNotOptedIn, match=r"lacks the label batchpilot\.dev/admin-token"):
                await client.get_secret_value(namespace, name, "token")
        assert await client.get_secret_value(namespace, "opted-in", "token") == "db-password"
    finally:
        await client.aclose()
