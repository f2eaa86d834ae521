"""Judging a replay by two tails at once: TTFT P99 and inter-token P99, and the SLO capacity.

A replay *meets* a dual SLO when, over every request of the replay, the nearest-rank P99 of the
time to first token (rejected and unfinished requests count as infinite) and the P99 of every
inter-token gap (the time since the same request's previous token, preemption stalls included)
are both within their targets. The *SLO capacity* of a policy is the largest arrival-rate
multiplier (arrival times divided by it) at which its replay meets the SLO, found by bisection.
Goodput follows DistServe (Zhong et al., OSDI 2024): requests per second whose TTFT and mean
time per output token both meet the SLO.

Pure: the simulator on a virtual clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from batchpilot_operator.api.profile import BatchProfileSpec, parse_spec
from batchpilot_operator.sim.controllers import AdaptiveController, StaticController
from batchpilot_operator.sim.metrics import exact_quantile
from batchpilot_operator.sim.simulator import SimConfig, SimResult, Simulator, scheduler_config_for
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import CostModel
from batchpilot_runtime.replay.trace import TraceRequest

DRAIN_S = 600.0


@dataclass(frozen=True)
class DualSLO:
    ttft_p99_s: float
    itl_p99_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_p99_s > 0 and self.itl_p99_s > 0):
            raise ValueError(f"both SLO targets must be > 0, got TTFT {self.ttft_p99_s} s, ITL {self.itl_p99_s} s")

    def label(self) -> str:
        return f"{self.ttft_p99_s * 1000:.0f}ms/{self.itl_p99_s * 1000:.0f}ms"


@dataclass(frozen=True)
class Outcome:
    """How one replay did against a dual SLO."""

    multiplier: float
    ttft_p99_s: float
    itl_p99_s: float
    goodput_requests_per_s: float
    slo_attainment: float  # share of requests whose TTFT and TPOT both met the SLO
    decisions: int
    aborted: bool
    requests: int
    rejected: int  # refused at arrival: a full queue, or a request that can never fit (an explicit error)
    unfinished: int  # accepted and not finished when the replay stopped
    final_window: Window

    @property
    def meets(self) -> bool:
        return not self.aborted and self.ttft_p99_s <= self.ttft_target_s and self.itl_p99_s <= self.itl_target_s

    # Filled by evaluate(); kept out of the constructor's positional order for readability.
    ttft_target_s: float = math.inf
    itl_target_s: float = math.inf

    def to_json(self) -> dict[str, Any]:
        return {
            "multiplier": self.multiplier,
            "ttft_p99_s": self.ttft_p99_s,
            "itl_p99_s": self.itl_p99_s,
            "goodput_requests_per_s": self.goodput_requests_per_s,
            "slo_attainment": self.slo_attainment,
            "decisions": self.decisions,
            "rejected": self.rejected,
            "unfinished": self.unfinished,
            "meets": self.meets,
            "window": self.final_window.model_dump(by_alias=True, mode="json"),
        }


def scale_arrivals(requests: Sequence[TraceRequest], multiplier: float) -> list[TraceRequest]:
    """The replay at ``multiplier`` x the trace's arrival rate (token counts unchanged)."""
    if not multiplier > 0:
        raise ValueError(f"multiplier must be > 0, got {multiplier}")
    return [TraceRequest(r.arrival_s / multiplier, r.prompt_tokens, r.output_tokens) for r in requests]


def step_costs(cost: CostModel) -> dict[str, Any]:
    """``spec.stepCosts`` for a cost model (its KV term has no field there)."""
    return {
        "fixedMs": cost.fixed_s * 1000.0,
        "prefillUsPerToken": cost.per_prefill_token_s * 1e6,
        "decodeUsPerSequence": cost.per_decode_seq_s * 1e6,
        "source": cost.name,
    }


def dual_slo_spec(
    slo: DualSLO,
    start: Window | CostModel,
    *,
    interval_s: int = 15,
    cooldown_s: int = 30,
    hard_cap_max: int = 256,
    budget_bounds: tuple[int, int] = (128, 16_384),
) -> BatchProfileSpec:
    """A profile with both objectives, starting from ``start``: a window, or for a cost model no
    window and that model's step costs (the first window is derived from them and the SLO)."""
    if isinstance(start, Window):
        window = start.model_dump(by_alias=True, mode="json")
        window.pop("generation", None)
        first: dict[str, Any] = {"window": window}
    else:
        first = {"stepCosts": step_costs(start)}
    return parse_spec(
        {
            "model": "sim",
            "selector": {"matchLabels": {"app": "sim"}},
            "batchFriendliness": "auto",
            **first,
            "slo": {
                "latencyMetric": "ttft",
                "p99Ms": slo.ttft_p99_s * 1000.0,
                "interTokenP99Ms": slo.itl_p99_s * 1000.0,
            },
            "tuning": {
                "intervalSeconds": interval_s,
                "cooldownSeconds": cooldown_s,
                "maxStepFraction": 0.5,
                "bounds": {
                    "hardCap": {"min": 1, "max": hard_cap_max},
                    "targetBatchSize": {"min": 1, "max": hard_cap_max},
                    "maxPrefillTokens": {"min": budget_bounds[0], "max": budget_bounds[1]},
                },
            },
        }
    )


