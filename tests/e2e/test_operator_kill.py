"""Kill the operator, a runtime and Prometheus in turn: nothing the policy learned is lost.

``batchpilot-operator run`` (kopf) against the test control plane (the session's real kube-apiserver and
etcd; signed in as its admin, watching one namespace of this test's own) and a real Prometheus, which scrapes
one emulated runtime pod at a loopback address (the Pod is created on the server and reported Ready through
its status subresource, as a hollow node does: tests/support/hollow.py). The pod runs a closed loop:
the load keeps ``DEMAND`` sequences in flight, the batch is ``min(cap, DEMAND)``, the
rest queues, and a batch over ``KV_SEQS`` (what its KV cache holds) preempts. So the
operator soon lowers the cap under ``KV_SEQS`` and keeps a memory ceiling there; a
successor that forgot it would raise the cap straight back (the queue asks for it)
into preemption. Then, in turn:

1. the operator is SIGKILLed and a new one started: the ceiling, the cooldown and the
   window come back from status; within two of the new operator's intervals status
   and pod agree on the window in force, and the pod never runs a cap over the ceiling;
2. the runtime restarts (its start-up window, generation 0, counters from zero): the
   window in force is pushed again within two intervals, the ceiling unchanged;
3. Prometheus is SIGKILLed: the operator holds (MetricsAvailable=False, nothing moves)
   and, once Prometheus is back on the same port and has data, observes again within
   two intervals, with the same memory.

The operator's memory (``status.policy``) is written to and read back from the real server, so it survives
only what the CRD's status schema keeps: a field the schema lacked would be pruned, and the successor would
start without it.

Intervals are counted in the operator's own decisions (``batchpilot_operator_decisions_total``),
never in seconds, so a slow machine only makes the test longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchpilot_operator import API_VERSION, PLURAL
from batchpilot_runtime.contract import metric_names as rm
from batchpilot_runtime.contract.window import Window
from tests.integration.fake_admin import ROOT_POD, FakeAdminServer, FakePod
from tests.integration.prometheus_process import PrometheusProcess, ScrapeTarget, start_prometheus
from tests.support import operator_e2e as e2e
from tests.support.control_plane import ControlPlane
from tests.support.factories import make_manifest
from tests.support.hollow import free_loopback_ip, set_pod_status
from tests.support.operator_process import OperatorProcess, free_port, wait_for

pytestmark = [pytest.mark.e2e, *e2e.marks(timeout_s=300)]

MODEL = "chat"
KV_SEQS = 40
DEMAND = 48
REQUESTS_PER_S = 20.0
STARTUP_WINDOW = Window(target_batch_size=4, hard_cap=8, max_wait_ms=10, generation=0)


class ClosedLoopRuntime:
    """The emulated pod's ``/metrics``, advanced every 50 ms from the cap it runs (see the module docstring)."""

    def __init__(self, pod: FakePod) -> None:
        self.pod = pod
        self.samples: list[tuple[float, int]] = []  # (monotonic time, cap run then)
        self._zero()

    def _zero(self) -> None:
        self.requests = self.preemptions = self.batch_sum = self.batch_count = 0.0
        self.step_sum: dict[str, float] = {}
        self.step_count: dict[str, float] = {}

    def restart(self) -> None:
        """A restarted runtime: its start-up window at generation 0, every counter from zero."""
        self.pod.state = self.pod.state.model_copy(update={"window": STARTUP_WINDOW, "lanes": []})
        self._zero()

    def preempted_since(self, since_s: float) -> list[int]:
        return [cap for at, cap in self.samples if at >= since_s and min(cap, DEMAND) > KV_SEQS]

    def _advance(self, dt_s: float) -> None:
        cap = self.pod.state.window.hard_cap
        self.samples.append((time.monotonic(), cap))
        running = min(cap, DEMAND)
        steps = REQUESTS_PER_S * dt_s
        self.requests += steps
        self.batch_sum += running * steps
        self.batch_count += steps
        bucket = rm.batch_bucket(running)
        self.step_sum[bucket] = self.step_sum.get(bucket, 0.0) + (0.02 + 0.0005 * running) * steps
        self.step_count[bucket] = self.step_count.get(bucket, 0.0) + steps
        if running > KV_SEQS:
            self.preemptions += 5.0 * dt_s
        self.pod.metrics_text = self._render(running)

    def _render(self, running: int) -> str:
        m = f'model="{MODEL}"'
        lines = [f"# TYPE {rm.TTFT_SECONDS} histogram"]
        for bound in (0.05, 0.1, 0.2, 0.5):
            count = self.requests if bound >= 0.1 else 0.0  # every first token after 0.1 s: far under the SLO
            lines.append(f'{rm.TTFT_SECONDS}_bucket{{{m},lane="default",le="{bound}"}} {count}')
        lines += [
            f'{rm.TTFT_SECONDS}_bucket{{{m},lane="default",le="+Inf"}} {self.requests}',
            f'{rm.TTFT_SECONDS}_sum{{{m},lane="default"}} {self.requests * 0.1}',
            f'{rm.TTFT_SECONDS}_count{{{m},lane="default"}} {self.requests}',
            f"# TYPE {rm.REQUESTS_TOTAL} counter",
            f'{rm.REQUESTS_TOTAL}{{{m},outcome="completed"}} {self.requests}',
            f"# TYPE {rm.PREEMPTIONS_TOTAL} counter",
            f"{rm.PREEMPTIONS_TOTAL}{{{m}}} {self.preemptions}",
            f"# TYPE {rm.BATCH_SIZE} histogram",
            f'{rm.BATCH_SIZE}_bucket{{{m},phase="decode",le="+Inf"}} {self.batch_count}',
            f'{rm.BATCH_SIZE}_sum{{{m},phase="decode"}} {self.batch_sum}',
            f'{rm.BATCH_SIZE}_count{{{m},phase="decode"}} {self.batch_count}',
            f"# TYPE {rm.STEP_SECONDS} histogram",
        ]
        for bucket, count in self.step_count.items():
            labels = f'{m},phase="decode",batch_bucket="{bucket}"'
            lines += [
                f'{rm.STEP_SECONDS}_bucket{{{labels},le="+Inf"}} {count}',
                f"{rm.STEP_SECONDS}_sum{{{labels}}} {self.step_sum[bucket]}",
                f"{rm.STEP_SECONDS}_count{{{labels}}} {count}",
            ]
        lines += [
            f"# TYPE {rm.QUEUE_DEPTH} gauge",
            f"{rm.QUEUE_DEPTH}{{{m}}} {DEMAND - running}",
            f"# TYPE {rm.RUNNING_SEQUENCES} gauge",
            f"{rm.RUNNING_SEQUENCES}{{{m}}} {running}",
        ]
        return "\n".join(lines) + "\n"

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            self._advance(now - last)
            last = now


