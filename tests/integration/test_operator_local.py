"""``batchpilot-operator local``: profiles from a file, runtimes on the command line, metrics scraped.

The runtimes are emulated (admin API and a /metrics whose TTFT is 2 s, over the
profile's 500 ms SLO); the command runs as a subprocess with a 1 s interval.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_runtime.contract.window import Window
from tests.integration.fake_admin import FakeAdminServer, FakePod
from tests.support.operator_process import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def write_profile(path: Path) -> None:
    profile = {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchProfile",
        "metadata": {"name": "chat", "namespace": "demo"},
        "spec": {
            "model": "chat",
            "selector": {"matchLabels": {"app": "chat"}},
            "window": {"targetBatchSize": 16, "hardCap": 32, "maxWaitMs": 40},
            "slo": {"latencyMetric": "ttft", "p99Ms": 500},
            "tuning": {"cooldownSeconds": 0},
        },
    }
    path.write_text(yaml.safe_dump(profile))


async def test_local_mode_scrapes_decides_pushes_and_prints(tmp_path: Path) -> None:
    async with FakeAdminServer(2, model="chat", token="local-token") as fake:
        for pod in fake.pods.values():
            pod.latency_s = 2.0
        token_file = tmp_path / "token"
        token_file.write_text("local-token\n")
        profiles = tmp_path / "profiles.yaml"
        write_profile(profiles)
        status_file = tmp_path / "status.json"
        log_path = tmp_path / "local.log"
        runtimes = [
            f"model=chat,url={fake.url}/pods/{i},admin={fake.admin_url(i)},token-file={token_file},name=chat-{i}"
            for i in range(2)
        ]
        command = [sys.executable, "-m", "batchpilot_operator.cli.main", "local", "--profiles", str(profiles),
                   "--interval", "1", "--status-file", str(status_file), "--duration", "60"]  # fmt: skip
        for runtime in runtimes:
            command += ["--runtime", runtime]
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220 - returns at once
        try:
            # Two scrapes make a rate: P99 = 2 s over the SLO, so the window goes down and is pushed.
            await wait_for(lambda: " down: " in log_path.read_text(), 45, "a printed 'down' decision")

            def status() -> dict[str, object]:
                return dict(json.loads(status_file.read_text()).get("demo/chat") or {}) if status_file.exists() else {}

            await wait_for(lambda: status().get("lastDecision", {}).get("direction") == "down", 20, "status")  # type: ignore[union-attr]
            window = status()["window"]
            assert window["targetBatchSize"] < 16  # type: ignore[index]
            await wait_for(
                lambda: all(p.state.window.generation == status()["window"]["generation"] for p in fake.pods.values()),  # type: ignore[index]
                20, "both runtimes on the decided window",
            )  # fmt: skip
            observed = status()["observed"]
            assert observed["p99Ms"] > 500  # type: ignore[index]
        finally:
            process.terminate()
            process.wait(timeout=20)
        text = log_path.read_text()
        assert "model=chat mode=adaptive down" in text, text[-2000:]
        assert process.returncode in (0, -15), text[-2000:]


COOLDOWN_S = 12


def restart_profile(name: str, canary: bool) -> dict[str, Any]:
    tuning: dict[str, Any] = {"cooldownSeconds": COOLDOWN_S}
    if canary:  # 20 intervals: the canary cannot end before the first operator is killed
        tuning["canary"] = {"enabled": True, "share": 0.5, "intervals": 20}
    return {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchProfile",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {
            "model": name,
            "selector": {"matchLabels": {"app": name}},
            "window": {"targetBatchSize": 16, "hardCap": 32, "maxWaitMs": 40},
            "slo": {"latencyMetric": "ttft", "p99Ms": 500},
            "tuning": tuning,
        },
    }


def change_time(status: dict[str, Any]) -> datetime.datetime:
    return datetime.datetime.fromisoformat(status["policy"]["lastChangeTime"])


def in_force(status: dict[str, Any]) -> Window:
    return Window.model_validate({k: v for k, v in status["window"].items() if k != "appliedAt"})


async def test_a_local_operator_killed_mid_cooldown_and_mid_canary_pushes_nothing_new_until_the_policy_would_have(
    tmp_path: Path,
) -> None:
    """Profile ``steady`` (one pod) is killed with a tuned window 0-2 s into its cooldown, ``trial`` (two pods)
    with a canary of its first retune running. The second operator, on the same status file, sends nothing
    but the canary's end until each cooldown has passed, then retunes as the first would have."""
    async with FakeAdminServer(0) as fake:
        pods: dict[str, FakePod] = {}
        for pod_id, model in (("s0", "steady"), ("t0", "trial"), ("t1", "trial")):
            pods[pod_id] = fake.add_pod(pod_id, model=model, token="local-token")
            pods[pod_id].latency_s = 2.0  # 4x the SLO, for both runs: only a cooldown holds a retune back
        token_file = tmp_path / "token"
        token_file.write_text("local-token\n")
        profiles = tmp_path / "profiles.yaml"
        profiles.write_text(yaml.safe_dump_all([restart_profile("steady", False), restart_profile("trial", True)]))
        status_file = tmp_path / "status.json"
        command = [sys.executable, "-m", "batchpilot_operator.cli.main", "local", "--profiles", str(profiles),
                   "--interval", "1", "--status-file", str(status_file), "--duration", "100"]  # fmt: skip
        for pod_id, model in (("s0", "steady"), ("t0", "trial"), ("t1", "trial")):
            url = fake.admin_url(pod_id)
            command += ["--runtime", f"model={model},url={url},admin={url},token-file={token_file},name={pod_id}"]

        def status(key: str) -> dict[str, Any]:
            return dict(json.loads(status_file.read_text()).get(key) or {}) if status_file.exists() else {}

        logs = [tmp_path / "first.log", tmp_path / "second.log"]
        with logs[0].open("wb") as log:
            first = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220 - returns at once
        try:
            await wait_for(
                lambda: status("demo/steady")["window"]["generation"] == 2
                and status("demo/trial")["canary"]["verdict"] == "running"
                and any(pods[p].state.window.generation == 2 for p in ("t0", "t1")),
                45, "steady retuned and trial's canary pushed",
            )  # fmt: skip
        finally:
            first.kill()  # SIGKILL: nothing is written on the way out
            first.wait(timeout=20)
        steady, trial = status("demo/steady"), status("demo/trial")
        tuned, baseline = in_force(steady), in_force(trial)
        tried = Window.model_validate(trial["canary"]["window"])
        canary_pod = next(p for p in ("t0", "t1") if pods[p].state.window == tried)
        baseline_pod = "t1" if canary_pod == "t0" else "t0"
        assert pods["s0"].state.window == tuned and pods[baseline_pod].state.window == baseline
        seen = {pod_id: len(pod.history) for pod_id, pod in pods.items()}

        with logs[1].open("wb") as log:
            second = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220 - returns at once
        try:
            await wait_for(
                lambda: pods["s0"].state.window.generation > tuned.generation
                and change_time(status("demo/trial")) > change_time(trial)
                and pods[canary_pod].state.window == Window.model_validate(status("demo/trial")["canary"]["window"]),
                60, "both profiles retuned again once their cooldowns passed",
            )  # fmt: skip
        finally:
            second.terminate()
            second.wait(timeout=20)
        text = logs[1].read_text()
        steady_after, trial_after = status("demo/steady"), status("demo/trial")
        assert f"demo/steady resumed from the status file: {tuned.describe()}" in text, text[-3000:]
        assert f"demo/trial Warning CanaryRolledBack: {tried.describe()} rolled back: the operator restarted" in text
        # steady: its pod was read, never written, until the policy's next retune, a cooldown after the last.
        retuned = pods["s0"].state.window
        assert pods["s0"].history[seen["s0"] :] == [retuned] and retuned.generation == tuned.generation + 1
        assert (change_time(steady_after) - change_time(steady)).total_seconds() >= COOLDOWN_S
        # trial: the canary pod went back to the baseline's fields past the canary's generation, and so did
        # the other pod; the next canary started only once the cooldown of the first had passed.
        back = baseline.with_generation(tried.generation + 1)
        retried = Window.model_validate(trial_after["canary"]["window"])
        assert pods[canary_pod].history[seen[canary_pod] :] == [back, retried]
        assert pods[baseline_pod].history[seen[baseline_pod] :] == [back]
        assert (change_time(trial_after) - change_time(trial)).total_seconds() >= COOLDOWN_S
        assert trial_after["canary"]["verdict"] == "running"


def test_bad_runtime_flag_names_the_key(tmp_path: Path) -> None:
    profiles = tmp_path / "p.yaml"
    write_profile(profiles)
    result = subprocess.run(
        [sys.executable, "-m", "batchpilot_operator.cli.main", "local", "--profiles", str(profiles),
         "--runtime", "model=chat,url=http://x,admn=http://y"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "unknown key 'admn'" in result.stderr
