"""The cap's moves: lowered under memory pressure, raised for a backlog or burst room, lowered for
latency when the batch itself is slow.

Every move keeps the invariants of :mod:`batchpilot_operator.tuning.limits`: a field moves at most
one step per decision and stays within ``tuning.bounds``. Pure: what a move needs of the policy's
memory (the ceiling) is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.tuning.config import PolicyConfig
from batchpilot_operator.tuning.limits import cap_floor, limit_size
from batchpilot_operator.tuning.observations import Observations, known
from batchpilot_operator.tuning.reading import Reading, latency_cut
from batchpilot_runtime.contract.window import Window


@dataclass(frozen=True)
class MemoryMove:
    """Target and cap under memory pressure, and the decision's reason."""

    target: int
    cap: int
    reason: str


def memory_move(spec: BatchProfileSpec, window: Window, obs: Observations, reading: Reading) -> MemoryMove:
    """Target and cap under memory pressure: the cap below the running batch, the target within it."""
    bounds = spec.tuning.bounds
    fraction = spec.tuning.max_step_fraction
    cap, running = window.hard_cap, reading.running
    base = min(cap, math.ceil(running)) if known(running) and running >= 1 else cap
    new_cap = limit_size(cap, base * (1 - fraction / 2), fraction, cap_floor(bounds), bounds.hard_cap.max)
    target = max(bounds.target_batch_size.min, min(window.target_batch_size, new_cap))
    return MemoryMove(target, new_cap, _memory_said(obs, new_cap))


def _memory_said(obs: Observations, cap: int) -> str:
    pressure = f"{obs.preemptions_per_s:.2g} preemptions/s"
    return f"{pressure}: lowering the cap to {cap} (and not raising it again until memory is calm)."


CapCause = Literal["backlog", "slow_steps", "floor_gaps", "burst_room"]


@dataclass(frozen=True)
class CapMove:
    """The cap after one decision, and what moved it (None: nothing asked it to)."""

    cap: int
    cause: CapCause | None = None
    reason: str = ""  # what the move does and why, as the decision's reason says it


def cap_move(
    spec: BatchProfileSpec,
    window: Window,
    reading: Reading,
    ceiling: int,
    config: PolicyConfig,
    gaps_beyond_budget: bool = False,
) -> CapMove:
    """The cap: throughput when the backlog needs it, step time when the batch itself is slow.

    All else equal a worse first-token P99 never leaves a larger cap (monotone)."""
    move = _moved_cap(spec, window, reading, ceiling, config, gaps_beyond_budget)
    return replace(move, reason=_said(reading, move))


def _moved_cap(
    spec: BatchProfileSpec,
    window: Window,
    reading: Reading,
    ceiling: int,
    config: PolicyConfig,
    gaps_beyond_budget: bool,
) -> CapMove:
    bounds = spec.tuning.bounds
    fraction = spec.tuning.max_step_fraction
    cap, running = window.hard_cap, reading.running
    floor, top = cap_floor(bounds), min(ceiling, bounds.hard_cap.max)
    slo_s = spec.slo.p99_ms / 1000.0 if spec.slo.p99_ms is not None else math.nan
    cap_reached = known(running) and running >= config.cap_reach_ratio * cap
    queue_bound = cap_reached and reading.queue >= max(2.0, config.queue_bound_share * cap)
    slow_steps = reading.over and reading.step_s > config.step_slo_share * slo_s
    budget = window.max_prefill_tokens or bounds.max_prefill_tokens.max
    # Gaps too long with the budget at its floor, or that no budget explains: what is left is the decode.
    floor_gaps = reading.itl_over and (budget <= bounds.max_prefill_tokens.min or gaps_beyond_budget)
    if queue_bound and not reading.soft_full and cap < ceiling:
        # A backlog that the running batch cannot absorb is a throughput problem, whatever P99 says.
        return CapMove(limit_size(cap, cap * (1 + fraction), fraction, floor, top), "backlog")
    if cap_reached and not queue_bound and (slow_steps or floor_gaps):
        # The cap comes down for latency when the batch itself is slow: steps too long for the TTFT
        # SLO, or gaps too long with the budget already at its floor (what is left of a step is the
        # batch's decode). Both read the window in force, not this decision's other moves, and the
        # deeper cut wins (the slow steps on a tie).
        cuts: list[CapMove] = []
        if slow_steps:
            cut = latency_cut(fraction, reading)
            cuts.append(CapMove(limit_size(cap, cap * (1 - cut), fraction, floor, bounds.hard_cap.max), "slow_steps"))
        if floor_gaps:
            itl_cut = fraction * (1.0 if math.isinf(reading.itl) else min(1.0, max(0.3, reading.itl - 1.0)))
            cuts.append(
                CapMove(limit_size(cap, cap * (1 - itl_cut), fraction, floor, bounds.hard_cap.max), "floor_gaps")
            )
        return min(cuts, key=lambda move: move.cap)
    spare = config.cap_spare_factor
    within_slo = not reading.over and not reading.itl_over
    if within_slo and known(running) and running * spare > cap and not reading.soft_full and cap < ceiling:
        # Within the SLO the cap keeps room for a burst of a few times the running batch: a spare
        # slot costs nothing until it is used, and a missing one turns the next burst into a queue.
        return CapMove(limit_size(cap, running * spare, fraction, floor, top), "burst_room")
    return CapMove(cap)


def _said(reading: Reading, move: CapMove) -> str:
    """What ``move`` does and why, as the decision's reason says it ("" when nothing asked it to move)."""
    if move.cause == "backlog":
        return f"raising the cap to {move.cap} ({reading.queue:.0f} waiting with the batch at its cap)"
    if move.cause == "slow_steps":
        why = f"steps of {reading.step_s * 1000:.0f} ms at this batch are too long for the SLO"
        return f"lowering the cap to {move.cap} ({why})"
    if move.cause == "floor_gaps":
        return (
            f"lowering the cap to {move.cap} (gaps still too long with the prefill budget at its floor or beyond "
            "what it explains: the rest of a step is the batch's decode)"
        )
    if move.cause == "burst_room":
        return f"raising the cap to {move.cap} (room for a burst over the running batch of {reading.running:.0f})"
    return ""
