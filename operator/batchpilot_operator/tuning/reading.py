"""What one interval's observations say against the SLO: the ratios, the step time, the engine's
busy share and memory pressure, gathered in one :class:`Reading` that every move reads.

Pure: nothing here reads a clock or the policy's memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.tuning.config import PolicyConfig
from batchpilot_operator.tuning.error_budget import GapReading
from batchpilot_operator.tuning.observations import Observations, known


def latency_ratio(spec: BatchProfileSpec, obs: Observations) -> float:
    """P99 of the SLO's latency metric over ``slo.p99Ms`` (inf when saturated; NaN without a
    target or data)."""
    target_ms = spec.slo.p99_ms
    if target_ms is None:
        return math.nan
    if obs.p99_saturated:
        return math.inf
    return obs.p99_s * 1000.0 / target_ms if known(obs.p99_s) else math.nan


def itl_ratio(spec: BatchProfileSpec, obs: Observations) -> float:
    """Inter-token P99 over its target (inf when saturated; NaN without a target or data)."""
    return gap_ratio(spec, obs.itl_p99_s, obs.itl_p99_saturated)


def gap_ratio(spec: BatchProfileSpec, p99_s: float, saturated: bool) -> float:
    """An inter-token P99 over its target (inf when ``saturated``; NaN without a target or data)."""
    target_ms = spec.slo.inter_token_p99_ms
    if target_ms is None:
        return math.nan
    if saturated:
        return math.inf
    return p99_s * 1000.0 / target_ms if known(p99_s) else math.nan


def slo_over(spec: BatchProfileSpec, obs: Observations) -> bool | None:
    """Whether any P99 objective of the SLO is over its target; None when none of them has data."""
    ratios = [r for r in (latency_ratio(spec, obs), itl_ratio(spec, obs)) if not math.isnan(r)]
    return any(r > 1.0 for r in ratios) if ratios else None


def step_time_s(obs: Observations) -> float:
    """Mean decode step time at the running batch's size (the nearest measured bucket at or above it)."""
    if not obs.step_s_by_batch:
        return math.nan
    running = obs.mean_batch_size if known(obs.mean_batch_size) else 1.0
    at_or_above = [b for b in obs.step_s_by_batch if b >= running]
    bucket = min(at_or_above) if at_or_above else max(obs.step_s_by_batch)
    return obs.step_s_by_batch[bucket]


def busy_share(obs: Observations) -> float:
    """Share of the time the engine spends in decode steps (NaN when unknown).

    Each decode step yields one token per running sequence, so generated tokens per second over
    the mean batch is decode steps per second; times the step time at that batch, busy time.
    """
    step_s = step_time_s(obs)
    tokens, batch = obs.tokens_per_s, obs.mean_batch_size
    if not (known(step_s) and known(tokens) and known(batch) and batch > 0):
        return math.nan
    return min(1.0, tokens / batch * step_s)


def memory_pressure(obs: Observations, config: PolicyConfig) -> bool:
    """Whether preemptions (KV cache exhausted mid-decode) are frequent enough to lower the cap."""
    if not (known(obs.preemptions_per_s) and obs.preemptions_per_s > 0):
        return False
    per_arrival = (
        obs.preemptions_per_s / obs.arrival_rate_per_s
        if known(obs.arrival_rate_per_s) and obs.arrival_rate_per_s > 0
        else math.inf
    )
    return obs.preemptions_per_s >= config.preemptions_per_s_high or per_arrival >= config.preemption_share_high


@dataclass(frozen=True)
class Reading:
    """One interval's observations as the moves read them (past the data gates)."""

    ratio: float  # first-token P99 over its target: inf when saturated, NaN without that objective
    itl: float  # inter-token P99 (as read: ``gaps.p99_s``) over its target, the same way
    gaps: GapReading  # the inter-token P99 as read, the interval's own, and why they differ
    zone_ratio: float  # what places target and wait in a zone: first tokens, else the gaps
    saturated: bool  # the first-token P99 lies in the top bucket: only a lower bound
    running: float  # mean running batch; NaN when unknown
    queue: float  # queue depth; 0 when unknown
    step_s: float  # decode step time at the running batch; NaN when unknown
    busy: float  # share of the time spent decoding; NaN when unknown
    pressure: bool  # preemptions ask for a smaller cap
    soft_full: bool  # KV usage high enough to block every cap raise
    headroom: bool  # the zone ratio under the headroom share, and the gaps within target
    engine_busy: bool  # decoding so much of the time that a wait buys nothing

    @property
    def over(self) -> bool:
        return self.ratio > 1.0

    @property
    def itl_over(self) -> bool:
        return self.itl > 1.0


def read(spec: BatchProfileSpec, obs: Observations, gaps: GapReading, config: PolicyConfig) -> Reading:
    """The reading of ``obs`` against the spec's SLO, its gaps as ``gaps`` reads them."""
    ratio = latency_ratio(spec, obs)
    itl = gap_ratio(spec, gaps.p99_s, gaps.saturated)
    # The zones of target and wait follow the first-token objective, or the gaps when it is the only one.
    zone_ratio = ratio if spec.slo.p99_ms is not None else itl
    busy = busy_share(obs)
    return Reading(
        ratio=ratio,
        itl=itl,
        gaps=gaps,
        zone_ratio=zone_ratio,
        saturated=obs.p99_saturated,
        running=obs.mean_batch_size if known(obs.mean_batch_size) else math.nan,
        queue=obs.queue_depth if known(obs.queue_depth) else 0.0,
        step_s=step_time_s(obs),
        busy=busy,
        pressure=memory_pressure(obs, config),
        soft_full=known(obs.kv_usage_ratio) and obs.kv_usage_ratio >= config.kv_soft_ratio,
        headroom=zone_ratio < config.headroom_ratio and not itl > 1.0,
        engine_busy=known(busy) and busy >= config.busy_share_no_wait,
    )


def latency_cut(fraction: float, reading: Reading) -> float:
    """Share of a field that an over-SLO decision cuts: a part of ``fraction`` that grows with the
    overshoot (all of it when saturated)."""
    severity = 1.0 if reading.saturated else min(1.0, max(0.3, reading.ratio - 1.0))
    return fraction * severity
