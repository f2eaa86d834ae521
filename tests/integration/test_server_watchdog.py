"""A hung engine over HTTP: its step is made to block, and /healthz, /readyz and /metrics say so
(with the reason) until the step returns. The runtime runs with a 0.5 s stall timeout; every wait
polls with a generous deadline and no duration is asserted."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_runtime.contract import metric_names as mn
from tests.integration.runtime_process import ThreadRuntime, runtime_thread, wait_until

STALL_TIMEOUT_S = 0.5
DEADLINE_S = 60.0


class HangingModel:
    """Wraps the engine's model: a forward waits for ``release`` while ``hang`` is set."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.hang = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: Any) -> Any:
        if self.hang.is_set() and not self.release.wait(DEADLINE_S):
            raise TimeoutError("the test never released the hung step")
        return self.model(*args)


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[ThreadRuntime]:
    with runtime_thread(
        tmp_path, engine_stall_timeout_s=STALL_TIMEOUT_S, target_batch_size=1, hard_cap=4, max_wait_ms=0
    ) as started:
        yield started


def gauge(serve_url: str, name: str) -> float:
    text = httpx.get(f"{serve_url}/metrics", timeout=30.0).text
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    assert len(values) == 1, (name, values)
    return values[0]


def test_a_hung_step_fails_health_with_the_reason_until_it_returns(
    runtime: ThreadRuntime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="batchpilot.server")
    url = runtime.serve_url
    engine = runtime.ctx.loaded.engine.engine
    model = HangingModel(engine.model)
    monkeypatch.setattr(engine, "model", model)
    body = {"prompt": [40, 41, 42], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert httpx.get(f"{url}/healthz", timeout=10.0).json() == {"status": "ok"}
    assert gauge(url, mn.ENGINE_STALLED) == 0.0
    model.hang.set()
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            completion = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=DEADLINE_S * 2)
            health = wait_until(
                lambda: (r := httpx.get(f"{url}/healthz", timeout=10.0)).status_code == 503 and r,
                DEADLINE_S,
                "/healthz to fail",
            )
            status = health.json()["status"]
            assert status.startswith("engine stalled: no step completed for "), status
            assert status.endswith(" s with 1 request pending (stall timeout 0.5 s)"), status
            vllm_health = httpx.get(f"{url}/health", timeout=10.0)
            assert vllm_health.status_code == 503
            assert vllm_health.json()["status"].startswith("engine stalled: "), vllm_health.json()
            ready = httpx.get(f"{url}/readyz", timeout=10.0)
            assert ready.status_code == 503
            assert ready.json()["reason"].startswith("engine stalled: "), ready.json()
            assert gauge(url, mn.ENGINE_STALLED) == 1.0
            assert gauge(url, mn.ENGINE_STALL_SECONDS) > STALL_TIMEOUT_S
        finally:
            model.release.set()
        response = completion.result(DEADLINE_S * 2)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    wait_until(lambda: httpx.get(f"{url}/healthz", timeout=10.0).status_code == 200, DEADLINE_S, "/healthz to pass")
    assert httpx.get(f"{url}/readyz", timeout=10.0).json() == {"ready": True}
    assert httpx.get(f"{url}/health", timeout=10.0).status_code == 200
    assert gauge(url, mn.ENGINE_STALLED) == 0.0
    assert gauge(url, mn.ENGINE_STALL_SECONDS) == 0.0
    logged = [r.getMessage() for r in caplog.records if r.name == "batchpilot.server"]
    assert [m.split(":")[0] for m in logged if "stall" in m] == ["engine stalled", "engine stall cleared"], logged
