"""A load step over the SLO that does not depend on this machine's speed.

The runtimes' capacity is measured first (closed bursts of the step's requests, while the runtimes run a
cap that takes a whole burst in one batch, so that the figure is near what the largest window the
operator could move to would give); the SLO is set from the latency measured under light load (3x it);
the step arrives at 3x the measured capacity, so that it overloads the runtimes on an idle machine as on
a busy one, whatever window the operator moves to. The runtimes' queues grow by about twice the capacity
per second, so P99 keeps growing until the step is stopped.

Load is sent from a subprocess: on the test's own event loop or thread it would slow the polling of the
profile's status, and so the counting of the operator's decisions.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from batchpilot_runtime.replay.loadgen import Endpoint, run_load
from batchpilot_runtime.replay.trace import TraceRequest

# The step's requests; the capacity is measured on the same sizes.
STEP_PROMPT_TOKENS = 96
STEP_OUTPUT_TOKENS = 48
# Capacity: the best of a few closed bursts (all sent at once, spread over the runtimes); the runtimes
# run this cap while it is measured.
CAPACITY_BURSTS = 3
BURST_REQUESTS = 128
CAPACITY_HARD_CAP = 128
# The step: this many times the measured capacity, for STEP_DURATION_S or STEP_MAX_REQUESTS requests,
# whichever ends first (a test ends it sooner, once the window is lowered). It is sent by STEP_CLIENTS load
# generators (every STEP_CLIENTS-th request each, at the same times), so that no connection pool holds many
# connections: httpcore's pool spends time quadratic in them on every request, on the event loop that also
# sends, and a sender that falls behind sends in bursts.
STEP_CLIENTS = 16
STEP_OVER_CAPACITY = 3.0
STEP_DURATION_S = 60.0
STEP_MAX_REQUESTS = 6000
# Light load, from which the SLO is set: short requests at a steady rate, SLO_OVER_LIGHT_P99 x its P99.
LIGHT_RATE_PER_S = 8.0
LIGHT_DURATION_S = 400.0
LIGHT_PROMPT_TOKENS = 16
LIGHT_OUTPUT_TOKENS = 8
SLO_OVER_LIGHT_P99 = 3.0
SLO_FLOOR_MS = 30.0


async def measure_capacity(endpoints: Sequence[Endpoint]) -> float:
    """Completed requests per second of these runtimes together on the step's request sizes: the best of
    ``CAPACITY_BURSTS`` closed bursts (the first one also warms the runtimes up)."""
    rates = []
    for _ in range(CAPACITY_BURSTS):
        burst = [TraceRequest(0.0, STEP_PROMPT_TOKENS, STEP_OUTPUT_TOKENS)] * BURST_REQUESTS
        summary = await run_load(list(endpoints), burst, fanout="round-robin", request_timeout_s=120)
        assert summary.outcomes["completed"] == BURST_REQUESTS, summary.outcomes
        rates.append(summary.throughput.completed_requests_per_s)
    return max(rates)


def slo_from_light_p99(light_p99_ms: float) -> float:
    return max(SLO_OVER_LIGHT_P99 * light_p99_ms, SLO_FLOOR_MS)


_LOAD_SCRIPT = """
import asyncio, sys
from batchpilot_runtime.replay.loadgen import Endpoint, run_load
from batchpilot_runtime.replay.trace import TraceRequest

async def main(model, clients, rate, count, prompt, output, *urls):
    endpoints = [Endpoint(url, model) for url in urls]
    trace = [TraceRequest(i / float(rate), int(prompt), int(output)) for i in range(int(count))]
    parts = [trace[i::int(clients)] for i in range(int(clients))]
    await asyncio.gather(*(run_load(endpoints, p, fanout="round-robin", request_timeout_s=120) for p in parts))

asyncio.run(main(*sys.argv[1:]))
"""


def start_load(
    endpoints: Sequence[Endpoint],
    rate_per_s: float,
    count: int,
    prompt_tokens: int,
    output_tokens: int,
    log_path: Path,
    *,
    clients: int = 1,
) -> subprocess.Popen[bytes]:
    """Open-loop load at a steady rate (round-robin over ``endpoints``, every one of the same model), sent by
    ``clients`` load generators in a subprocess."""
    model = endpoints[0].model
    args = [model, str(clients), repr(rate_per_s), str(count), str(prompt_tokens), str(output_tokens)]
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-c", _LOAD_SCRIPT, *args, *(e.url for e in endpoints)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def start_light_load(endpoints: Sequence[Endpoint], log_path: Path) -> subprocess.Popen[bytes]:
    count = int(LIGHT_RATE_PER_S * LIGHT_DURATION_S)
    return start_load(endpoints, LIGHT_RATE_PER_S, count, LIGHT_PROMPT_TOKENS, LIGHT_OUTPUT_TOKENS, log_path)


def start_step(
    endpoints: Sequence[Endpoint], capacity_per_s: float, log_path: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """The step at ``STEP_OVER_CAPACITY`` x ``capacity_per_s``, and a line that describes it."""
    rate = STEP_OVER_CAPACITY * capacity_per_s
    count = int(rate * min(STEP_DURATION_S, STEP_MAX_REQUESTS / rate))
    described = f"{count} requests at {rate:.1f}/s ({STEP_OVER_CAPACITY:g}x the capacity, {capacity_per_s:.1f}/s)"
    process = start_load(endpoints, rate, count, STEP_PROMPT_TOKENS, STEP_OUTPUT_TOKENS, log_path, clients=STEP_CLIENTS)
    return process, described


def stop_load(process: subprocess.Popen[bytes]) -> None:
    """Ends the load (its requests in flight are cancelled)."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
