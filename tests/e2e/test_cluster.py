"""End to end on a real cluster (kind or k3d): install the chart, apply a profile, run a runtime, wait for Synced.

Skipped unless a cluster is named explicitly, so that CI never tries to reach one:

- ``BATCHPILOT_E2E_KUBECONFIG=/path/to/kubeconfig``, or
- ``BATCHPILOT_E2E=1`` to use the current kubectl context.

The images must already be in the cluster (see deploy/README.md: build with docker, then
``kind load docker-image`` or ``k3d image import``); name them with ``BATCHPILOT_E2E_OPERATOR_IMAGE``
and ``BATCHPILOT_E2E_RUNTIME_IMAGE`` (default ``batchpilot-operator:dev`` and ``batchpilot-runtime:dev``).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import CHART, helm_path, kubectl_path

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

KUBECONFIG = os.environ.get("BATCHPILOT_E2E_KUBECONFIG")
ENABLED = bool(KUBECONFIG) or os.environ.get("BATCHPILOT_E2E") == "1"
if not ENABLED:
    pytest.skip("no cluster configured: set BATCHPILOT_E2E_KUBECONFIG or BATCHPILOT_E2E=1", allow_module_level=True)

OPERATOR_IMAGE = os.environ.get("BATCHPILOT_E2E_OPERATOR_IMAGE", "batchpilot-operator:dev")
RUNTIME_IMAGE = os.environ.get("BATCHPILOT_E2E_RUNTIME_IMAGE", "batchpilot-runtime:dev")
RELEASE = "bp-e2e"
SYNCED_TIMEOUT_S = 300.0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    if KUBECONFIG:
        env["KUBECONFIG"] = KUBECONFIG
    return env


def _run(*args: str | Path, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout_s, env=_env(), check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def _kubectl(*args: str, namespace: str | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    ns = ["--namespace", namespace] if namespace else []
    return _run(kubectl_path(), *ns, *args, timeout_s=timeout_s)


def _image(reference: str) -> dict[str, str]:
    repository, _, tag = reference.rpartition(":")
    if not repository or "/" in tag:
        return {"repository": reference, "tag": "latest"}
    return {"repository": repository, "tag": tag}


def _values() -> dict[str, Any]:
    small = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    return {
        "operator": {
            "image": {**_image(OPERATOR_IMAGE), "pullPolicy": "IfNotPresent"},
            "resources": small,
            # No Prometheus in a bare kind cluster: static mode pushes without metrics.
            "prometheusUrl": "http://127.0.0.1:9/",
        },
        "runtime": {
            "image": {**_image(RUNTIME_IMAGE), "pullPolicy": "IfNotPresent"},
            "resources": small,
            "kvCacheTokens": 4096,
            "terminationGracePeriodSeconds": 10,
        },
        "models": [
            {
                "name": "tiny",
                "preset": "tiny",
                "replicas": 1,
                "profile": {
                    "tuning": {"mode": "static"},
                    "window": {"targetBatchSize": 4, "hardCap": 8, "maxWaitMs": 10, "tailMarkRatio": 2.0},
                },
            }
        ],
        "networkPolicy": {"enabled": True},
    }


@pytest.fixture(scope="module")
def namespace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _kubectl("version", timeout_s=30)
    name = f"bp-e2e-{secrets.token_hex(3)}"
    _kubectl("create", "namespace", name)
    values = tmp_path_factory.mktemp("e2e") / "values.yaml"
    values.write_text(yaml.safe_dump(_values()))
    try:
        _run(
            helm_path(),
            "install",
            RELEASE,
            CHART,
            "--namespace",
            name,
            "--values",
            values,
            "--wait",
            "--timeout",
            "10m",
            timeout_s=700,
        )
        yield name
    finally:
        _run(helm_path(), "uninstall", RELEASE, "--namespace", name, "--wait", check=False, timeout_s=300)
        _run(kubectl_path(), "delete", "namespace", name, "--wait=false", check=False)


def _condition(profile: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for condition in profile.get("status", {}).get("conditions", []):
        if condition["type"] == kind:
            return condition  # type: ignore[no-any-return]
    return None


def _wait_for_synced(namespace: str, name: str) -> dict[str, Any]:
    deadline = time.monotonic() + SYNCED_TIMEOUT_S
    profile: dict[str, Any] = {}
    while time.monotonic() < deadline:
        profile = json.loads(_kubectl("get", "batchprofile", name, "-o", "json", namespace=namespace).stdout)
        synced = _condition(profile, "Synced")
        if synced and synced["status"] == "True" and profile["status"].get("pods", {}).get("synced", 0) >= 1:
            return profile
        time.sleep(3)  # polling the API server, not waiting for a condition blindly
    raise AssertionError(f"BatchProfile {name} not Synced within {SYNCED_TIMEOUT_S:.0f} s: {profile.get('status')}")


def test_profile_becomes_synced_and_runtime_has_its_window(namespace: str) -> None:
    name = f"{RELEASE}-batchpilot-tiny"
    profile = _wait_for_synced(namespace, name)
    window = profile["status"]["window"]
    assert (window["targetBatchSize"], window["hardCap"], window["maxWaitMs"]) == (4, 8, 10)
    # The runtime itself reports the window in force (read through the API server's pod proxy).
    pod = json.loads(
        _kubectl("get", "pods", "-l", "batchpilot.dev/model=tiny", "-o", "json", namespace=namespace).stdout
    )["items"][0]["metadata"]["name"]
    metrics = _kubectl("get", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}:8080/proxy/metrics").stdout
    assert any(
        line.startswith("batchpilot_window_hard_cap") and line.rstrip().endswith(" 8.0")
        for line in metrics.splitlines()
    ), "runtime does not report hardCap 8"


def test_helm_test_hook_passes(namespace: str) -> None:
    _run(helm_path(), "test", RELEASE, "--namespace", namespace, "--timeout", "5m", timeout_s=360)


def test_admin_token_survives_an_upgrade(namespace: str) -> None:
    secret_name = f"{RELEASE}-batchpilot-admin-token"

    def token() -> str:
        secret = json.loads(_kubectl("get", "secret", secret_name, "-o", "json", namespace=namespace).stdout)
        return base64.b64decode(secret["data"]["token"]).decode()

    before = token()
    _run(
        helm_path(),
        "upgrade",
        RELEASE,
        CHART,
        "--namespace",
        namespace,
        "--reuse-values",
        "--wait",
        "--timeout",
        "10m",
        timeout_s=700,
    )
    assert token() == before
    _wait_for_synced(namespace, f"{RELEASE}-batchpilot-tiny")
