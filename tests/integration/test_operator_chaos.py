"""Chaos in local mode: two profiles; B's runtime answers badly in every way in turn, A's is healthy.

``batchpilot-operator local`` runs as a subprocess with a 1 s interval and short
deadlines (``--push-timeout``, ``--query-timeout``). A's runtime (emulated) reports a
TTFT far over its SLO, with a large window and small steps, so every interval brings
A a new window generation. B's runtime is a :class:`ChaosPod` that, in turn, refuses
connections, answers 500, answers invalid JSON, drips a body that never ends, and
sends 100 MiB. Through all of it A must keep being retuned and pushed, B's status must
name what is wrong, and the operator must stay up without reading the 100 MiB.

An IPv6 pod address (the kopf path: the controller builds the URL from the pod IP) is
checked in-process with the same components, when this machine can listen on ``::1``.
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_operator.control.controller import Controller, PodRecord, Settings
from batchpilot_operator.frontends.local import LocalSink
from batchpilot_operator.io.push import AdminClient
from batchpilot_operator.io.scrape import ScrapeSource
from tests.integration.chaos_pod import HUGE_BYTES, ChaosPod, ipv6_loopback_available
from tests.integration.fake_admin import ROOT_POD, FakeAdminServer
from tests.support.operator_process import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# What B's Synced condition must say for each bad pod (the pod's own failure, named).
CAUSES = {
    "refused": "ConnectError",
    "http500": "HTTP 500: boom",
    "invalid_json": "unreadable window state: Invalid JSON",
    "endless": "timed out: no complete answer within 0.5 s",
    "huge": "answer body over the 1 MiB cap",
}
NEW_GENERATIONS_PER_CASE = 3


def profile(model: str) -> dict[str, Any]:
    """A profile whose every interval over the SLO is a new window: a large window, 5 % steps, no cooldown."""
    return {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchProfile",
        "metadata": {"name": model, "namespace": "local"},
        "spec": {
            "model": model,
            "selector": {"matchLabels": {"app": model}},
            "window": {"targetBatchSize": 256, "hardCap": 512, "maxWaitMs": 40},
            "slo": {"latencyMetric": "ttft", "p99Ms": 500},
            "tuning": {
                "cooldownSeconds": 0,
                "maxStepFraction": 0.05,
                "bounds": {"targetBatchSize": {"min": 1, "max": 512}, "hardCap": {"min": 1, "max": 1024}},
            },
        },
    }


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((dict(c) for c in status.get("conditions") or [] if c.get("type") == type_), {})


async def test_a_bad_pod_fails_its_own_profile_and_never_the_healthy_one(tmp_path: Path) -> None:
    chaos = ChaosPod(mode="refused")
    await chaos.start()
    async with FakeAdminServer(1, model="a", token=None) as fake:
        healthy = fake.pods["0"]
        healthy.latency_s = 2.0  # 4x A's SLO: every interval lowers A's window
        profiles = tmp_path / "profiles.yaml"
        profiles.write_text(yaml.safe_dump_all([profile("a"), profile("b")]))
        status_file = tmp_path / "status.json"
        log_path = tmp_path / "local.log"
        command = [sys.executable, "-m", "batchpilot_operator.cli.main", "local", "--profiles", str(profiles),
                   "--interval", "1", "--push-timeout", "0.5", "--query-timeout", "0.5",
                   "--status-file", str(status_file), "--duration", "250",
                   "--runtime", f"model=a,url={fake.url}/pods/0,admin={fake.admin_url(0)},name=a-0",
                   "--runtime", f"model=b,url={chaos.url},admin={chaos.url},name=b-0"]  # fmt: skip

        def status(key: str) -> dict[str, Any]:
            text = status_file.read_text() if status_file.exists() else ""
            return dict(json.loads(text).get(key) or {}) if text else {}

        with log_path.open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220 - returns at once
        try:
            for mode, cause in CAUSES.items():
                await chaos.set_mode(mode)

                def b_reports(cause: str = cause) -> bool:
                    synced = condition(status("local/b"), "Synced")
                    return synced.get("reason") == "PushFailed" and cause in synced.get("message", "")

                await wait_for(b_reports, 60, f"B's Synced condition to name {cause!r}")
                # A is retuned and pushed every interval meanwhile: new generations land on its pod.
                start = healthy.state.window.generation
                await wait_for(
                    lambda start=start: healthy.state.window.generation >= start + NEW_GENERATIONS_PER_CASE,
                    60, f"{NEW_GENERATIONS_PER_CASE} new windows pushed to A while B answers {mode}",
                )  # fmt: skip
                await wait_for(
                    lambda start=start: condition(status("local/a"), "Synced").get("status") == "True"
                    and status("local/a")["window"]["generation"] >= start + NEW_GENERATIONS_PER_CASE,
                    30, "A's status to follow (Synced=True, the new generation)",
                )  # fmt: skip
                assert b_reports(), status("local/b")  # still B's cause: A's progress did not come from B healing
                assert process.poll() is None, log_path.read_text()[-3000:]
        finally:
            process.terminate()
            process.wait(timeout=30)
            await chaos.stop()
    text = log_path.read_text()
    assert process.returncode in (0, -15), text[-3000:]
    assert "Traceback" not in text and "tick failed" not in text, text[-3000:]
    assert "local/b-0: error:" in text  # B's failures were printed as Events, naming the pod
    # The 100 MiB bodies (admin calls and /metrics scrapes) were cut short: each one stopped well before its end.
    assert chaos.sent_bytes and chaos.hung_up["huge"] == len(chaos.sent_bytes)
    assert max(chaos.sent_bytes) < HUGE_BYTES // 4, chaos.sent_bytes
    assert chaos.hung_up["endless"] >= 1  # the dripped answers were given up on, not waited out


@pytest.mark.skipif(not ipv6_loopback_available(), reason="this machine cannot listen on ::1")
async def test_a_pod_on_an_ipv6_address_is_scraped_and_pushed_beside_an_ipv4_one() -> None:
    """The pod-IP path (kopf's): URLs are built from ``::1`` and the profile's ports, in brackets."""
    v6 = FakeAdminServer(0)
    v6_pod = v6.add_pod(ROOT_POD, model="b", token=None)
    v6_pod.latency_s = 2.0
    await v6.start(host="::1")
    port = int(v6.url.rsplit(":", 1)[1])
    async with FakeAdminServer(1, model="a", token=None) as v4:
        v4.pods["0"].latency_s = 2.0
        sink = LocalSink(io.StringIO())
        admin = AdminClient(timeout_s=2.0)
        source = ScrapeSource(rate_window_s=0.5, timeout_s=2.0)
        controller = Controller(Settings(tick_s=0.1, interval_override_s=0.5), source, admin, sink, match_by_model=True)
        controller.upsert_pod(PodRecord("local", "a-0", ready=True, admin_url=v4.admin_url(0),
                                        metrics_url=f"{v4.url}/pods/0/metrics", model="a", uid="a"))  # fmt: skip
        controller.upsert_pod(PodRecord("local", "b-0", ready=True, ip="::1", model="b", uid="b"))
        for model in ("a", "b"):
            spec = dict(profile(model)["spec"])
            spec["runtime"] = {"adminPort": port, "servePort": port}  # A's pod has URLs: its ports go unused
            controller.upsert_profile("local", model, spec, generation=1)
        stop = asyncio.Event()
        loop = asyncio.create_task(controller.run(stop))
        try:
            for pod in (v4.pods["0"], v6_pod):  # both scraped twice (a rate), decided, and pushed a lower window
                await wait_for(lambda pod=pod: pod.state.window.generation >= 3, 60, "two retuned windows pushed")
            await wait_for(lambda: condition(sink.status.get("local/b", {}), "Synced").get("status") == "True", 30,
                           "B Synced")  # fmt: skip
        finally:
            stop.set()
            await loop
            await admin.aclose()
            await source.aclose()
            await v6.stop()
    assert v6_pod.scrapes >= 2 and v6_pod.puts >= 2