class Env:
    def __init__(
        self, plane: ControlPlane, api: httpx.AsyncClient, namespace: str, runtime: ClosedLoopRuntime, ip: str,
        port: int, workdir: Path,
    ) -> None:  # fmt: skip
        self.plane, self.api, self.namespace, self.runtime = plane, api, namespace, runtime
        self.ip, self.port, self.workdir = ip, port, workdir
        self.prometheus: PrometheusProcess | None = None
        self.operators: list[OperatorProcess] = []

    def start_operator(self) -> OperatorProcess:
        """The operator as the admin, on this test's namespace only (other tests' profiles are not its own),
        reading Prometheus (scraped every second), one interval a second, ticking every 0.25 s, no peering."""
        assert self.prometheus is not None
        name = f"operator-{len(self.operators)}"
        operator = OperatorProcess(
            self.workdir / name, self.plane.kubeconfig, "--namespace", self.namespace,
            "--prometheus-url", self.prometheus.url, "--scrape-interval", "1", "--interval-override", "1",
            "--tick", "0.25", "--peering", "off", name=name,
        )  # fmt: skip
        self.operators.append(operator)
        return operator

    async def status(self) -> dict[str, Any]:
        """The profile's status as the API server holds it (empty before the operator writes one)."""
        response = await self.api.get(f"/apis/{API_VERSION}/namespaces/{self.namespace}/{PLURAL}/{MODEL}")
        response.raise_for_status()
        return dict(response.json().get("status") or {})

    async def condition(self, type_: str) -> dict[str, Any]:
        conditions = (await self.status()).get("conditions", [])
        return next((dict(c) for c in conditions if c["type"] == type_), {})

    async def in_force(self) -> dict[str, Any]:
        return {k: v for k, v in (await self.status()).get("window", {}).items() if k != "appliedAt"}

    def pod_window(self) -> dict[str, Any]:
        return dict(self.runtime.pod.state.window.model_dump(by_alias=True))

    async def agree(self) -> bool:
        return await self.in_force() == self.pod_window()

    async def decisions(self, operator: OperatorProcess) -> float:
        return e2e.decisions_total(await operator.metrics_text())

    async def wait_decisions(self, operator: OperatorProcess, count: float, what: str) -> None:
        async def reached() -> bool:
            return await self.decisions(operator) >= count

        await wait_for(reached, 90, f"{count:g} decisions of {what}", interval_s=0.2)

    async def wait_condition(self, type_: str, status: str) -> None:
        async def reached() -> bool:
            return (await self.condition(type_)).get("status") == status

        await wait_for(reached, 60, f"{type_}={status}", interval_s=0.2)


