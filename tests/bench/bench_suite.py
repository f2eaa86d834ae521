"""No-regret suite (issue 31): SLO capacity over a matrix of traffic shapes x SLO pairs.

For every shape of :mod:`tests.bench.suite_shapes` and every SLO pair, the capacity search of
``bench_slo`` (the largest arrival-rate multiplier, up to x1.5, at which TTFT P99 and inter-token
P99 both meet their targets, on the A100 Llama-2-7B step costs) for:

- ``adaptive``: the tuning policy from the starting window;
- ``starting_window``: that window held still (target 16, cap 64, wait 20 ms, budget 512);
- ``engine_defaults``: vLLM's defaults on an A100 (budget 2048, cap 256, no wait);
- ``best_static``: the best window of ``bench_slo``'s grid in hindsight.

A cell reports adaptive / best static (the best of every static window run: the grid's, the starting
window and the engine defaults) and adaptive / starting window; the summary gives the mean of each
ratio over the cells and its minimum with the cell where it falls. A cell where no static window
meets the SLO even at x0.02 is dropped (the SLO is out of reach for that shape on this GPU) and
listed with that reason. A capacity of 1.5 is the top of the search: the policy met the SLO at every
load tried.

``--statics JSON`` reuses the static columns of an earlier report's cells (they are judged on exact
latencies, so a change to the policy leaves them as they were): only ``adaptive`` runs there, and
the static windows only in cells that report lacks.

Usage::

    nice -n 19 .venv/bin/python tests/bench/bench_suite.py --quick --json suite.json --plot suite.png
    nice -n 19 .venv/bin/python tests/bench/bench_suite.py --quick --statics suite.json --json after.json
    nice -n 19 .venv/bin/python tests/bench/bench_suite.py --json suite-full.json --plot suite-full.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchpilot_operator.cli.simulate import json_safe
from batchpilot_operator.sim.slo import DualSLO, dual_slo_spec
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import A100_LLAMA2_7B
from batchpilot_runtime.replay.trace import DEFAULT_TRACE_PATH

if __package__ in (None, ""):  # run as a script: the repository root makes ``tests.bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.bench_slo import ENGINE_DEFAULTS, STARTING_WINDOW, Job, _run, grid
from tests.bench.suite_shapes import Shape, build_shapes

SUITE_SLO_PAIRS = (DualSLO(1.0, 0.100), DualSLO(2.0, 0.050), DualSLO(3.0, 0.100), DualSLO(5.0, 0.200))
STATIC_POLICIES = ("starting_window", "auto_window", "engine_defaults", "best_static")
# Each adaptive run and the start it is judged against held still: the profile's own window, and the
# window derived from the step costs and the SLO for a profile that gives none (``window`` left out).
ADAPTIVE_STARTS = {"adaptive": "starting_window", "adaptive_auto": "auto_window"}
TOP_MULTIPLIER = 1.5  # bisect_capacity's default ceiling
TARGET_OVER_START = 0.98
TARGET_OVER_BEST = 0.95


def cell_key(shape: str, slo: str) -> str:
    return f"{shape} {slo}"


def summarize(capacities: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per cell (``capacities[cell][policy]``): each adaptive run's two ratios, or why the cell was
    dropped; over the kept cells, each ratio's mean, minimum and the cell of the minimum, and the
    cells under target.

    Best static is the best of every static window run. Each adaptive run is also judged against
    its own start held still (``ADAPTIVE_STARTS``); over a start that serves nothing its ratio is 1
    when it serves nothing too, and the cell has no such ratio otherwise. A cell without an
    adaptive run (an older report) has no ratios for it."""
    cells: dict[str, dict[str, Any]] = {}
    kept: dict[str, dict[str, float]] = {}
    for key, policies in capacities.items():
        best = max(policies.get(p, 0.0) for p in STATIC_POLICIES)
        cell: dict[str, Any] = {"capacity": dict(policies), "best_static_any": best}
        cells[key] = cell
        if best <= 0:
            cell["dropped"] = "no static window meets this SLO at x0.02 on this shape"
            continue
        for adaptive_name, start_name in ADAPTIVE_STARTS.items():
            if adaptive_name not in policies:
                continue
            adaptive, start = policies[adaptive_name], policies.get(start_name, 0.0)
            over_best, over_start = f"{adaptive_name}_over_best", f"{adaptive_name}_over_start"
            cell[f"{adaptive_name}_over_best_static"] = kept.setdefault(over_best, {})[key] = adaptive / best
            if start > 0 or adaptive == 0:
                ratio = adaptive / start if start > 0 else 1.0
                cell[f"{adaptive_name}_over_{start_name}"] = kept.setdefault(over_start, {})[key] = ratio
    summary: dict[str, Any] = {
        "cells_kept": sum(1 for c in cells.values() if "dropped" not in c),
        "cells_dropped": sum(1 for c in cells.values() if "dropped" in c),
    }
    for adaptive_name in ADAPTIVE_STARTS:
        for kind, target in (("over_best", TARGET_OVER_BEST), ("over_start", TARGET_OVER_START)):
            name = f"{adaptive_name}_{kind}"
            ratios = kept.get(name)
            if not ratios:
                continue
            worst = min(ratios, key=lambda k: ratios[k])
            summary[f"{name}_mean"] = statistics.mean(ratios.values())
            summary[f"{name}_min"] = ratios[worst]
            summary[f"{name}_min_cell"] = worst
            summary[f"cells_under_{target}x_{name}"] = sorted(k for k, r in ratios.items() if r < target - 1e-9)
    return {"cells": cells, "summary": summary}


