"""SLO capacity (issue 12): the load each policy serves within a TTFT P99 and an inter-token P99 at once.

Headline: for each replay and SLO pair, the largest arrival-rate multiplier (bisection to 0.01,
0.02 with ``--quick``) at which a policy keeps both P99s within the SLO over the whole replay
(``batchpilot_operator.sim.slo``). Every replay runs through the runtime's real scheduler on the
A100 Llama-2-7B step costs (``a100-llama2-7b``).

Policies:

- ``adaptive``: the tuning policy, starting from the profile's window;
- ``starting_window``: the profile's window held static (target 16, cap 64, wait 20 ms, budget 512:
  the chat window of the project's examples);
- ``engine_defaults``: vLLM's defaults for this GPU held static, target 1 and no wait (vLLM admits
  whenever a slot is free): ``max_num_seqs`` 256 and ``max_num_batched_tokens`` 2048 on an A100
  behind the OpenAI API server (``vllm/engine/arg_utils.py``, ``EngineArgs.get_batch_defaults``:
  GPUs of 70 GiB or more other than the A100, H100-class, get 1024 and 8192; "setting large
  max_num_batched_tokens for A100 reduces throughput", vLLM PR #17885);
- ``best_static``: the best window in hindsight, searched over cap x budget (wait 0: under continuous
  batching a wait only delays an admission into a step that runs anyway, see docs/policy.md)
  at this cell's own capacity;
- ``tuned_elsewhere``: the best static window of another replay applied here (a window tuned on
  one day and kept on another): on each ServeGen day the other day's (another day of the same
  model), on the Azure replay the drifting day's (another trace);
- ``per_step_itl``: the other form the budget could take: each step prefills what fits in 95 % of
  the inter-token target after its decodes (unlimited when nothing decodes), cap 256, no wait.
  It reads the step costs from the cost model itself, an oracle a live engine would have to
  learn online: a reference for the token-form budget ``adaptive`` tunes, not a deployable policy.

Replays: the shared Azure conversation trace (first 30 minutes; 10 with ``--quick``), and two days
compressed from the shared ServeGen data (m-large; the same number of minutes taken from the middle
of each of a day's four 6-hour windows, at the Azure replay's mean rate): the day whose prompt
lengths drift most (its prompt P50 moves about 8x over the replay) and the day whose prompt lengths
drift least (without ``--quick``), the day a window could have been tuned on before the drift. Also
a step-cost change: the Azure replay with every step 1.5x as long from its midpoint (a heavier
model version at the same batch), run under ``adaptive`` at 90 % of its post-change capacity,
reporting how many intervals both tails take to come back under the SLO. ``--adaptive-only`` runs
only what observes (adaptive, the step-cost change, steady load): the static windows are judged on
exact latencies, so a change to the policy or to what it observes leaves their columns as they were.
``--above-edge K`` also runs the K loads just above each capacity found: the bisection assumes that
more load never helps, and a load above the edge that meets the SLO shows a cell where it did.

Usage::

    .venv/bin/python tests/bench/bench_slo.py --quick --json slo.json --plot slo.png
    .venv/bin/python tests/bench/bench_slo.py --json slo.json --plot slo.png
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpilot_operator.cli.simulate import json_safe
from batchpilot_operator.sim.slo import (
    DualSLO,
    Outcome,
    bisect_capacity,
    dual_slo_spec,
    evaluate,
    scaled_cost,
)
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import A100_LLAMA2_7B, CostModel
from batchpilot_runtime.replay.trace import DEFAULT_TRACE_PATH, TraceRequest, read_trace

SLO_PAIRS = (DualSLO(1.0, 0.100), DualSLO(2.0, 0.050), DualSLO(0.5, 0.200))
ENGINE_DEFAULTS = Window(target_batch_size=1, hard_cap=256, max_wait_ms=0, max_prefill_tokens=2048)
STARTING_WINDOW = Window(target_batch_size=16, hard_cap=64, max_wait_ms=20, max_prefill_tokens=512)
QUICK_BUDGETS = (256, 512, 1024, 2048, 4096, None)
FULL_BUDGETS = (256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192, None)
QUICK_CAPS = (256,)
FULL_CAPS = (64, 128, 256)
FULL_WAITS = (0,)
PER_STEP_WINDOW = Window(target_batch_size=1, hard_cap=256, max_wait_ms=0)
PER_STEP_FRACTION = 0.95
STEP_COST_FACTOR = 1.5
RECOVERY_RUN = 4
# Where each replay's tuned_elsewhere window comes from: the first of these replays that ran.
ELSEWHERE = {
    "azure": ("servegen_drift",),
    "servegen_drift": ("servegen_steady", "azure"),
    "servegen_steady": ("servegen_drift",),
}


def grid(quick: bool) -> list[Window]:
    caps, budgets, waits = (QUICK_CAPS, QUICK_BUDGETS, (0,)) if quick else (FULL_CAPS, FULL_BUDGETS, FULL_WAITS)
    return [
        Window(target_batch_size=1, hard_cap=cap, max_wait_ms=wait, max_prefill_tokens=budget)
        for cap in caps
        for budget in budgets
        for wait in waits
    ]


@dataclass(frozen=True)
class Job:
    replay: str
    slo: DualSLO
    policy: str
    window: Window | None  # the static window, or the adaptive policy's start
    requests: tuple[TraceRequest, ...]
    cost: CostModel
    tolerance: float
    candidates: tuple[Window, ...] = ()  # best_static: the grid
    above_edge: int = 0  # loads above the capacity found to run as well (--above-edge)

    @property
    def step_itl_s(self) -> float | None:
        return PER_STEP_FRACTION * self.slo.itl_p99_s if self.policy == "per_step_itl" else None


def _meets(job: Job, window: Window, adaptive: bool, multiplier: float) -> bool:
    spec = dual_slo_spec(job.slo, window) if adaptive else None
    outcome, _ = evaluate(job.requests, multiplier, job.slo, job.cost, window, spec, step_budget_itl_s=job.step_itl_s)
    return outcome.meets


def _at(job: Job, window: Window, adaptive: bool, multiplier: float) -> Outcome:
    spec = dual_slo_spec(job.slo, window) if adaptive else None
    outcome, _ = evaluate(
        job.requests,
        max(multiplier, 0.02),
        job.slo,
        job.cost,
        window,
        spec,
        stop_early=False,
        step_budget_itl_s=job.step_itl_s,
    )
    return outcome


def run_job(job: Job) -> dict[str, Any]:
    began = time.perf_counter()
    if job.policy == "best_static":
        # Pruned search: a window is bisected only when it meets the SLO just above the best so far.
        best_window, best_capacity = job.candidates[0], -1.0
        for window in job.candidates:
            probe = best_capacity + job.tolerance
            if best_capacity >= 0 and not _meets(job, window, False, probe):
                continue
            lo = max(0.02, probe) if best_capacity >= 0 else 0.02
            capacity = bisect_capacity(lambda m, w=window: _meets(job, w, False, m), lo=lo, tolerance=job.tolerance)
            if capacity > best_capacity:
                best_window, best_capacity = window, capacity
        window, capacity, adaptive = best_window, max(best_capacity, 0.0), False
    else:
        assert job.window is not None
        window, adaptive = job.window, job.policy.startswith("adaptive")  # adaptive_auto: from a derived window
        capacity = bisect_capacity(lambda m: _meets(job, window, adaptive, m), tolerance=job.tolerance)
    outcome = _at(job, window, adaptive, capacity)
    # The bisection assumes more load never helps; the loads just above its edge show where that fails.
    above = [round(capacity + k * job.tolerance, 6) for k in range(1, job.above_edge + 1)]
    result_above = [{"multiplier": m, "meets": _meets(job, window, adaptive, m)} for m in above if m <= 1.5]
    return {
        "replay": job.replay,
        "slo": job.slo.label(),
        "policy": job.policy,
        "capacity": capacity,
        "window": window.model_dump(by_alias=True, mode="json"),
        "at_capacity": {
            "ttft_p99_s": outcome.ttft_p99_s,
            "itl_p99_s": outcome.itl_p99_s,
            "goodput_requests_per_s": outcome.goodput_requests_per_s,
            "slo_attainment": outcome.slo_attainment,
            "decisions": outcome.decisions,
            "rejected": outcome.rejected,
            "unfinished": outcome.unfinished,
            "decisions_per_hour": outcome.decisions / (job.requests[-1].arrival_s / max(capacity, 0.02) / 3600.0),
            "final_window": outcome.final_window.model_dump(by_alias=True, mode="json"),
        },
        "above_edge": result_above,
        "wall_s": time.perf_counter() - began,
    }


def servegen_day(
    minutes: float, mean_rate_per_s: float, seed: int = 0, *, steady: bool = False
) -> tuple[list[TraceRequest], dict[str, Any]]:
    """A day of m-large, compressed: ``minutes / 4`` from the middle of each 6-hour window; the day
    whose prompt lengths drift most, or least with ``steady``."""
    from batchpilot_runtime.replay import servegen

    data = servegen.load_servegen("m-large")
    day = servegen.steadiest_day(data) if steady else servegen.drifting_day(data)
    piece_s = minutes * 60.0 / 4
    requests: list[TraceRequest] = []
    p50s = []
    for quarter in range(4):
        start_s = quarter * 6 * 3600.0 + 3 * 3600.0
        part = servegen.generate_replay(
            data,
            day,
            start_s=start_s,
            duration_s=piece_s,
            seed=seed + quarter,
            target_mean_rate_per_s=mean_rate_per_s,
        ).requests
        offset = quarter * piece_s
        requests.extend(TraceRequest(r.arrival_s + offset, r.prompt_tokens, r.output_tokens) for r in part)
        p50s.append(statistics.median(r.prompt_tokens for r in part) if part else math.nan)
    requests.sort(key=lambda r: r.arrival_s)
    info = {"model": "m-large", "day": day, "minutes": minutes, "prompt_p50_per_quarter": p50s}
    return requests, info


def azure(minutes: float, path: Path) -> list[TraceRequest]:
    return [r for r in read_trace(path) if r.arrival_s < minutes * 60.0]


def step_cost_change(requests: list[TraceRequest], slo: DualSLO, cost: CostModel, tolerance: float) -> dict[str, Any]:
    """Adaptive under a x1.5 step cost from the replay's midpoint, at 90 % of the capacity it has then."""
    heavier = scaled_cost(cost, STEP_COST_FACTOR)
    change_at_s = requests[-1].arrival_s / 2

    def meets(m: float) -> bool:
        spec = dual_slo_spec(slo, STARTING_WINDOW)
        outcome, _ = evaluate(requests, m, slo, cost, STARTING_WINDOW, spec, cost_change=(change_at_s, heavier))
        return outcome.meets

    capacity = bisect_capacity(meets, tolerance=tolerance)
    multiplier = max(0.02, round(0.9 * capacity, 3))
    spec = dual_slo_spec(slo, STARTING_WINDOW)
    outcome, result = evaluate(
        requests, multiplier, slo, cost, STARTING_WINDOW, spec, cost_change=(change_at_s, heavier), stop_early=False
    )
    change_sim_s = change_at_s / multiplier

    def over(p: Any) -> bool:
        return bool(p.p99_s > slo.ttft_p99_s or p.itl_p99_s > slo.itl_p99_s)

    before = [p for p in result.timeline if p.t_s <= change_sim_s]
    after = [p for p in result.timeline if p.t_s > change_sim_s]
    # Recovered: the first interval that starts RECOVERY_RUN intervals in a row with both observed tails
    # under the SLO (per-interval P99s over a 30 s window are noisy at the edge of capacity even in
    # steady load: the share over before the change says how noisy).
    recovered_at = next(
        (i for i in range(len(after)) if not any(over(p) for p in after[i : i + RECOVERY_RUN])), len(after)
    )
    return {
        "factor": STEP_COST_FACTOR,
        "capacity_with_change": capacity,
        "multiplier": multiplier,
        "intervals_to_recover": recovered_at,
        "recovery_run_intervals": RECOVERY_RUN,
        "share_of_intervals_over_before_change": sum(map(over, before)) / max(1, len(before)),
        "share_of_intervals_over_after_recovery": sum(map(over, after[recovered_at:]))
        / max(1, len(after) - recovered_at),
        "whole_replay": outcome.to_json(),
    }


