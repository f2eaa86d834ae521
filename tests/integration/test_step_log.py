"""``serve --step-log``: a serving runtime writes the steps it ran, and the cost model fits them."""

from __future__ import annotations

from pathlib import Path

import httpx

from batchpilot_runtime.cli.main import main
from batchpilot_runtime.replay.cost_model import load_cost_model
from batchpilot_runtime.server.step_log import read_step_log
from tests.integration.runtime_process import runtime_thread


def test_a_serving_runtime_logs_every_step_it_ran_and_calibrate_fits_them(tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    prompts = [[40 + i] * (5 + 3 * i) for i in range(6)]
    with runtime_thread(tmp_path / "rt", step_log=steps, hard_cap=4, max_prefill_tokens=8) as runtime:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            assert httpx.post(f"{runtime.serve_url}/v1/completions", json=body, timeout=60).status_code == 200
    logged = read_step_log(steps)
    # Every prompt token was prefilled in some logged step, every later token decoded in one.
    assert sum(c.prefill_tokens for c, _ in logged) == sum(len(p) for p in prompts)
    assert sum(c.decode_seqs for c, _ in logged) == 5 * len(prompts)
    assert all(c.prefill_tokens <= 8 and c.kv_tokens >= c.prefill_tokens + c.decode_seqs for c, _ in logged)
    assert main(["calibrate", "--from-step-log", str(steps), "-o", str(tmp_path / "fit.json")]) == 0
    assert load_cost_model(tmp_path / "fit.json").source == f"fit to {len(logged)} steps of steps.jsonl"
