"""``kubectl apply -f deploy/examples/`` against the emulator, and the operator taking the profiles up."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.deploy.tools import REPO, kubectl_path
from tests.integration.kmock_cluster import PROFILES, KubeCluster, OperatorProcess, running_cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def kubectl(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(kubectl_path()), "--kubeconfig", str(kubeconfig), *args]
    return await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120, cwd=REPO)


async def test_kubectl_apply_examples_and_operator_reports_them(tmp_path: Path) -> None:
    examples = sorted((REPO / "deploy" / "examples").glob("*.yaml"))
    assert examples
    async with running_cluster() as (cluster, url):
        kubeconfig = KubeCluster.kubeconfig(tmp_path / "kubeconfig", url)
        # The emulator serves no OpenAPI document, so kubectl's client-side schema validation is off;
        # the schema itself is checked against these examples by the CRD tests.
        applied = await kubectl(kubeconfig, "apply", "-f", "deploy/examples/", "--validate=false")
        assert applied.returncode == 0, applied.stderr
        assert applied.stdout.count(" created") == len(examples)
        again = await kubectl(kubeconfig, "apply", "-f", "deploy/examples/", "--validate=false")
        assert again.returncode == 0 and again.stdout.count(" unchanged") == len(examples), again.stdout + again.stderr
        names = {obj["metadata"]["name"] for obj in cluster.objects_of(PROFILES)}
        assert len(names) == len(examples)

        operator = OperatorProcess(tmp_path, url, "-A", "--interval-override", "1", "--tick", "0.3", "--peering", "off")
        try:

            def all_reported() -> bool:
                objects = cluster.objects_of(PROFILES)
                return len(objects) == len(examples) and all(
                    any(c["type"] == "Ready" for c in (o.get("status") or {}).get("conditions", [])) for o in objects
                )

            await wait_for(all_reported, 60, "status on every example profile")
            for obj in cluster.objects_of(PROFILES):
                ready = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
                # No runtime pods exist here: valid examples wait for pods, none is refused as invalid.
                assert ready["reason"] == "NoReadyPods", (obj["metadata"]["name"], ready)
            listed = await kubectl(kubeconfig, "get", "bp", "-A")
            assert listed.returncode == 0 and "chat-assistant" in listed.stdout, listed.stderr
        finally:
            operator.stop()
