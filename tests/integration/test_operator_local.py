"""``batchpilot-operator local``: profiles from a file, runtimes on the command line, metrics scraped.

The runtimes are emulated (admin API and a /metrics whose TTFT is 2 s, over the
profile's 500 ms SLO); the command runs as a subprocess with a 1 s interval.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.fake_admin import FakeAdminServer
from tests.integration.kmock_cluster import wait_for

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