def _jobs(shapes: Sequence[Shape], slos: Sequence[DualSLO], policies: Sequence[str], quick: bool) -> list[Job]:
    tolerance = 0.02 if quick else 0.01
    candidates = tuple(grid(quick))

    def start(policy: str, slo: DualSLO) -> Window | None:
        if policy in ("adaptive_auto", "auto_window"):
            return Window.from_fields(dual_slo_spec(slo, A100_LLAMA2_7B).window, 0)
        return {
            "adaptive": STARTING_WINDOW,
            "starting_window": STARTING_WINDOW,
            "engine_defaults": ENGINE_DEFAULTS,
        }.get(policy)

    return [
        Job(
            shape.name,
            slo,
            policy,
            start(policy, slo),
            shape.requests,
            A100_LLAMA2_7B,
            tolerance,
            candidates if policy == "best_static" else (),
        )
        for shape in shapes
        for slo in slos
        for policy in policies
    ]


def _reused_statics(path: Path) -> dict[str, dict[str, Any]]:
    report = json.loads(path.read_text())
    return {
        key: {p: r for p, r in cell["results"].items() if p in STATIC_POLICIES} for key, cell in report["cells"].items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE_PATH, help="the Azure-format trace CSV")
    parser.add_argument("--quick", action="store_true", help="8-minute shapes, the quick grid, a 0.02 step")
    parser.add_argument("--minutes", type=float, help="length of each shape (default 20; 8 with --quick)")
    parser.add_argument("--shapes", nargs="+", help="only these shapes (names as in the report)")
    parser.add_argument("--statics", type=Path, help="reuse the static columns of this earlier report")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    minutes = args.minutes if args.minutes is not None else (8.0 if args.quick else 20.0)
    if not minutes > 0:
        parser.error(f"--minutes must be > 0, got {minutes}")
    began = time.perf_counter()
    shapes = [s for s in build_shapes(args.trace, minutes) if not args.shapes or s.name in args.shapes]
    reused = _reused_statics(args.statics) if args.statics else {}
    jobs = [
        job
        for job in _jobs(shapes, SUITE_SLO_PAIRS, (*ADAPTIVE_STARTS, *STATIC_POLICIES), args.quick)
        if job.policy not in reused.get(cell_key(job.replay, job.slo.label()), {})
    ]
    results = _run(jobs, args.workers)
    by_cell: dict[str, dict[str, Any]] = {}
    for r in results:
        by_cell.setdefault(cell_key(r["replay"], r["slo"]), {})[r["policy"]] = r
    for key, statics in reused.items():
        if key in by_cell:
            by_cell[key].update(statics)
    capacities = {key: {p: r["capacity"] for p, r in cell.items()} for key, cell in by_cell.items()}
    report = summarize(capacities)
    for key, cell in report["cells"].items():
        cell["results"] = by_cell[key]
    report.update(
        {
            "shapes": {s.name: s.describe() for s in shapes},
            "slo_pairs": [s.label() for s in SUITE_SLO_PAIRS],
            "cost_model": A100_LLAMA2_7B.name,
            "starting_window": STARTING_WINDOW.model_dump(by_alias=True, mode="json"),
            "auto_windows": {
                slo.label(): dual_slo_spec(slo, A100_LLAMA2_7B).window.model_dump(by_alias=True, mode="json")
                for slo in SUITE_SLO_PAIRS
            },
            "quick": args.quick,
            "minutes": minutes,
            "statics_from": str(args.statics) if args.statics else None,
            "wall_s": time.perf_counter() - began,
        }
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(json_safe(report), indent=2) + "\n")
    print_table(report)
    if args.plot:
        plot(report, args.plot)
    return 0


