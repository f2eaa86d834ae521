"""End to end on one machine: kopf operator + kmock + two real runtimes (tiny) + a real Prometheus + load.

The runtimes listen on 127.0.0.2 and 127.0.0.3 with the same ports, as two pods
would; Prometheus scrapes them every second with a ``namespace`` label; the
operator runs with a 2 s interval. Nothing depends on this machine's speed: the
runtimes' capacity is measured first (closed bursts of the step's requests, with a
cap that takes a whole burst in one batch), the SLO is set from the latency measured
under light load (3x it), and the load step arrives at 3x the measured capacity, so
that it overloads the runtimes on an idle machine as on a busy one, whatever window
the operator moves to. P99 goes over the SLO and the operator must lower the window
within 3 intervals (counted in the operator's own decisions, not in seconds); the
step then ends, and the profile's status, its Events and both runtimes'
``/admin/window`` agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchpilot_runtime.replay.loadgen import Endpoint, run_load
from batchpilot_runtime.replay.trace import TraceRequest
from tests.integration.kmock_cluster import KubeCluster, OperatorProcess, free_port_on_all, running_cluster, wait_for
from tests.integration.prometheus_process import ScrapeTarget, start_prometheus
from tests.integration.runtime_process import RuntimeProcess, start_runtime_process
from tests.support import operator_e2e as e2e

pytestmark = e2e.marks(timeout_s=420)

POD_IPS = ("127.0.0.2", "127.0.0.3")
MODEL = "tiny-chat"
TOKEN = "e2e-admin-token"
INTERVAL_S = 2.0
# The load step's requests; the capacity is measured on the same sizes.
STEP_PROMPT_TOKENS = 96
STEP_OUTPUT_TOKENS = 48
# Capacity: the best of a few closed bursts (all sent at once, spread over both runtimes). The runtimes
# start with a cap that admits a whole burst in one batch, so the figure is near what the largest
# window the operator could move to would give (the policy raises the cap under a backlog).
CAPACITY_BURSTS = 3
BURST_REQUESTS = 128
STARTUP_HARD_CAP = 128
# The step: this many times the measured capacity, for STEP_DURATION_S or STEP_MAX_REQUESTS requests,
# whichever ends first (it is ended sooner, once the window is lowered). The runtimes' queues (1024 each)
# grow by about twice the capacity per second, so P99 keeps growing; once they are full the excess is
# answered 429 (the test does not need it to come to that).
# The step is sent by this many load generators (every STEP_CLIENTS-th request each, at the same times), so
# that no connection pool holds many connections: httpcore's pool spends time quadratic in them on every
# request, on the event loop that also sends, and a sender that falls behind sends in bursts.
STEP_CLIENTS = 16
STEP_OVER_CAPACITY = 3.0
STEP_DURATION_S = 60.0
STEP_MAX_REQUESTS = 6000


def steady_trace(rate_per_s: float, duration_s: float, prompt_tokens: int, output_tokens: int) -> list[TraceRequest]:
    count = int(rate_per_s * duration_s)
    return [TraceRequest(i / rate_per_s, prompt_tokens, output_tokens) for i in range(count)]


@pytest.fixture
def runtimes(tmp_path: Path) -> Iterator[tuple[list[RuntimeProcess], int, int]]:
    serve_port = free_port_on_all(list(POD_IPS))
    admin_port = free_port_on_all(list(POD_IPS))
    started: list[RuntimeProcess] = []
    try:
        for ip in POD_IPS:
            started.append(
                start_runtime_process(
                    tmp_path / ip, "--host", ip, "--port", str(serve_port), "--admin-port", str(admin_port),
                    "--target-batch-size", "4", "--hard-cap", str(STARTUP_HARD_CAP), "--max-wait-ms", "5",
                    model_name=MODEL, token=TOKEN,
                )
            )  # fmt: skip
        yield started, serve_port, admin_port
    finally:
        for runtime in started:
            runtime.stop(timeout_s=20)


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[KubeCluster, str]]:
    async with running_cluster() as pair:
        yield pair


async def admin_window(runtime: RuntimeProcess) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.get(f"{runtime.admin_url}/admin/window", headers=runtime.auth_headers())
        response.raise_for_status()
        return dict(response.json()["window"])


async def measure_capacity(endpoints: list[Endpoint]) -> float:
    """Completed requests per second of both runtimes together on the step's request sizes: the best of
    ``CAPACITY_BURSTS`` closed bursts (the first one also warms the runtimes up)."""
    rates = []
    for _ in range(CAPACITY_BURSTS):
        burst = [TraceRequest(0.0, STEP_PROMPT_TOKENS, STEP_OUTPUT_TOKENS)] * BURST_REQUESTS
        summary = await run_load(endpoints, burst, fanout="round-robin", request_timeout_s=120)
        assert summary.outcomes["completed"] == BURST_REQUESTS, summary.outcomes
        rates.append(summary.throughput.completed_requests_per_s)
    return max(rates)


# The step's load generators run in a process of their own: on this test's event loop they would slow the
# emulated API server and the polling of its status, and so the counting of the operator's decisions.
STEP_LOAD_SCRIPT = """
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


