"""The restart path's one write, on a real kube-apiserver v1.37.2 (issue #27, part 4).

``tuning.mode: restart`` server-side applies the engine container's ``args`` of the Deployment a
profile names, under the field manager ``batchpilot`` and forced (the args were a GitOps tool's).
Here the real server's field ownership is checked: the args change hands and the Deployment's
``generation`` moves (a rollout); every other field stays with the manager that set it, a field
another manager owns (``replicas``, as an autoscaler sets it) is kept, and the GitOps tool's next
apply of its own args meets a conflict naming ``batchpilot`` instead of silently reverting them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchpilot_operator.io.kube import FIELD_MANAGER, KubeClient, load_kube_config
from tests.support.control_plane import ControlPlane

pytestmark = [pytest.mark.timeout(120)]

OLD_ARGS = ["--model", "chat", "--max-num-seqs", "256"]
NEW_ARGS = ["--model", "chat", "--max-num-seqs", "64", "--max-num-batched-tokens", "1024"]


def _deployment(namespace: str, args: list[str]) -> dict[str, Any]:
    labels = {"app": "chat"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.11.0",
                            "args": args,
                            "env": [{"name": "A", "value": "1"}],
                        }
                    ]
                },
            },
        },
    }


def _owners(deployment: dict[str, Any]) -> dict[str, str]:
    """Each manager's fieldsV1, as text (enough to ask who owns args, env, replicas)."""
    return {
        entry["manager"]: json.dumps(entry.get("fieldsV1", {})) for entry in deployment["metadata"]["managedFields"]
    }


async def test_restart_args_change_hands_and_other_managers_keep_their_fields(control_plane: ControlPlane) -> None:
    namespace = control_plane.namespace("restart")
    control_plane.kubectl(
        "apply",
        "--server-side",
        "--field-manager=argocd",
        "-f",
        "-",
        stdin=json.dumps(_deployment(namespace, OLD_ARGS)),
    )
    scale = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "chat", "namespace": namespace},
             "spec": {"replicas": 3}}  # fmt: skip
    control_plane.kubectl("apply", "--server-side", "--field-manager=autoscaler", "-f", "-", stdin=json.dumps(scale))
    before = control_plane.get("deployment", "chat", namespace=namespace)

    client = KubeClient(load_kube_config(control_plane.kubeconfig))
    try:
        applied = await client.apply_container_args(namespace, "Deployment", "chat", "vllm", NEW_ARGS)
    finally:
        await client.aclose()

    after = control_plane.get("deployment", "chat", "--show-managed-fields", namespace=namespace)
    container = after["spec"]["template"]["spec"]["containers"][0]
    assert applied["metadata"]["generation"] == after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    assert container["args"] == NEW_ARGS
    assert container["image"] == "vllm/vllm-openai:v0.11.0" and container["env"] == [{"name": "A", "value": "1"}]
    assert after["spec"]["replicas"] == 3
    owners = _owners(after)
    assert '"f:args"' in owners[FIELD_MANAGER] and '"f:image"' not in owners[FIELD_MANAGER]
    assert '"f:args"' not in owners["argocd"] and '"f:image"' in owners["argocd"] and '"f:env"' in owners["argocd"]
    assert '"f:replicas"' in owners["autoscaler"]

    # The GitOps tool applying its old args again is told who owns them now (unless it forces).
    again = control_plane.kubectl(
        "apply", "--server-side", "--field-manager=argocd", "-f", "-",
        stdin=json.dumps(_deployment(namespace, OLD_ARGS)), check=False,
    )  # fmt: skip
    assert again.returncode != 0 and "conflict" in again.stderr and f'"{FIELD_MANAGER}"' in again.stderr, again.stderr
    assert (
        control_plane.get("deployment", "chat", namespace=namespace)["spec"]["template"]["spec"]["containers"][0][
            "args"
        ]
        == NEW_ARGS
    )
