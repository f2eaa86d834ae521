"""The operator's Kubernetes client: where its credentials come from, what it sends, how failures read.

- In a pod (service host in the environment, a service-account token on disk) the token, CA and namespace
  are the service account's; a kubeconfig named on the command line wins over them.
- A kubeconfig whose user is an exec plugin runs the plugin, and the token the plugin prints is the one the
  emulator receives, from the operator's calls and in what kopf's login handler is given; an expired token
  makes the plugin run again.
- API errors keep their status and the API's message (404, a 409 conflict); no answer at all (refused, a
  server that never answers within the deadline) is a KubeError without a status, which pauses a replica
  that cannot read its peering object.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from batchpilot_operator.frontends.kopf_app import PeeringGate
from batchpilot_operator.io.kube import KubeClient, KubeConfig, KubeError, load_kube_config
from tests.integration.kmock_cluster import KubeCluster, profile_body, running_cluster
from tests.support.factories import make_spec_dict

PROFILES_ML = "/apis/batchpilot.dev/v1alpha1/namespaces/ml/batchprofiles"


def authorizations(cluster: KubeCluster) -> list[str | None]:
    """The Authorization header of every request the emulator received, in order."""
    return [request.headers.get("Authorization") for request in cluster]


# ---- credentials ---------------------------------------------------------------------------------------------


def service_account(tmp_path: Path, token: str = "sa-token") -> Path:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(token)
    (account / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    (account / "namespace").write_text("batchpilot\n")
    return account


def test_in_a_pod_the_service_account_is_used(tmp_path: Path) -> None:
    account = service_account(tmp_path)
    environ = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}
    config = load_kube_config(environ=environ, service_account_dir=account)
    assert config.server == "https://[fd00::1]:6443"  # an IPv6 service address goes in brackets
    assert config.authorization() == ("bearer", "sa-token")
    assert config.namespace == "batchpilot"
    assert config.configuration.ssl_ca_cert == str(account / "ca.crt")


def test_a_named_kubeconfig_wins_over_the_service_account(tmp_path: Path) -> None:
    account = service_account(tmp_path)
    kubeconfig = KubeCluster.kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:1")
    config = load_kube_config(kubeconfig, environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, service_account_dir=account)
    assert (config.server, config.authorization()) == ("http://127.0.0.1:1", ("Bearer", "kmock-token"))


def test_missing_credentials_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no kubeconfig at .*nowhere and not running in a cluster"):
        load_kube_config(environ={"KUBECONFIG": str(tmp_path / "nowhere")}, service_account_dir=tmp_path)
    account = service_account(tmp_path)
    (account / "ca.crt").unlink()
    with pytest.raises(ValueError, match=r"in-cluster credentials in .*serviceaccount: .*certification file"):
        load_kube_config(environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, service_account_dir=account)
    nameless = tmp_path / "config"
    nameless.write_text(
        "apiVersion: v1\ncurrent-context: c\nclusters: [{name: k, cluster: {}}]\n"
        "contexts: [{name: c, context: {cluster: k}}]\n"
    )
    with pytest.raises(ValueError, match="cluster of context 'c' has no server"):
        load_kube_config(nameless)


def exec_kubeconfig(tmp_path: Path, server: str, *, expired: bool) -> str:
    """A kubeconfig (second of two in $KUBECONFIG, non-default context) whose user is an exec plugin: a script
    printing an ExecCredential with ``exec-token-N``, N counting its runs."""
    plugin = tmp_path / "plugin.py"
    expiry = "2000-01-01T00:00:00Z" if expired else "2999-01-01T00:00:00Z"
    plugin.write_text(
        "import json, pathlib, sys\n"
        "runs = pathlib.Path(sys.argv[1])\n"
        "n = int(runs.read_text() if runs.exists() else 0) + 1\n"
        "runs.write_text(str(n))\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',\n"
        f"    'status': {{'token': f'exec-token-{{n}}', 'expirationTimestamp': '{expiry}'}}}}))\n"
    )
    path = tmp_path / "exec-config"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "emulator", "cluster": {"server": server}}],
                "contexts": [{"name": "plugged", "context": {"cluster": "emulator", "user": "p", "namespace": "ml"}}],
                "users": [
                    {
                        "name": "p",
                        "user": {
                            "exec": {
                                "apiVersion": "client.authentication.k8s.io/v1",
                                "command": sys.executable,
                                "args": [str(plugin), str(tmp_path / "runs")],
                                "interactiveMode": "Never",
                            }
                        },
                    }
                ],
            }
        )
    )
    first = KubeCluster.kubeconfig(tmp_path / "first-config", "http://127.0.0.1:1")  # current-context: kmock
    return os.pathsep.join((str(first), str(path)))


async def test_an_exec_plugins_token_is_the_one_the_emulator_receives(tmp_path: Path) -> None:
    """Needs kmock: it records the Authorization header of each request (a real server does not say which token
    it was sent, and would need a token webhook to accept the plugin's)."""
    async with running_cluster() as (cluster, url):
        config = load_kube_config(
            context="plugged", environ={"KUBECONFIG": exec_kubeconfig(tmp_path, url, expired=False)}
        )
        assert (config.server, config.namespace) == (url, "ml")
        client = KubeClient(config)
        try:
            await client.list_profiles("ml")
            await client.list_profiles("ml")
        finally:
            await client.aclose()
        # One run at load; the token is still valid, so every call (and kopf's login) carries the same one.
        assert authorizations(cluster) == ["Bearer exec-token-1", "Bearer exec-token-1"]
        assert config.authorization() == ("Bearer", "exec-token-1")


async def test_an_expired_exec_token_runs_the_plugin_again(tmp_path: Path) -> None:
    """Needs kmock, as the test above."""
    async with running_cluster() as (cluster, url):
        kubeconfig = exec_kubeconfig(tmp_path, url, expired=True)
        config = load_kube_config(context="plugged", environ={"KUBECONFIG": kubeconfig})
        client = KubeClient(config)
        try:
            await client.list_profiles("ml")
            await client.list_profiles("ml")
        finally:
            await client.aclose()
        assert authorizations(cluster) == ["Bearer exec-token-2", "Bearer exec-token-3"]
        assert config.authorization() == ("Bearer", "exec-token-4")


# ---- calls and their failures ---------------------------------------------------------------------------------


@pytest.fixture
async def emulator() -> AsyncIterator[tuple[KubeCluster, str, KubeClient]]:
    async with running_cluster() as (cluster, url):
        client = KubeClient(KubeConfig.for_server(url, token="t"))
        try:
            yield cluster, url, client
        finally:
            await client.aclose()


async def test_a_status_conflict_keeps_its_status(emulator: tuple[KubeCluster, str, KubeClient]) -> None:
    """Needs kmock: it answers a status patch with 409 on demand (the merge itself is checked on the real server,
    tests/apiserver/test_kube_client_on_apiserver.py)."""
    cluster, url, client = emulator
    async with httpx.AsyncClient(base_url=url) as api:
        await api.post(PROFILES_ML, json=profile_body("ml", "chat", make_spec_dict()))
    cluster.fail_status_patches = 1
    with pytest.raises(KubeError, match=r"^HTTP 409: injected conflict on status$") as conflict:
        await client.patch_profile_status("ml", "chat", {"phase": None})
    assert conflict.value.status == 409
    assert [r.headers.get("Content-Type") for r in cluster if r.subresource == "status"] == [
        "application/merge-patch+json"
    ]


async def test_no_answer_is_a_kube_error_without_status() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused_url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
        client = KubeClient(KubeConfig.for_server(refused_url))
        try:
            with pytest.raises(KubeError, match=r"^no answer: NewConnectionError") as refused:
                await client.list_profiles()
        finally:
            await client.aclose()
    assert refused.value.status is None


async def test_a_server_that_never_answers_is_cut_at_the_deadline() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the request arrives; no answer ever leaves

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = KubeClient(KubeConfig.for_server(f"http://127.0.0.1:{port}"), timeout_s=0.2)
    try:
        with pytest.raises(KubeError, match=r"^no answer: ReadTimeoutError") as timed_out:
            await client.get_secret_value("ml", "admin", "token")
    finally:
        await client.aclose()
        server.close()
    assert timed_out.value.status is None


async def test_a_peering_object_that_cannot_be_read_pauses_the_replica() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        client = KubeClient(KubeConfig.for_server(f"http://127.0.0.1:{closed.getsockname()[1]}"))
        gate = PeeringGate(client, name="batchpilot", namespace=None, identity="me", priority=1)
        try:
            assert not await gate.refresh()
        finally:
            await client.aclose()
    assert not gate.active and gate.reason.startswith("peering object unreadable (no answer: NewConnectionError")
