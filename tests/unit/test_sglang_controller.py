"""An SGLang profile through the controller: its window's cap and budget reach the stand-in server live where it
takes them, and the status says which settings it does not take and why the pod is not synced."""

from __future__ import annotations

import io
from typing import Any

from batchpilot_operator.control.controller import Controller, PodRecord, Settings
from batchpilot_operator.frontends.local import LocalSink
from batchpilot_operator.io.push import AdminClient
from batchpilot_operator.io.sglang import SGLangClient
from tests.support.factories import make_spec_dict
from tests.support.sglang_standin import PROPOSED_KEYS, SGLangStandIn, sglang_standin

WINDOW = {"targetBatchSize": 16, "hardCap": 64, "maxWaitMs": 0, "maxPrefillTokens": 2048}


async def run_one_tick(standin: SGLangStandIn, mode: str | None = None) -> dict[str, Any]:
    sink = LocalSink(io.StringIO())
    admin = AdminClient(timeout_s=2.0)
    controller = Controller(Settings(tick_s=1.0), None, admin, sink, match_by_model=True, sglang=SGLangClient())
    with sglang_standin(standin) as url:
        controller.upsert_pod(
            PodRecord(namespace="local", name="qwen-0", ready=True, admin_url=url, model="qwen", uid="u1")
        )
        tuning = {"cooldownSeconds": 0, **({"mode": mode} if mode else {})}
        controller.upsert_profile("ml", "qwen", make_spec_dict("qwen", engine="sglang", window=WINDOW, tuning=tuning))
        await controller.tick()
    await admin.aclose()
    await controller.sglang.client.aclose()
    return sink.status["ml/qwen"]


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


async def test_a_server_that_takes_both_settings_runs_the_window_and_is_synced() -> None:
    standin = SGLangStandIn(allow=PROPOSED_KEYS)
    status = await run_one_tick(standin)
    assert (standin.server_args["max_running_requests"], standin.server_args["chunked_prefill_size"]) == (64, 2048)
    assert condition(status, "Synced")["status"] == "True"
    assert status["pods"]["synced"] == 1


async def test_todays_sglang_leaves_the_pod_unsynced_naming_the_settings_and_the_restart() -> None:
    standin = SGLangStandIn()  # SGLang's allow-list today
    status = await run_one_tick(standin)
    synced = condition(status, "Synced")
    assert (synced["status"], synced["reason"]) == ("False", "PushRefused")
    assert "max_running_requests=64 (server holds 128)" in synced["message"]
    assert "chunked_prefill_size=2048 (server holds 8192)" in synced["message"]
    assert "restarting the pod" in synced["message"]
    assert status["pods"]["synced"] == 0
    assert standin.server_args["max_running_requests"] == 128


async def test_an_sglang_profile_in_recommend_mode_sends_nothing() -> None:
    standin = SGLangStandIn(allow=PROPOSED_KEYS)
    status = await run_one_tick(standin, mode="recommend")
    assert standin.posts == []
    assert condition(status, "Synced")["reason"] == "RecommendOnly"


async def test_the_status_names_the_mode_in_force_for_kubectl_get() -> None:
    """tuning.mode unset: the status says the engine's default, which the Mode printer column shows."""
    from batchpilot_operator.api.crd import custom_resource_definition

    status = await run_one_tick(SGLangStandIn(allow=PROPOSED_KEYS))
    assert status["mode"] == "adaptive"
    columns = custom_resource_definition()["spec"]["versions"][0]["additionalPrinterColumns"]
    assert {"name": "Mode", "type": "string", "jsonPath": ".status.mode", "description": "tuning mode in force"} in (
        columns
    )