def _shown(capacity: float) -> str:
    return f">={capacity:.2f}" if capacity >= TOP_MULTIPLIER else f"{capacity:.2f}"


def _ratio_text(value: float | None) -> str:
    return f"{value:6.2f}" if value is not None else f"{'-':>6}"


def print_table(report: dict[str, Any]) -> None:
    print(f"No-regret suite, SLO capacity (x arrival rate), A100 Llama-2-7B; {report['wall_s']:.0f} s")
    for name, shape in report["shapes"].items():
        print(f"  {name}: {shape['label']} ({shape['requests']} requests, {shape['mean_rate_per_min']:.1f}/min)")
    print(f"  derived first windows: {report.get('auto_windows', {})}")
    columns = (*ADAPTIVE_STARTS, *STATIC_POLICIES)
    names = {
        "adaptive_auto": "adapt.auto",
        "starting_window": "start",
        "auto_window": "auto",
        "engine_defaults": "defaults",
    }
    ratios = "  ".join(f"{'/best':>6} {'/' + names[s]:>6}" for s in ADAPTIVE_STARTS.values())
    print(f"{'shape':20} {'SLO':12} " + " ".join(f"{names.get(p, p)[:10]:>10}" for p in columns) + "  " + ratios)
    for key, cell in report["cells"].items():
        shape, slo = key.split(" ")
        cap = cell["capacity"]
        cols = " ".join(f"{_shown(cap.get(p, math.nan)):>10}" for p in columns)
        if "dropped" in cell:
            print(f"{shape:20} {slo:12} {cols}  dropped: {cell['dropped']}")
            continue
        text = "  ".join(
            f"{_ratio_text(cell.get(f'{a}_over_best_static'))} {_ratio_text(cell.get(f'{a}_over_{s}'))}"
            for a, s in ADAPTIVE_STARTS.items()
        )
        print(f"{shape:20} {slo:12} {cols}  {text}")
    print("summary:", json.dumps(json_safe(report["summary"]), indent=1))


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(k, c) for k, c in report["cells"].items() if "dropped" not in c]
    fig, ax = plt.subplots(figsize=(max(10, 0.55 * len(cells)), 4.8))
    xs = range(len(cells))
    for offset, name, label in (
        (-0.2, "adaptive", "from the profile's window"),
        (0.2, "adaptive_auto", "from the derived window"),
    ):
        ax.bar(
            [x + offset for x in xs],
            [c.get(f"{name}_over_best_static", math.nan) for _, c in cells],
            0.4,
            label=f"adaptive / best static, {label}",
        )
    ax.axhline(TARGET_OVER_BEST, color="r", lw=0.8, ls=":")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([k.replace(" ", "\n") for k, _ in cells], fontsize=6, rotation=90)
    ax.set_ylim(0, 1.6)
    ax.set_ylabel("capacity ratio")
    summary = report["summary"]
    ax.set_title(
        f"No-regret suite: min adaptive/best {summary.get('adaptive_over_best_min', math.nan):.2f} from the profile's "
        f"window, {summary.get('adaptive_auto_over_best_min', math.nan):.2f} from the derived one",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