def steady_decisions(requests: list[TraceRequest], slo: DualSLO, cost: CostModel, capacity: float) -> dict[str, Any]:
    """Decisions per hour of ``adaptive`` under steady load: Poisson arrivals at 80 % of its capacity
    (in the replay's mean rate), token counts drawn from the replay, as long as the replay."""
    rng = random.Random(0)
    span_s = requests[-1].arrival_s
    rate = 0.8 * max(capacity, 0.02) * len(requests) / span_s
    steady: list[TraceRequest] = []
    t = rng.expovariate(rate)
    while t < span_s / (0.8 * max(capacity, 0.02)):
        source = requests[rng.randrange(len(requests))]
        steady.append(TraceRequest(t, source.prompt_tokens, source.output_tokens))
        t += rng.expovariate(rate)
    spec = dual_slo_spec(slo, STARTING_WINDOW)
    outcome, result = evaluate(steady, 1.0, slo, cost, STARTING_WINDOW, spec, stop_early=False)
    hours = result.trace_span_s / 3600.0
    # The first ten minutes are the policy finding its way from the starting window.
    settled = [p for p in result.timeline if p.t_s >= 600.0 and p.changed]
    settled_hours = max(1e-9, (result.trace_span_s - 600.0) / 3600.0)
    return {
        "rate_per_s": rate,
        "requests": len(steady),
        "decisions_per_hour": outcome.decisions / hours,
        "decisions_per_hour_after_10_min": len(settled) / settled_hours,
        "meets": outcome.meets,
        "ttft_p99_s": outcome.ttft_p99_s,
        "itl_p99_s": outcome.itl_p99_s,
    }


