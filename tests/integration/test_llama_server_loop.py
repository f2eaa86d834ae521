"""The operator's loop around a real engine nobody here wrote: llama.cpp's ``llama-server`` (SmolLM2 GGUF,
one thread, 8 slots) behind ``batchpilot-gate``, a ``llamacpp`` profile, ``batchpilot-operator local``.

- The loop. Nothing depends on this machine's speed: the capacity through the gate is measured first
  (closed bursts), the first-token SLO is 3x the P99 measured under light load (a quarter of that
  capacity), the operator's interval is long enough for its rate window to hold twice the policy's
  ``min_samples`` first tokens at that capacity, and the load step arrives at 3x the capacity. The
  first-token P99 goes over the SLO; the operator reads it from the gate's histogram and llama-server's
  own ``llamacpp:*`` series beside it (status.observed's ``meanBatchSize`` is llama-server's busy slots per
  decode call, as the gate's batch series stay at zero; ``tokensPerSecond`` its ``tokens_predicted_total``)
  and moves the window through the gate's ``PUT /admin/window``: the gate's ``GET`` answers the decided
  window and generation. The move is the wait and the target (docs/policy.md, "over the SLO both step
  down at once"); the cap is held at llama-server's slots by the bounds (a backlog would raise it, but
  not past the 8 slots the gate's ``--max-hard-cap`` allows, and the policy lowers a cap for latency only
  when steps are measured slow, which llama-server's metrics do not say). Honestly: a shorter wait does
  not give a 1-thread engine more capacity, so the P99 comes back under the SLO *after the step ends*,
  under light load again, on the window the operator chose; the test waits for the operator's own
  observed P99 to say so. The decision's reason (printed, and status.lastDecision) names the P99 it read
  and the SLO; a cooldown of an hour keeps that one change the only one.
- Restart mode's computed args: llama-server's args rewritten for a new window by the operator's own
  path (``engine_flags`` for the window, ``llamacpp_rewrite_args`` for the args), llama-server
  restarted with them answers ``/props`` with the window's cap as ``total_slots`` and the same
  context per slot; its log shows the window's budget as the batch sizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from batchpilot_operator.api.profile import EngineKind
from batchpilot_operator.control.restart import engine_flags
from batchpilot_operator.control.restart_plan import llamacpp_rewrite_args
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.loadgen import Endpoint, LoadSummary, run_load
from batchpilot_runtime.replay.trace import TraceRequest
from tests.integration.gate_process import GateThread, gate_thread
from tests.integration.llama_server_process import (
    LlamaServer,
    llama_server,
    llama_server_args,
    llamacpp_metrics,
)
from tests.support.operator_process import wait_for

# A busy 2-core host: llama-server on one thread, calibration, a step and a recovery of a few intervals each.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.usefixtures("llama_server_built")]

SLOTS = 8  # llama-server's --parallel, and the gate's --max-hard-cap
SLOT_CTX = 256
MODEL = "smol"
# Every request: a short prompt and a short answer, so that the rate window fills with first tokens fast.
PROMPT_TOKENS = 8
OUTPUT_TOKENS = 8
# The starting window: the cap at llama-server's slots, a target and a wait the policy may lower.
START = Window(target_batch_size=4, hard_cap=SLOTS, max_wait_ms=100)
BOUNDS = {
    "targetBatchSize": {"min": 1, "max": START.target_batch_size},
    "hardCap": {"min": 1, "max": SLOTS},
    "maxWaitMs": {"min": 0, "max": START.max_wait_ms},
}
MIN_SAMPLES = 20  # the policy's PolicyConfig.min_samples: fewer first tokens in the rate window hold
CAPACITY_BURSTS = 2
BURST_REQUESTS = 4 * SLOTS
LIGHT_SHARE = 0.25  # light load: this share of the measured capacity
LIGHT_REQUESTS = 24
SLO_OVER_LIGHT_P99 = 3.0
STEP_OVER_CAPACITY = 3.0
GATE_MAX_QUEUE = 64  # past it the step's excess is refused (429): the P99 grows, but stays inside the buckets
WAIT_INTERVALS = 30  # guards, in operator intervals, for each condition awaited
_seeds = itertools.count(1)  # a new seed per run: llama-server caches each slot's prompt


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[LlamaServer]:
    with llama_server(tmp_path / "llama-server", llama_server_args(parallel=SLOTS, ctx_size=SLOTS * SLOT_CTX)) as s:
        yield s


def steady(rate_per_s: float, count: int) -> list[TraceRequest]:
    return [TraceRequest(i / rate_per_s, PROMPT_TOKENS, OUTPUT_TOKENS) for i in range(count)]


async def replay(gate: GateThread, trace: list[TraceRequest]) -> LoadSummary:
    return await run_load([Endpoint(gate.serve_url, MODEL)], trace, seed=next(_seeds), request_timeout_s=300)


async def measure(gate: GateThread) -> tuple[float, float]:
    """Requests per second through the gate at the starting window (the best of closed bursts, the first
    one warming llama-server up), and the first-token P99 in seconds under a quarter of that."""
    rates = []
    for _ in range(CAPACITY_BURSTS):
        burst = await replay(gate, [TraceRequest(0.0, PROMPT_TOKENS, OUTPUT_TOKENS)] * BURST_REQUESTS)
        assert burst.outcomes["completed"] == BURST_REQUESTS, burst.outcomes
        rates.append(burst.throughput.completed_requests_per_s)
    capacity = max(rates)
    light = await replay(gate, steady(LIGHT_SHARE * capacity, LIGHT_REQUESTS))
    assert light.outcomes["completed"] == LIGHT_REQUESTS and light.ttft.p99_s is not None, light.outcomes
    return capacity, light.ttft.p99_s


def write_profile(path: Path, slo_ms: int) -> None:
    profile = {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchProfile",
        "metadata": {"name": MODEL, "namespace": "demo"},
        "spec": {
            "model": MODEL,
            "engine": "llamacpp",
            "selector": {"matchLabels": {"app": MODEL}},
            "window": {"targetBatchSize": START.target_batch_size, "hardCap": START.hard_cap,
                       "maxWaitMs": START.max_wait_ms},
            "slo": {"latencyMetric": "ttft", "p99Ms": slo_ms},
            # One change: the cooldown outlasts the test, so the gate keeps the window the step made.
            "tuning": {"mode": "adaptive", "cooldownSeconds": 3600, "bounds": BOUNDS},
        },
    }  # fmt: skip
    path.write_text(yaml.safe_dump(profile))


def gate_window(gate: GateThread) -> dict[str, Any]:
    response = httpx.get(f"{gate.admin_url}/admin/window", headers=gate.auth_headers(), timeout=20)
    response.raise_for_status()
    return dict(response.json()["window"])


def fields(window: dict[str, Any]) -> dict[str, Any]:
    """What the gate enforces of a window, and its generation."""
    return {k: window[k] for k in ("targetBatchSize", "hardCap", "maxWaitMs", "tailMarkRatio", "generation")}


_P99_NAMED = re.compile(r"P99 (?:beyond )?([0-9]+) ms")


async def calibrate(engine: LlamaServer, tmp_path: Path) -> tuple[float, int, float]:
    """This machine as it is now, through a gate of its own (the loop's gate starts with fresh metrics): the
    capacity in requests per second, the first-token SLO in ms and the operator's interval in seconds."""
    with gate_thread(tmp_path / "calibration", engine.url, START, max_hard_cap=SLOTS, model_name=MODEL) as gate:
        capacity, light_p99_s = await measure(gate)
    slo_ms = max(1, round(SLO_OVER_LIGHT_P99 * light_p99_s * 1000))
    interval_s = min(15.0, max(2.0, round(2 * MIN_SAMPLES / capacity, 1)))
    return capacity, slo_ms, interval_s


def start_local_operator(
    gate: GateThread, engine: LlamaServer, tmp_path: Path, interval_s: float, log_path: Path
) -> subprocess.Popen[bytes]:
    """``batchpilot-operator local`` on tmp_path's profiles.yaml, writing status.json, the gate as its runtime."""
    token_file = tmp_path / "gate-token"
    token_file.write_text(gate.token)
    runtime = (f"model={MODEL},engine=llamacpp,url={gate.serve_url},admin={gate.admin_url},"
               f"token-file={token_file},engine-url={engine.url},name={MODEL}-0")  # fmt: skip
    command = [sys.executable, "-m", "batchpilot_operator.cli.main", "local", "--profiles",
               str(tmp_path / "profiles.yaml"), "--runtime", runtime, "--interval", str(interval_s),
               "--status-file", str(tmp_path / "status.json")]  # fmt: skip
    with log_path.open("wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def assert_the_decision_went_down_for_the_p99(moved: dict[str, Any], slo_ms: int) -> str:
    """The 'down' decision's reason names the P99 it read over the SLO and the move, its window lowers the wait
    at the cap of llama-server's slots, and its observation carries llama-server's own figures. Returns the
    reason."""
    reason: str = moved["lastDecision"]["reason"]
    assert f"over SLO {slo_ms} ms" in reason, reason
    named = _P99_NAMED.search(reason)
    assert named is not None and int(named.group(1)) > slo_ms, reason
    assert "lowering the wait" in reason or "lowering wait and target" in reason, reason
    decided_window = moved["window"]
    assert decided_window["hardCap"] == SLOTS
    assert decided_window["maxWaitMs"] < START.max_wait_ms
    # What llama-server itself reported, as the operator read it beside the gate's figures.
    observed = moved["observed"]
    assert observed["p99Ms"] > slo_ms
    assert 1.0 <= observed["meanBatchSize"] <= SLOTS, observed  # its busy slots per decode call
    assert observed["tokensPerSecond"] > 0, observed  # its tokens_predicted_total
    assert "queueDepth" in observed, observed  # the gate's queue plus its requests_deferred
    return reason


def assert_one_down_decision_printed(log_path: Path, reason: str, operator: subprocess.Popen[bytes]) -> None:
    text = log_path.read_text()
    printed = [line for line in text.splitlines() if f"demo/{MODEL} model={MODEL} mode=adaptive down:" in line]
    assert len(printed) == 1, text[-3000:]
    assert f"(llamacpp: --parallel {SLOTS})" in printed[0] and reason in printed[0], printed[0]
    assert operator.returncode in (0, -15), text[-3000:]


async def test_a_load_step_over_the_first_token_slo_moves_the_gates_window_and_the_p99_comes_back(
    engine: LlamaServer, tmp_path: Path
) -> None:
    # 0. This machine as it is now.
    capacity, slo_ms, interval_s = await calibrate(engine, tmp_path)
    status_file, log_path = tmp_path / "status.json", tmp_path / "local.log"
    write_profile(tmp_path / "profiles.yaml", slo_ms)

    def status() -> dict[str, Any]:
        return dict(json.loads(status_file.read_text()).get(f"demo/{MODEL}") or {}) if status_file.exists() else {}

    settings = {"max_hard_cap": SLOTS, "max_queue": GATE_MAX_QUEUE, "model_name": MODEL}
    with gate_thread(tmp_path / "gate", engine.url, START, **settings) as gate:
        operator = start_local_operator(gate, engine, tmp_path, interval_s, log_path)
        step: asyncio.Task[LoadSummary] | None = None
        light: asyncio.Task[LoadSummary] | None = None
        guard_s = WAIT_INTERVALS * interval_s
        context = f"capacity {capacity:.2f} req/s, SLO {slo_ms} ms, interval {interval_s} s"
        try:
            # 1. The load step: the first-token P99 goes over the SLO and the operator moves the window.
            step_rate = STEP_OVER_CAPACITY * capacity
            step = asyncio.create_task(replay(gate, steady(step_rate, int(step_rate * guard_s))))

            def decided() -> dict[str, Any] | None:
                now = status()
                return now if (now.get("lastDecision") or {}).get("direction") == "down" else None

            moved = await wait_for(decided, guard_s, f"a 'down' decision ({context})")
            reason = assert_the_decision_went_down_for_the_p99(moved, slo_ms)
            decided_window = moved["window"]

            # 2. The gate answers the decided window, generation included (pushed after status is written).
            await wait_for(
                lambda: fields(gate_window(gate)) == fields(decided_window), guard_s, "the gate on the decided window"
            )

            # 3. The step ends; under light load again the operator's own P99 comes back under the SLO.
            await stop(step)
            light_rate = LIGHT_SHARE * capacity
            light = asyncio.create_task(replay(gate, steady(light_rate, int(light_rate * guard_s))))

            def back_under() -> dict[str, Any] | None:
                now = status()
                p99_ms = (now.get("observed") or {}).get("p99Ms")
                return now if p99_ms is not None and p99_ms < slo_ms else None

            recovered = await wait_for(back_under, guard_s, f"the observed P99 back under the SLO ({context})")
            assert fields(recovered["window"]) == fields(gate_window(gate)) == fields(decided_window)
        finally:
            for task in (step, light):
                if task is not None:
                    await stop(task)
            operator.terminate()
            operator.wait(timeout=30)
    assert_one_down_decision_printed(log_path, reason, operator)


async def stop(task: asyncio.Task[LoadSummary]) -> None:
    """Cancel a load (its clients hang up: the gate frees their places) and wait for it to end."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def props(server: LlamaServer) -> tuple[int, int]:
    """``/props``: (total_slots, context per slot)."""
    answer = httpx.get(server.url + "/props", timeout=30.0).json()
    return answer["total_slots"], answer["default_generation_settings"]["n_ctx"]


def decode_calls_for_one_prompt(server: LlamaServer, prompt_tokens: int) -> int:
    """``llama_decode()`` calls one prompt of ``prompt_tokens`` (and one output token) took: its prefill in
    chunks of at most the batch size (``/props`` does not report the batch size; this is its effect)."""
    before = llamacpp_metrics(server.url)["n_decode_total"]
    body = {"prompt": list(range(1000, 1000 + prompt_tokens)), "max_tokens": 1, "temperature": 0}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=120.0).json()
    assert answer["usage"]["prompt_tokens"] == prompt_tokens, answer
    return int(llamacpp_metrics(server.url)["n_decode_total"] - before)


@pytest.mark.parametrize(
    "running_args",
    [
        llama_server_args(parallel=SLOTS, ctx_size=SLOTS * SLOT_CTX),
        ["-t", "1", "-np", str(SLOTS), "-c", str(SLOTS * SLOT_CTX), "--metrics"],
    ],
    ids=["long-flags", "short-flags"],
)
def test_restart_modes_args_for_a_new_window_restart_llama_server_with_its_slots_and_budget(
    tmp_path: Path, running_args: list[str]
) -> None:
    # One prefill call at llama-server's default sizes (--batch-size 2048, --ubatch-size 512), two at the budget.
    budget = 128
    prompt_tokens = SLOT_CTX - 56
    with llama_server(tmp_path / "before", running_args) as server:
        assert props(server) == (SLOTS, SLOT_CTX)
        assert decode_calls_for_one_prompt(server, prompt_tokens) == 1
    window = Window(target_batch_size=1, hard_cap=3, max_wait_ms=0, max_prefill_tokens=budget)
    flags = engine_flags(EngineKind.LLAMACPP, window)  # what restart mode writes for this window
    args = llamacpp_rewrite_args(running_args, flags)
    with llama_server(tmp_path / "after", args) as server:
        assert props(server) == (window.hard_cap, SLOT_CTX)  # the window's cap as slots, each slot's context kept
        assert decode_calls_for_one_prompt(server, prompt_tokens) == -(-prompt_tokens // budget)