def evaluate(
    requests: Sequence[TraceRequest],
    multiplier: float,
    slo: DualSLO,
    cost: CostModel,
    window: Window,
    spec: BatchProfileSpec | None = None,
    *,
    cost_change: tuple[float, CostModel] | None = None,
    stop_early: bool = True,
    step_budget_itl_s: float | None = None,
) -> tuple[Outcome, SimResult]:
    """One replay at ``multiplier``: static ``window`` when ``spec`` is None, else the adaptive
    policy of ``spec`` starting from ``window``. ``stop_early`` ends a replay as soon as more
    requests missed the TTFT target than P99 allows (it cannot meet the SLO any more), or more gaps
    missed the inter-token target. ``step_budget_itl_s`` derives each step's budget from that
    inter-token target (``simulator.itl_budget_rule``)."""
    replay = scale_arrivals(requests, multiplier)
    n = len(replay)
    allowed_misses = n - math.ceil(0.99 * n) if n else 0
    gaps = sum(max(0, r.output_tokens - 1) for r in replay)
    allowed_gap_misses = gaps - math.ceil(0.99 * gaps)
    interval_s = float(spec.tuning.interval_seconds) if spec is not None else 15.0
    config = SimConfig(
        cost=cost,
        scheduler=scheduler_config_for(cost),
        slo_p99_s=slo.ttft_p99_s,
        slo_itl_p99_s=slo.itl_p99_s,
        interval_s=interval_s,
        rate_window_s=2 * interval_s,
        max_sim_s=(replay[-1].arrival_s + DRAIN_S) if replay else None,
        abort_after_misses=allowed_misses if stop_early else None,
        abort_after_gap_misses=allowed_gap_misses if stop_early else None,
        record_timeline=spec is not None,
        cost_change=None if cost_change is None else (cost_change[0] / multiplier, cost_change[1]),
        step_budget_itl_s=step_budget_itl_s,
    )
    controller = AdaptiveController(spec) if spec is not None else StaticController()
    result = Simulator(replay, window, config, controller).run()
    return judge(result, multiplier, slo), result


def judge(result: SimResult, multiplier: float, slo: DualSLO) -> Outcome:
    records = result.records
    n = len(records)
    ttfts = sorted(r.ttft_s for r in records)
    good = sum(1 for r in records if r.ttft_s <= slo.ttft_p99_s and r.tpot_s <= slo.itl_p99_s)
    span_s = max(result.trace_span_s, 1e-9)
    return Outcome(
        multiplier=multiplier,
        ttft_p99_s=exact_quantile(ttfts, 0.99) if n else math.nan,
        itl_p99_s=result.gaps.quantile(0.99),
        goodput_requests_per_s=good / span_s,
        slo_attainment=good / n if n else math.nan,
        decisions=result.window_changes,
        aborted=result.aborted,
        requests=n,
        rejected=sum(1 for r in records if r.rejected),
        unfinished=sum(1 for r in records if math.isnan(r.finished_s) and not r.rejected),
        final_window=result.final_window,
        ttft_target_s=slo.ttft_p99_s,
        itl_target_s=slo.itl_p99_s,
    )


def bisect_capacity(
    meets: Callable[[float], bool], lo: float = 0.02, hi: float = 1.5, tolerance: float = 0.01
) -> float:
    """Largest multiplier on the ``tolerance`` grid in [lo, hi] at which ``meets`` holds, as found by
    bisection; 0 when it fails at ``lo``. Every multiplier tried lies on the grid, so the answer is
    one that was run and met the SLO.

    Assumes a monotone answer (more load never helps), which holds in the simulator up to noise:
    the bisection reports the edge it finds, not a guarantee that every lower load meets. ``lo``
    itself is run only when no load above it met: it is the lightest load, and with nothing to
    batch the slowest to simulate (a tenth of the Azure replay at x0.02 takes 3x as long as at
    x0.3), while every other load the bisection tries is the same as if it had run first."""
    bottom = low = math.ceil(lo / tolerance - 1e-9)
    high = math.floor(hi / tolerance + 1e-9)
    if meets(round(high * tolerance, 6)):
        return round(high * tolerance, 6)
    while high - low > 1:
        mid = (low + high) // 2
        if meets(round(mid * tolerance, 6)):
            low = mid
        else:
            high = mid
    if low == bottom and not meets(round(low * tolerance, 6)):
        return 0.0
    return round(low * tolerance, 6)


def scaled_cost(cost: CostModel, factor: float) -> CostModel:
    """The same GPU with every step ``factor`` times as long (a heavier model version)."""
    return replace(
        cost,
        fixed_s=cost.fixed_s * factor,
        per_prefill_token_s=cost.per_prefill_token_s * factor,
        per_decode_seq_s=cost.per_decode_seq_s * factor,
        per_kv_token_s=cost.per_kv_token_s * factor,
    )
