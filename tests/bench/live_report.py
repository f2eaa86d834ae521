"""``bench_live``'s figures: the simulator's error per probe, a cell's table line and the PNG of its searches."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from batchpilot_runtime.replay.cost_model import CostModel, StepComposition
from tests.bench.live_probe import ProbeResult

ERROR_LIMIT = 0.15  # the bound on the simulator's error
QUANTILES = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")


def relative_error(simulated: float | None, live: float | None) -> float | None:
    """(simulated - live) / live; None where either is missing or infinite, or live is 0."""
    if simulated is None or live is None or not (math.isfinite(simulated) and math.isfinite(live)) or live == 0:
        return None
    return round((simulated - live) / live, 4)


def sim_error(live: ProbeResult, simulated: dict[str, Any]) -> dict[str, Any]:
    """Each latency's relative error, for a probe that ran to its end (a stopped one has only part of its
    requests' figures, while the simulator replayed them all)."""
    if live.stopped_early:
        return {"compared": False, "meets_agree": simulated["meets"] == live.meets}
    return {
        "compared": True,
        "meets_agree": simulated["meets"] == live.meets,
        **{q: relative_error(simulated[q], getattr(live, q)) for q in QUANTILES},
    }


def step_costs(steps: list[tuple[StepComposition, float]], cost: CostModel) -> dict[str, Any]:
    """The runtime's logged steps against the cost model on the same compositions: live seconds over
    modelled, over all steps and over those with and without prompt tokens. Near 1, the cost model is
    right and an error in the latencies is the scheduler model's (or the traffic's); far from 1, the
    step costs are what the simulator gets wrong."""

    def ratio(chosen: list[tuple[StepComposition, float]]) -> float | None:
        modelled = sum(cost.step_seconds(composition) for composition, _ in chosen)
        return round(sum(seconds for _, seconds in chosen) / modelled, 4) if chosen and modelled > 0 else None

    return {
        "count": len(steps),
        "live_s": round(sum(seconds for _, seconds in steps), 3),
        "ratio": ratio(steps),
        "prefill_ratio": ratio([s for s in steps if s[0].prefill_tokens > 0]),
        "decode_ratio": ratio([s for s in steps if s[0].prefill_tokens == 0]),
    }


def error_summary(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest absolute error of each latency over a cell's compared probes, and how many were over
    ``ERROR_LIMIT``."""
    compared = [p["error"] for p in probes if p.get("error", {}).get("compared")]
    summary: dict[str, Any] = {"compared_probes": len(compared)}
    for q in QUANTILES:
        errors = [abs(e[q]) for e in compared if e.get(q) is not None]
        summary[q] = {"max_abs": max(errors) if errors else None,
                      "over_limit": sum(1 for e in errors if e > ERROR_LIMIT)}  # fmt: skip
    ratios = [p["steps"]["ratio"] for p in probes if p.get("steps", {}).get("ratio") is not None]
    summary["step_cost_ratio"] = {"min": min(ratios), "max": max(ratios)} if ratios else None
    summary["verdicts_agree"] = sum(1 for p in probes if p.get("error", {}).get("meets_agree"))
    summary["probes"] = sum(1 for p in probes if "error" in p)
    return summary


def capacity_ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 3)


def print_cell(cell: dict[str, Any]) -> None:
    live, sim = cell["live"], cell.get("simulated", {})
    slo = cell["slo"]
    parts = [f"{cell['engine']}/{cell['trace']} (SLO {slo['ttft_p99_ms']:.0f} ms / {slo['itl_p99_ms']:.1f} ms, "
             f"x1 = {cell['base_rate_per_s']} requests/s):"]  # fmt: skip
    for policy, capacity in live.items():
        simulated = f", simulated x{sim[policy]:g}" if policy in sim else ""
        parts.append(f"{policy} x{capacity:g}{simulated}")
    ratios = {
        "adaptive/best_static": capacity_ratio(live.get("adaptive"), live.get("best_static")),
        "adaptive/defaults": capacity_ratio(live.get("adaptive"), live.get("defaults")),
    }
    parts.append(", ".join(f"{k} {v}" for k, v in ratios.items() if v is not None))
    print(" ".join(parts), flush=True)


def plot_cell(cell: dict[str, Any], path: Path) -> None:
    """Each policy's probes by load: met (filled) or not (open), the capacity found as a bar, and the
    simulator's verdict on the runtime's probes as a cross."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({p["policy"] for p in cell["probes"]}, key=lambda label: (label != "defaults", label))
    figure, axis = plt.subplots(figsize=(8, 1.2 + 0.5 * len(labels)))
    for row, label in enumerate(labels):
        probes = [p for p in cell["probes"] if p["policy"] == label]
        for probe in probes:
            met = probe["meets"]
            axis.scatter(probe["multiplier"], row, marker="o", s=60, facecolors="tab:green" if met else "none",
                         edgecolors="tab:green" if met else "tab:red")  # fmt: skip
            if "simulated" in probe:
                axis.scatter(probe["multiplier"], row + 0.2, marker="x", s=30,
                             color="tab:green" if probe["simulated"]["meets"] else "tab:red")  # fmt: skip
    for policy, capacity in cell["live"].items():
        axis.axvline(capacity, linestyle=":", color="grey")
        axis.annotate(f"{policy} x{capacity:g}", (capacity, len(labels) - 0.4), fontsize=7, rotation=90)
    axis.set_yticks(range(len(labels)), labels, fontsize=8)
    axis.set_ylim(-0.6, len(labels) + 0.2)
    axis.set_xlabel(f"load multiplier (x1 = {cell['base_rate_per_s']} requests/s)")
    slo = cell["slo"]
    axis.set_title(f"{cell['engine']} on {cell['trace']}, SLO {slo['ttft_p99_ms']:.0f} ms / {slo['itl_p99_ms']:.1f} ms: "
                   "live probes (o: filled met), simulated (x)", fontsize=9)  # fmt: skip
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