@dataclass(frozen=True)
class Settings:
    """What the command line asks for, checked: the SLO pairs, the replay length and the bisection's step."""

    args: argparse.Namespace
    slos: tuple[DualSLO, ...]
    minutes: float
    tolerance: float


def _parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE_PATH, help="Azure-format trace CSV")
    parser.add_argument("--slo-ttft-ms", type=float, help="one SLO pair instead of the three (with --slo-itl-ms)")
    parser.add_argument("--slo-itl-ms", type=float)
    parser.add_argument("--quick", action="store_true", help="10-minute replays, a coarser grid (under 5 minutes)")
    parser.add_argument("--no-servegen", action="store_true", help="only the Azure replay")
    parser.add_argument("--minutes", type=float, help="replay length (default 30; 10 with --quick)")
    parser.add_argument(
        "--adaptive-only",
        action="store_true",
        help="only the policies that observe (adaptive, the step-cost change, steady load): the static "
        "windows are judged on exact latencies, so a policy or observation change leaves their columns as they were",
    )
    parser.add_argument(
        "--above-edge",
        type=int,
        default=0,
        metavar="K",
        help="also run the K loads just above each capacity found: one that meets marks a cell where more "
        "load helped, which the bisection assumes never happens (default 0: none)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    if (args.slo_ttft_ms is None) != (args.slo_itl_ms is None):
        parser.error("--slo-ttft-ms and --slo-itl-ms go together")
    slos = (
        (DualSLO(args.slo_ttft_ms / 1000.0, args.slo_itl_ms / 1000.0),) if args.slo_ttft_ms is not None else SLO_PAIRS
    )
    minutes = args.minutes if args.minutes is not None else (10.0 if args.quick else 30.0)
    if not minutes > 0:
        parser.error(f"--minutes must be > 0, got {minutes}")
    if args.above_edge < 0:
        parser.error(f"--above-edge must be >= 0, got {args.above_edge}")
    return Settings(args, slos, minutes, 0.02 if args.quick else 0.01)


def load_replays(settings: Settings) -> tuple[dict[str, list[TraceRequest]], dict[str, Any]]:
    """The Azure replay and, unless ``--no-servegen``, the ServeGen days at its mean rate; with what each is."""
    args, minutes = settings.args, settings.minutes
    replays: dict[str, list[TraceRequest]] = {"azure": azure(minutes, args.trace)}
    replay_info: dict[str, Any] = {"azure": {"trace": str(args.trace), "minutes": minutes}}
    if not args.no_servegen:
        rate = len(replays["azure"]) / (minutes * 60.0)
        days = {"servegen_drift": False} if args.quick else {"servegen_drift": False, "servegen_steady": True}
        for name, steady in days.items():
            try:
                replays[name], replay_info[name] = servegen_day(minutes, rate, steady=steady)
            except (FileNotFoundError, ValueError) as error:
                print(f"{name} replay skipped: {error}", file=sys.stderr)
    for name, requests in replays.items():
        replay_info[name]["requests"] = len(requests)
        replay_info[name]["mean_rate_per_s"] = len(requests) / (minutes * 60.0)
    return replays, replay_info


def policy_jobs(
    settings: Settings,
    replays: dict[str, list[TraceRequest]],
    policy: str,
    window: Window | None,
    extra: tuple[Window, ...] = (),
) -> list[Job]:
    """One job of ``policy`` per replay and SLO pair."""
    return [
        Job(
            name,
            slo,
            policy,
            window,
            tuple(requests),
            A100_LLAMA2_7B,
            settings.tolerance,
            extra,
            settings.args.above_edge,
        )
        for name, requests in replays.items()
        for slo in settings.slos
    ]


def run_tuned_elsewhere(
    settings: Settings, replays: dict[str, list[TraceRequest]], results: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each replay under the best static window of another replay (when there is one), marked with its source."""
    best = {
        (r["replay"], r["slo"]): Window.model_validate(r["window"]) for r in results if r["policy"] == "best_static"
    }
    tuned_on = {} if settings.args.adaptive_only else elsewhere_sources(replays)
    elsewhere = [
        Job(
            name,
            slo,
            "tuned_elsewhere",
            best[(other, slo.label())],
            tuple(replays[name]),
            A100_LLAMA2_7B,
            settings.tolerance,
            above_edge=settings.args.above_edge,
        )
        for name, other in tuned_on.items()
        if other is not None
        for slo in settings.slos
    ]
    ran = _run(elsewhere, settings.args.workers)
    for result in ran:
        result["tuned_on"] = tuned_on[result["replay"]]
    return ran


def main(argv: list[str] | None = None) -> int:
    settings = _parse_args(argv)
    args, slos, cost, tolerance = settings.args, settings.slos, A100_LLAMA2_7B, settings.tolerance
    began = time.perf_counter()
    replays, replay_info = load_replays(settings)
    candidates = tuple(grid(args.quick))
    jobs = policy_jobs(settings, replays, "adaptive", STARTING_WINDOW)
    if not args.adaptive_only:
        jobs += (
            policy_jobs(settings, replays, "engine_defaults", ENGINE_DEFAULTS)
            + policy_jobs(settings, replays, "starting_window", STARTING_WINDOW)
            + policy_jobs(settings, replays, "best_static", None, candidates)
            + policy_jobs(settings, replays, "per_step_itl", PER_STEP_WINDOW)
        )
    results = _run(jobs, args.workers)
    results += run_tuned_elsewhere(settings, replays, results)
    change = step_cost_change(replays["azure"], slos[0], cost, tolerance)
    adaptive_capacity = next(
        r["capacity"]
        for r in results
        if r["replay"] == "azure" and r["slo"] == slos[0].label() and r["policy"] == "adaptive"
    )
    steady = steady_decisions(replays["azure"], slos[0], cost, adaptive_capacity)

    report = _report(results, slos, replays, replay_info, change, time.perf_counter() - began, args)
    report["steady_load"] = steady
    report["targets"]["decisions_per_hour_steady"] = steady["decisions_per_hour"]
    text = json.dumps(json_safe(report), indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    _print_summary(report)
    if args.plot:
        _plot(report, args.plot)
    return 0


def elsewhere_sources(names: Iterable[str]) -> dict[str, str | None]:
    """For each replay that ran, the replay its ``tuned_elsewhere`` window is tuned on (None: no other ran)."""
    ran = set(names)
    return {name: next((other for other in ELSEWHERE.get(name, ()) if other in ran), None) for name in ran}


def _run(jobs: list[Job], workers: int) -> list[dict[str, Any]]:
    # The longest jobs (best_static) first, so that the pool ends together.
    ordered = sorted(jobs, key=lambda j: j.policy != "best_static")
    if workers > 1 and len(ordered) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(run_job, ordered))
    return [run_job(job) for job in ordered]


def _report(
    results: list[dict[str, Any]],
    slos: tuple[DualSLO, ...],
    replays: dict[str, list[TraceRequest]],
    info: dict[str, Any],
    change: dict[str, Any],
    wall_s: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    cells: dict[str, dict[str, Any]] = {}
    for r in results:
        cell = cells.setdefault(f"{r['replay']} {r['slo']}", {"replay": r["replay"], "slo": r["slo"], "policies": {}})
        cell["policies"][r["policy"]] = r
    ratios_best = []
    targets: dict[str, Any] = {}
    for key, cell in cells.items():
        policies = cell["policies"]
        adaptive = policies["adaptive"]["capacity"]
        for other in ("best_static", "engine_defaults", "starting_window", "tuned_elsewhere", "per_step_itl"):
            if other in policies and policies[other]["capacity"] > 0:
                cell[f"adaptive_over_{other}"] = adaptive / policies[other]["capacity"]
        if "adaptive_over_best_static" in cell:
            ratios_best.append(cell["adaptive_over_best_static"])
            targets[key] = {"adaptive_ge_0.95x_best_static": cell["adaptive_over_best_static"] >= 0.95}
    first = slos[0]
    azure_cell = cells.get(f"azure {first.label()}", {})
    drift_cell = cells.get(f"servegen_drift {first.label()}", {})
    return {
        "slo": {"ttft_p99_s": first.ttft_p99_s, "itl_p99_s": first.itl_p99_s},
        "slo_pairs": [s.label() for s in slos],
        "cost_model": "a100-llama2-7b",
        "replays": info,
        "capacity": {policy: r["capacity"] for policy, r in azure_cell.get("policies", {}).items()},
        "best_static_window": azure_cell.get("policies", {}).get("best_static", {}).get("window"),
        "engine_defaults_window": ENGINE_DEFAULTS.model_dump(by_alias=True, mode="json"),
        "starting_window": STARTING_WINDOW.model_dump(by_alias=True, mode="json"),
        "at_capacity": {policy: r["at_capacity"] for policy, r in azure_cell.get("policies", {}).items()},
        "cells": cells,
        "targets": {
            "per_cell": targets,
            "adaptive_over_best_static_mean": statistics.mean(ratios_best) if ratios_best else None,
            "adaptive_over_engine_defaults_azure_100ms": azure_cell.get("adaptive_over_engine_defaults"),
            "adaptive_over_tuned_elsewhere_drift_day": drift_cell.get("adaptive_over_tuned_elsewhere"),
            "step_cost_change_intervals_to_recover": change["intervals_to_recover"],
        },
        "step_cost_change": change,
        "quick": args.quick,
        "wall_s": wall_s,
    }


def _print_summary(report: dict[str, Any]) -> None:
    order = ("adaptive", "best_static", "engine_defaults", "starting_window", "tuned_elsewhere", "per_step_itl")
    print(f"SLO capacity (arrival-rate multiplier), A100 Llama-2-7B step costs; {report['wall_s']:.0f} s")
    print(f"{'replay':16} {'SLO':12} " + " ".join(f"{p:>16}" for p in order))

    def shown(result: dict[str, Any]) -> str:
        met_above = [a["multiplier"] for a in result.get("above_edge", []) if a["meets"]]
        return f"{result['capacity']:.2f}" + (f" (+{max(met_above):.2f})" if met_above else "")

    for cell in report["cells"].values():
        row = " ".join(f"{shown(cell['policies'][p]):>16}" if p in cell["policies"] else f"{'-':>16}" for p in order)
        print(f"{cell['replay']:16} {cell['slo']:12} {row}")
    if any(r.get("above_edge") for cell in report["cells"].values() for r in cell["policies"].values()):
        print("(+x): the highest of the loads run above the capacity found that met the SLO as well")
    tuned_on = {
        cell["replay"]: cell["policies"]["tuned_elsewhere"]["tuned_on"]
        for cell in report["cells"].values()
        if "tuned_elsewhere" in cell["policies"]
    }
    print("tuned_elsewhere: " + ", ".join(f"{here} <- {there}" for here, there in tuned_on.items()))
    print("targets:", json.dumps(json_safe(report["targets"]), indent=1))
    steady = report.get("steady_load")
    if steady:
        print(
            f"steady load (Poisson at {steady['rate_per_s']:.2f} req/s): {steady['decisions_per_hour']:.0f} decisions/h "
            f"({steady['decisions_per_hour_after_10_min']:.0f} after the first 10 minutes)"
        )
    change = report["step_cost_change"]
    print(
        f"x{change['factor']} step cost from the midpoint at x{change['multiplier']}: both tails under the SLO "
        f"{change['intervals_to_recover']} intervals after the change; intervals over before it "
        f"{change['share_of_intervals_over_before_change']:.0%}, after recovery "
        f"{change['share_of_intervals_over_after_recovery']:.0%}"
    )


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ("adaptive", "best_static", "engine_defaults", "starting_window", "tuned_elsewhere", "per_step_itl")
    cells = list(report["cells"].values())
    fig, ax = plt.subplots(figsize=(max(11, 1.5 * len(cells)), 4.5))
    width = 0.8 / len(order)
    for i, policy in enumerate(order):
        values = [cell["policies"].get(policy, {}).get("capacity", 0.0) for cell in cells]
        ax.bar([x + i * width for x in range(len(cells))], values, width, label=policy)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cells))])
    ax.set_xticklabels([f"{c['replay']}\n{c['slo']}" for c in cells], fontsize=8)
    ax.set_ylabel("SLO capacity (x arrival rate)")
    ax.set_title("Largest load within TTFT P99 and inter-token P99 at once (A100 Llama-2-7B costs)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
