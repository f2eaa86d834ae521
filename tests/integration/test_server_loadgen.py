"""The load generator against a real runtime: as a library (``run_load``) and as the CLI."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchpilot_runtime.cli.main import main
from batchpilot_runtime.replay.loadgen import Endpoint, run_load
from batchpilot_runtime.replay.trace import (
    DEFAULT_TRACE_PATH,
    TraceScaling,
    read_trace,
    scale_trace,
    time_scale_for_rate,
)
from tests.integration.runtime_process import ThreadRuntime, runtime_thread


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    with runtime_thread(tmp_path_factory.mktemp("loadgen"), target_batch_size=4, hard_cap=8, max_wait_ms=10) as started:
        yield started


@pytest.mark.skipif(not DEFAULT_TRACE_PATH.exists(), reason="the shared Azure trace is not checked out")
async def test_run_load_replays_the_shared_trace(runtime: ThreadRuntime) -> None:
    sliced = scale_trace(read_trace(), TraceScaling(limit=24))
    scaling = TraceScaling(
        time_scale=time_scale_for_rate(sliced, 40.0),
        token_scale=0.02,
        max_prompt_tokens=48,
        max_output_tokens=12,
        limit=24,
    )
    trace = scale_trace(read_trace(), scaling)
    summary = await run_load([Endpoint(runtime.serve_url)], trace, scaling=scaling, seed=3)
    assert summary.outcomes["completed"] == 24, summary.outcomes
    assert summary.output_tokens == sum(r.output_tokens for r in trace)
    assert summary.ttft.p99_s is not None and summary.e2e.p999_s is not None
    assert summary.ttft.p50_s <= summary.e2e.p50_s  # type: ignore[operator]
    assert summary.throughput.output_tokens_per_s > 0
    assert summary.scaling["max_output_tokens"] == 12
    assert summary.endpoints[0]["model"] == "tiny-test"


def test_loadgen_cli_with_a_custom_trace(
    runtime: ThreadRuntime, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{i:02d}.0000000,{100 + i},{5 + i}\n" for i in range(6))
    )
    out = tmp_path / "summary.json"
    code = main(
        [
            "loadgen",
            "--endpoint",
            f"{runtime.serve_url},model=tiny-test",
            "--trace",
            str(trace),
            "--rate",
            "30",
            "--token-scale",
            "0.1",
            "--max-output-tokens",
            "6",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    summary = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == summary
    assert summary["outcomes"]["completed"] == 6
    assert summary["requests_sent"] == 6
    assert summary["scaling"]["target_rate_per_s"] == 30.0
    assert summary["scaling"]["token_scale"] == 0.1
    assert summary["output_tokens"] == sum(min(6, round((5 + i) * 0.1) or 1) for i in range(6))
    for key in ("p50_s", "p99_s", "p999_s"):
        assert summary["ttft"][key] is not None
        assert summary["e2e"][key] is not None
