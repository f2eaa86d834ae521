"""guidellm (the vLLM project's benchmark client, from PyPI) benchmarks the runtime as it would vLLM.

guidellm validates a backend by ``GET /health`` before it sends any load and refuses a server
that does not answer it; that is why the runtime serves ``/health`` beside ``/healthz`` and
``/readyz``. The test keeps that validation on and runs guidellm's own CLI, in a subprocess,
as a user would: a constant-rate benchmark over ``/v1/completions`` streaming, prompts from a
local JSONL file. Nothing is fetched from the Hugging Face hub: guidellm loads a tokenizer
only to synthesise prompts (synthetic and trace data); with a data file it takes the token
counts from the server's streamed ``usage``, which the test checks against the runtime's own
counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_runtime.contract import metric_names as mn
from tests.integration.runtime_process import ThreadRuntime, runtime_thread

pytestmark = pytest.mark.slow

PROMPTS = (
    "The quick brown fox",
    "Continuous batching keeps the accelerator busy",
    "Once upon a time",
    "A short prompt for a tiny model",
    "Tail latency is what users notice",
    "Batch size is a knob, not a constant",
)
MAX_TOKENS = 8
RATE_PER_S = 4
GUIDELLM_TIMEOUT_S = 120

# Any hub or dataset-hub access fails at once instead of waiting on a network that CI lacks.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
}


def _counter(metrics_text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels} in /metrics")


def _counters(runtime: ThreadRuntime) -> dict[str, float]:
    text = httpx.get(f"{runtime.serve_url}/metrics", timeout=10).text
    return {
        "completed": _counter(text, mn.REQUESTS_TOTAL, outcome="completed"),
        "error": _counter(text, mn.REQUESTS_TOTAL, outcome="error"),
        "prompt_tokens": _counter(text, mn.PROMPT_TOKENS_TOTAL),
        "generated_tokens": _counter(text, mn.GENERATED_TOKENS_TOTAL),
    }


def _run_guidellm(workdir: Path, target: str) -> dict[str, Any]:
    """Run ``guidellm run`` against ``target`` and return its JSON report."""
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    report = workdir / "report.json"
    command = [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        # validate_backend is left at its default (on): guidellm checks GET /health first.
        "--backend",
        f"kind=openai_http,target={target},request_format=/v1/completions,stream=true,"
        f"max_tokens={MAX_TOKENS},timeout=30",
        "--profile",
        f"kind=constant,rate={RATE_PER_S}",
        "--constraint",
        f"kind=max_requests,count={len(PROMPTS)}",
        "--data",
        f"kind=json_file,path={data}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console",
    ]
    env = {
        **os.environ,
        **OFFLINE_ENV,
        # A private cache: nothing cached on this machine may stand in for the hub.
        "HF_HOME": str(workdir / "hf-home"),
        # One scheduler worker (guidellm's default is up to 10 spawned processes, each
        # importing torch) keeps the run short on a small CI machine.
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",
    }
    # cwd: guidellm reads a .env file from its working directory; the test's own is empty.
    result = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=GUIDELLM_TIMEOUT_S, check=False
    )
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"guidellm exited {result.returncode}:\n{output}"
    assert report.exists(), f"guidellm wrote no report:\n{output}"
    loaded: dict[str, Any] = json.loads(report.read_text())
    return loaded


def test_guidellm_validates_and_benchmarks_the_runtime(tmp_path: Path) -> None:
    with runtime_thread(tmp_path / "runtime") as runtime:
        before = _counters(runtime)
        report = _run_guidellm(tmp_path / "guidellm", runtime.serve_url)
        after = _counters(runtime)

    [benchmark] = report["benchmarks"]
    backend = benchmark["config"]["backend"]
    assert backend["validate_backend"] is True
    assert (backend["request_format"], backend["stream"]) == ("/v1/completions", True)
    assert backend["model"] == "tiny-test"  # found through GET /v1/models

    n = len(PROMPTS)
    assert benchmark["metrics"]["request_totals"] == {"successful": n, "errored": 0, "incomplete": 0, "total": n}
    state = benchmark["scheduler_state"]
    assert (state["successful_requests"], state["errored_requests"], state["cancelled_requests"]) == (n, 0, 0)
    successful = benchmark["requests"]["successful"]
    assert len(successful) == n
    assert all(request["info"]["status"] == "completed" for request in successful)

    # The runtime saw exactly the benchmark's requests, and guidellm's token counts are the
    # server's usage figures (it loaded no tokenizer to count them itself).
    assert after["completed"] - before["completed"] == n
    assert after["error"] == before["error"]
    assert sum(request["prompt_tokens"] for request in successful) == after["prompt_tokens"] - before["prompt_tokens"]
    assert sum(request["output_tokens"] for request in successful) == (
        after["generated_tokens"] - before["generated_tokens"]
    )
    assert all(0 < request["output_tokens"] <= MAX_TOKENS for request in successful)
