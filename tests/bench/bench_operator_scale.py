"""Scale benchmark of the operator's loop: 1,000 BatchProfiles, 4,000 pod endpoints, one 15 s interval.

One helper process (``tests/integration/fake_admin.py``) serves all 4,000 emulated
admin endpoints and answers the operator's PromQL for 1,000 models with full-size
histograms (half of them over their SLO, so half of the windows change). This
process runs the operator's real Controller, PrometheusSource and AdminClient; the
Kubernetes API is replaced by an in-memory status store (its cost is not measured).

Two intervals are run back to back on a virtual interval clock:
1. the first interval pushes every profile's starting window to its 4 pods;
2. the second decides every profile (half go down) and pushes the changed windows.
Checked per interval: Prometheus queries <= 8, every profile evaluated, every
changed window in force on all its pods, tick time < 15 s. Reported: tick times,
queries, pushes, peak RSS of this process.

    .venv/bin/python -m tests.bench.bench_operator_scale [--profiles 1000] [--pods-per-profile 4] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from batchpilot_operator.control.controller import Controller, PodRecord, ProfileRef, Settings
from batchpilot_operator.control.status import apply_merge_patch
from batchpilot_operator.io.promql import PrometheusSource
from batchpilot_operator.io.push import AdminClient, AiohttpTransport

INTERVAL_S = 15.0


class MemorySink:
    def __init__(self) -> None:
        self.status: dict[str, dict[str, Any]] = {}
        self.patches = 0
        self.events = 0

    async def patch_status(self, ref: ProfileRef, patch: Mapping[str, Any]) -> None:
        self.patches += 1
        self.status[ref.key] = apply_merge_patch(self.status.get(ref.key), patch)

    async def event(self, ref: ProfileRef, type_: str, reason: str, message: str) -> None:
        self.events += 1

    async def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        return None


def start_helper(pods: int, models: int, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file = workdir / "helper.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.fake_admin", "--pods", str(pods), "--port-file", str(port_file),
         "--prometheus-models", str(models)],
        stdout=subprocess.DEVNULL, stderr=(workdir / "helper.log").open("wb"),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"helper did not start: {(workdir / 'helper.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return process, str(json.loads(port_file.read_text())["url"])


def make_spec(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "selector": {"matchLabels": {"model": model}},
        "window": {"targetBatchSize": 16, "hardCap": 32, "maxWaitMs": 20},
        "slo": {"latencyMetric": "ttft", "p99Ms": 500},
        "tuning": {"cooldownSeconds": 0, "intervalSeconds": int(INTERVAL_S)},
    }


async def pods_in_force(url: str, pods: int, generations: dict[int, int]) -> int:
    """How many emulated pods run the generation their profile has in force (read over HTTP)."""
    transport = AiohttpTransport(limit=64)
    async with httpx.AsyncClient(timeout=10, transport=transport, headers={"Authorization": "Bearer secret"}) as client:
        semaphore = asyncio.Semaphore(64)

        async def check(i: int) -> bool:
            async with semaphore:
                response = await client.get(f"{url}/pods/{i}/admin/window")
            return bool(response.json()["window"]["generation"] == generations[i])

        return sum(await asyncio.gather(*(check(i) for i in range(pods))))


async def run(profiles: int, pods_per_profile: int) -> dict[str, Any]:
    pods = profiles * pods_per_profile
    workdir = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    helper, url = start_helper(pods, profiles, workdir)
    clock = {"now": 1_000_000.0}
    try:
        source = PrometheusSource(url, scrape_interval_s=15, interval_s=INTERVAL_S, timeout_s=14)
        admin = AdminClient(timeout_s=5, retries=3, concurrency=64)
        sink = MemorySink()
        controller = Controller(
            Settings(
                interval_override_s=INTERVAL_S, default_token="secret", default_token_namespaces=frozenset({"bench"})
            ),
            source,
            admin,
            sink,
            wall_clock=lambda: clock["now"],
            monotonic=lambda: clock["now"],
        )
        for p in range(profiles):
            model = f"m{p}"
            for k in range(pods_per_profile):
                index = p * pods_per_profile + k
                controller.upsert_pod(PodRecord("bench", f"{model}-{k}", {"model": model}, ready=True,
                                                admin_url=f"{url}/pods/{index}", uid=str(index)))  # fmt: skip
            controller.upsert_profile("bench", f"profile-{p}", make_spec(model), generation=1)

        intervals = []
        for label in ("first interval (initial pushes)", "second interval (decisions, changed windows)"):
            clock["now"] += INTERVAL_S
            queries_before = (await asyncio.to_thread(httpx.get, f"{url}/stats")).json()["queries"]
            started = time.perf_counter()
            report = await controller.tick()
            tick_s = time.perf_counter() - started
            queries = (await asyncio.to_thread(httpx.get, f"{url}/stats")).json()["queries"] - queries_before
            generations = {
                p * pods_per_profile + k: controller.profiles[f"bench/profile-{p}"].window.generation  # type: ignore[union-attr]
                for p in range(profiles)
                for k in range(pods_per_profile)
            }
            synced = await pods_in_force(url, pods, generations)
            intervals.append(
                {
                    "interval": label,
                    "tick_s": round(tick_s, 3),
                    "prometheus_queries": queries,
                    "profiles_evaluated": report.evaluated,
                    "windows_changed": report.changed,
                    "pushes": report.pushes,
                    "push_failures": report.push_failures,
                    "status_patches": report.status_patches,
                    "pods_with_window_in_force": synced,
                }
            )
            print(json.dumps(intervals[-1]), flush=True)
        await controller.drain_events()
        await admin.aclose()
        source.close()
    finally:
        helper.terminate()
        helper.wait(timeout=30)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    checks = {
        "queries_per_interval_le_8": all(i["prometheus_queries"] <= 8 for i in intervals),
        "every_profile_evaluated": intervals[-1]["profiles_evaluated"] == profiles,
        "every_changed_window_pushed": all(i["pods_with_window_in_force"] == pods for i in intervals),
        "within_one_interval": all(i["tick_s"] < INTERVAL_S for i in intervals),
    }
    return {
        "profiles": profiles,
        "pod_endpoints": pods,
        "interval_s": INTERVAL_S,
        "intervals": intervals,
        "peak_rss_mib": round(peak_rss_mib, 1),
        "checks": checks,
        "passed": all(checks.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", type=int, default=1000)
    parser.add_argument("--pods-per-profile", type=int, default=4)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    result = asyncio.run(run(args.profiles, args.pods_per_profile))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