def start_step(endpoints: list[Endpoint], rate_per_s: float, count: int, log_path: Path) -> subprocess.Popen[bytes]:
    """The load step, open loop, sent by ``STEP_CLIENTS`` load generators (see there) in a subprocess."""
    args = [MODEL, str(STEP_CLIENTS), repr(rate_per_s), str(count), str(STEP_PROMPT_TOKENS), str(STEP_OUTPUT_TOKENS)]
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-c", STEP_LOAD_SCRIPT, *args, *(e.url for e in endpoints)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def stop_step(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def status_of(cluster: KubeCluster) -> dict[str, Any]:
    return e2e.profile_status(cluster, "ml", "chat")


def cond(cluster: KubeCluster, type_: str) -> dict[str, Any]:
    return e2e.profile_condition(cluster, "ml", "chat", type_)


async def test_load_step_over_slo_lowers_the_window_and_everything_agrees(
    runtimes: tuple[list[RuntimeProcess], int, int], cluster: tuple[KubeCluster, str], tmp_path: Path
) -> None:
    processes, serve_port, admin_port = runtimes
    kube, url = cluster
    endpoints = [Endpoint(url=p.serve_url, model=MODEL) for p in processes]
    # 0. What these runtimes complete per second on this machine as it is now, measured before Prometheus
    #    scrapes them (the bursts are in no rate window the operator will read).
    capacity = await measure_capacity(endpoints)
    targets = [ScrapeTarget(f"{ip}:{serve_port}", {"namespace": "ml", "pod": f"chat-{i}"}) for i, ip in
               enumerate(POD_IPS)]  # fmt: skip
    prometheus = start_prometheus(tmp_path / "prometheus", targets, scrape_interval_s=1.0)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    api = httpx.AsyncClient(base_url=url, timeout=10)
    operator: OperatorProcess | None = None
    loads: list[asyncio.Task[Any]] = []
    heavy_load: subprocess.Popen[bytes] | None = None
    try:
        await wait_for(lambda: prometheus.targets_up(), 60, "Prometheus to scrape both runtimes")
        for i, ip in enumerate(POD_IPS):
            await e2e.add_ready_pod(api, "ml", f"chat-{i}", {"app": "chat"}, ip)
        operator = e2e.start_operator(
            tmp_path / "operator", url, prometheus.url, "--admin-token-file", str(token_file),
            "--admin-token-namespace", "ml", interval_s=INTERVAL_S,
        )  # fmt: skip
        spec = {
            "model": MODEL,
            "selector": {"matchLabels": {"app": "chat"}},
            "window": {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 20},
            "slo": {"latencyMetric": "ttft", "p99Ms": 60_000},
            "tuning": {"cooldownSeconds": 0, "maxStepFraction": 0.5},
            "runtime": {"adminPort": admin_port, "servePort": serve_port},
        }
        await e2e.add_profile(api, "ml", "chat", spec)

        # 1. Both runtimes get the profile's window.
        await wait_for(lambda: cond(kube, "Synced").get("status") == "True", 60, "both pods synced")
        for runtime in processes:
            assert (await admin_window(runtime))["hardCap"] == 16

        # 2. Light load: metrics flow, the SLO is set to 3x what this machine gives under it.
        light = steady_trace(8.0, 400.0, prompt_tokens=16, output_tokens=8)
        loads.append(asyncio.create_task(run_load(endpoints, light, fanout="round-robin", request_timeout_s=120)))
        await wait_for(lambda: cond(kube, "MetricsAvailable").get("status") == "True", 90, "metrics from Prometheus")
        light_p99_ms = await wait_for(lambda: status_of(kube).get("observed", {}).get("p99Ms"), 30, "a light P99")
        slo_ms = max(3.0 * light_p99_ms, 30.0)
        patch = {"spec": {"slo": {"p99Ms": round(slo_ms)}}}
        response = await api.patch("/apis/batchpilot.dev/v1alpha1/namespaces/ml/batchprofiles/chat", json=patch,
                                   headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
        assert response.status_code == 200
        await wait_for(lambda: cond(kube, "Synced").get("observedGeneration") == 2, 30, "generation 2 observed")
        window_before = status_of(kube)["window"]

        # 3. The load step: long requests at 3x the measured capacity. The window must go down within 3 intervals.
        step_rate = STEP_OVER_CAPACITY * capacity
        step_count = int(step_rate * min(STEP_DURATION_S, STEP_MAX_REQUESTS / step_rate))
        step = f"{step_count} requests at {step_rate:.1f}/s ({STEP_OVER_CAPACITY:g}x the capacity, {capacity:.1f}/s)"
        print(f"SLO {slo_ms:.0f} ms (light P99 {light_p99_ms:.1f} ms); {step}")
        heavy_load = start_step(endpoints, step_rate, step_count, tmp_path / "step.log")
        #    Intervals are counted in the operator's own decisions (one per interval), from the first
        #    interval whose observation has P99 over the SLO; the status carries both in one patch.
        await wait_for(lambda: status_of(kube).get("observed", {}).get("p99Ms", 0) > slo_ms, 120,
                       f"P99 over the SLO ({slo_ms:.0f} ms) under {step}")  # fmt: skip
        decisions_at_first_miss = await e2e.decisions_of(operator)

        def lowered() -> bool:
            # Lowered = a smaller target or a shorter wait than before the step (the policy may raise the
            # cap at the same time when the queue is long, and then calls the whole change "up").
            window = status_of(kube).get("window", {})
            return window.get("generation", 0) > window_before["generation"] and (
                window["targetBatchSize"] < window_before["targetBatchSize"]
                or window["maxWaitMs"] < window_before["maxWaitMs"]
            )

        await wait_for(lowered, 120, "a lowered window")
        decisions_at_down = await e2e.decisions_of(operator)
        # The first over-SLO interval counts as one: the lowering comes within it or the next two.
        assert decisions_at_down - decisions_at_first_miss <= 2, (decisions_at_first_miss, decisions_at_down)
        status = status_of(kube)
        print(f"lowered {decisions_at_down - decisions_at_first_miss:g} decisions after the first P99 over the SLO: "
              f"{window_before} -> {status['window']} ({status['lastDecision']['reason']})")  # fmt: skip
        assert status["lastDecision"]["reason"]
        assert status["observed"]["p99Ms"] > slo_ms
        assert cond(kube, "SLOMet")["status"] == "False"
        #    The step ends here (its requests are cancelled): what follows does not need it.
        stop_step(heavy_load)

        # 4. Status, Events and both runtimes agree on the window in force. The operator keeps deciding
        #    every interval (the light load goes on), so agreement is awaited between two pushes.
        async def agreed() -> dict[str, Any] | None:
            status = status_of(kube)
            if status.get("pods", {}).get("synced") != 2 or cond(kube, "Synced").get("status") != "True":
                return None
            in_force = {k: v for k, v in status["window"].items() if k != "appliedAt"}
            windows = [await admin_window(runtime) for runtime in processes]
            if all(window == in_force for window in windows) and status_of(kube)["window"] == status["window"]:
                return in_force
            return None

        in_force = await wait_for(agreed, 60, "status and both runtimes to agree on the window")
        messages = [e["message"] for e in kube.events_for("ml", "chat") if e["reason"].startswith("Decision")]
        assert any(e["reason"] in ("DecisionDown", "DecisionUp") for e in kube.events_for("ml", "chat"))
        described = f"gen={in_force['generation']}"
        await wait_for(
            lambda: any(described in e["message"] for e in kube.events_for("ml", "chat")), 10,
            f"an Event for the window in force ({described}) among {messages}",
        )  # fmt: skip
    finally:
        if heavy_load is not None:
            stop_step(heavy_load)
        for task in loads:
            task.cancel()
        for task in loads:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if operator is not None:
            operator.stop()
        prometheus.stop()
        await api.aclose()