def add_ready_pod(plane: ControlPlane, namespace: str, name: str, labels: dict[str, str], ip: str) -> None:
    """A Pod of the runtime, created on the server and reported Ready at ``ip`` (no kubelet runs it)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels},
           "spec": {"containers": [{"name": "runtime", "image": "batchpilot-runtime"}]}}  # fmt: skip
    plane.apply(pod)
    set_pod_status(plane, namespace, name, ip, ready=True)


@pytest.fixture
async def env(control_plane: ControlPlane, tmp_path: Path) -> AsyncIterator[Env]:
    control_plane.install_crd()
    namespace = control_plane.namespace("bp-kill")
    port = free_port()
    ip = free_loopback_ip([port])
    fake = FakeAdminServer(0)
    pod = fake.add_pod(ROOT_POD, model=MODEL, token=None, max_hard_cap=512)
    runtime = ClosedLoopRuntime(pod)
    loop_task = asyncio.create_task(runtime.run())
    await fake.start(port, host=ip)
    async with control_plane.async_client() as api:
        environment = Env(control_plane, api, namespace, runtime, ip, port, tmp_path)
        try:
            yield environment
        finally:
            for operator in environment.operators:
                operator.stop()
            if environment.prometheus is not None:
                environment.prometheus.stop()
            # The session's later operators watch every namespace: leave them no profile with a Ready pod.
            control_plane.kubectl("delete", "batchprofile", MODEL, "-n", namespace, "--ignore-not-found")
            control_plane.kubectl("delete", "pod", "chat-0", "-n", namespace, "--ignore-not-found")
    loop_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loop_task
    await fake.stop()


def answers(prometheus: PrometheusProcess | None, query: str) -> bool:
    """Whether this Prometheus is up and has a result for the query (False while it starts)."""
    try:
        return prometheus is not None and bool(prometheus.query(query))
    except OSError:
        return False


def restart_prometheus(old: PrometheusProcess) -> PrometheusProcess:
    """The same Prometheus again: same flags, so the same port and the same data directory."""
    log = old.log_path.open("ab")
    process = subprocess.Popen(old.process.args, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return PrometheusProcess(process, old.url, old.log_path)


async def start_prometheus_operator_and_profile(env: Env) -> OperatorProcess:
    """Prometheus scraping the pod every second, the Ready pod, the first operator, and the profile (cap 64)."""
    env.prometheus = start_prometheus(
        env.workdir / "prometheus",
        [ScrapeTarget(f"{env.ip}:{env.port}", {"namespace": env.namespace, "pod": "chat-0"})],
        scrape_interval_s=1.0,
    )
    await wait_for(lambda: env.prometheus and env.prometheus.targets_up(), 60, "Prometheus to scrape the pod")
    add_ready_pod(env.plane, env.namespace, "chat-0", {"app": MODEL}, env.ip)
    first = env.start_operator()
    spec = {
        "model": MODEL,
        "selector": {"matchLabels": {"app": MODEL}},
        "batchFriendliness": "high",
        "window": {"targetBatchSize": 8, "hardCap": 64, "maxWaitMs": 40},
        "slo": {"p99Ms": 500},
        # The cooldown outlasts the 4 s rate window, so that one cut is not followed by more for the
        # preemptions still inside that window.
        "tuning": {"cooldownSeconds": 5},
        "runtime": {"adminPort": env.port, "servePort": env.port},
    }
    env.plane.apply(make_manifest(spec, name=MODEL, namespace=env.namespace))
    return first


async def wait_for_the_memory_ceiling(env: Env) -> None:
    """The pod runs cap 64, preempts, and the operator lowers the cap under what the KV cache holds."""

    async def learned() -> dict[str, Any] | None:
        policy = (await env.status()).get("policy") or {}
        ceiling = policy.get("kvCapCeiling")
        if ceiling is not None and ceiling <= KV_SEQS and env.pod_window()["hardCap"] <= ceiling:
            return dict(policy)
        return None

    await wait_for(learned, 120, "the memory ceiling under the KV limit", interval_s=0.2)
    await wait_for(env.agree, 30, "status and pod to agree", interval_s=0.2)


async def assert_a_successor_keeps_the_memory(env: Env, first: OperatorProcess) -> tuple[OperatorProcess, int]:
    """SIGKILLs the operator (at whatever point of its loop it is) and starts another; what it learned is on the
    server only, in the status the server kept. Returns the successor and the ceiling it kept."""
    first.kill()
    before = await env.status()
    ceiling: int = before["policy"]["kvCapCeiling"]
    restarted_s = time.monotonic()
    second = env.start_operator()
    await env.wait_decisions(second, 1, "the new operator")
    # Within two of its intervals: the memory is the one the first operator left (the ceiling
    # cannot have lifted: that takes 20 calm intervals), and status and pod agree.
    await env.wait_decisions(second, 2, "the new operator")
    after = await env.status()
    assert after["policy"]["kvCapCeiling"] == ceiling, (before["policy"], after["policy"])
    assert after["policy"]["lastChangeTime"] >= before["policy"]["lastChangeTime"]
    assert after["window"]["generation"] >= before["window"]["generation"]  # continued, not reset
    assert await env.agree() and env.pod_window()["hardCap"] <= ceiling
    await env.wait_decisions(second, 5, "the new operator")
    assert env.runtime.preempted_since(restarted_s) == [], "the cap climbed back into preemption"
    assert (await env.status())["policy"]["kvCapCeiling"] == ceiling
    return second, ceiling


async def assert_a_restarted_runtime_gets_the_window_back(env: Env, operator: OperatorProcess, ceiling: int) -> None:
    """The runtime restarts: start-up window, generation 0. The window in force comes back within two
    intervals (level-triggered: the readback of every interval sees generation 0)."""
    in_force = await env.in_force()
    at_restart = await env.decisions(operator)
    env.runtime.restart()
    await wait_for(env.agree, 30, "the window in force on the restarted pod", interval_s=0.2)
    assert await env.decisions(operator) - at_restart <= 2
    assert env.pod_window()["hardCap"] == in_force["hardCap"] <= ceiling
    assert (await env.status())["policy"]["kvCapCeiling"] == ceiling


async def assert_the_operator_holds_without_prometheus_and_resumes(
    env: Env, operator: OperatorProcess, ceiling: int
) -> None:
    """Prometheus dies: the operator holds and says so; nothing it learned moves. Prometheus comes back on the
    same port with the same data: counted from its first answer for the pod's requests again, the operator
    observes within two intervals."""
    assert env.prometheus is not None
    env.prometheus.process.kill()
    env.prometheus.process.wait()
    await env.wait_condition("MetricsAvailable", "False")
    held = await env.status()
    at_outage = await env.decisions(operator)
    await env.wait_decisions(operator, at_outage + 3, "the operator without Prometheus")
    now = await env.status()
    assert now["window"] == held["window"] and now["policy"] == held["policy"]
    assert now["policy"]["kvCapCeiling"] == ceiling
    env.prometheus = restart_prometheus(env.prometheus)
    query = f"sum by (namespace, model) (rate({rm.REQUESTS_TOTAL}[4s]))"
    await wait_for(lambda: answers(env.prometheus, query), 60, "Prometheus to have rates again")
    at_data = await env.decisions(operator)
    await env.wait_condition("MetricsAvailable", "True")
    assert await env.decisions(operator) - at_data <= 2
    assert (await env.status())["policy"]["kvCapCeiling"] == ceiling


async def test_operator_runtime_and_prometheus_killed_in_turn_lose_nothing(env: Env) -> None:
    first = await start_prometheus_operator_and_profile(env)
    # 0. The operator learns a memory ceiling.
    await wait_for_the_memory_ceiling(env)
    # 1. The operator is killed; its successor keeps the memory.
    second, ceiling = await assert_a_successor_keeps_the_memory(env, first)
    # 2. The runtime restarts.
    await assert_a_restarted_runtime_gets_the_window_back(env, second, ceiling)
    # 3. Prometheus dies and comes back.
    await assert_the_operator_holds_without_prometheus_and_resumes(env, second, ceiling)
    assert second.process.poll() is None, second.log_text()[-3000:]
    assert "policy memory in status not used" not in second.log_text()
