"""The inter-token SLO's error budget, and how it changes the reading of an interval's gaps.

The gaps' target is a P99: 1 % of the gaps may run over it. :func:`excused_gap_share` and
:func:`gap_payback` read the last hour's share of gaps over the target; :func:`read_gaps` turns
them into the one :class:`GapReading` the moves and the reasons take, so that nothing rewrites the
interval's observations. Pure: nothing here reads a clock or the policy's memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.tuning.config import PolicyConfig
from batchpilot_operator.tuning.observations import Observations, known, share_above


def hour_gap_share(spec: BatchProfileSpec, obs: Observations, config: PolicyConfig) -> float | None:
    """The share of the last hour's gaps over the inter-token target; None without an inter-token
    target, a readable interval (unknown or saturated), the hour's histogram or enough gaps in it."""
    target_ms = spec.slo.inter_token_p99_ms
    if target_ms is None or obs.itl_p99_saturated or not known(obs.itl_p99_s) or not obs.itl_window_buckets:
        return None
    if obs.itl_window_buckets[-1][1] < config.gap_budget_min_gaps:
        return None
    share = share_above(target_ms / 1000.0, obs.itl_window_buckets)
    return share if known(share) else None


def excused_gap_share(spec: BatchProfileSpec, obs: Observations, config: PolicyConfig) -> float | None:
    """The share of the last hour's gaps over the inter-token target when this interval's gap P99
    is over that target but within what the error budget excuses (see ``PolicyConfig``); None
    when nothing is excused (within target, too far over, saturated, the budget spent, too few
    gaps in the hour, or no hour's histogram)."""
    share = hour_gap_share(spec, obs, config)
    if share is None or spec.slo.inter_token_p99_ms is None:
        return None
    target_s = spec.slo.inter_token_p99_ms / 1000.0
    if obs.itl_p99_s <= target_s:
        return None
    spent = min(1.0, share / config.gap_budget_share / config.gap_budget_aim)
    tolerance = config.gap_excuse_ratio + (1.0 - config.gap_excuse_ratio) * spent
    return share if obs.itl_p99_s * tolerance <= target_s else None


def gap_payback(spec: BatchProfileSpec, obs: Observations, config: PolicyConfig) -> tuple[float, float] | None:
    """``(share, factor)`` when the last hour spent more than the gaps' error budget: its share over
    the target, and the factor (over 1, at most ``gap_payback_max``) by which this interval's gap P99
    is read longer until the hour is back within budget; None otherwise."""
    share = hour_gap_share(spec, obs, config)
    if share is None or share <= config.gap_budget_share:
        return None
    return share, min(config.gap_payback_max, share / config.gap_budget_share)


@dataclass(frozen=True)
class GapReading:
    """The interval's inter-token P99 as the moves read it, beside its own figure, and why the two
    differ: ``"excused"`` (read at the target while the hour has budget left: no cut, no ceiling),
    ``"payback"`` (read ``factor`` longer while the hour is over budget), or ``"as_is"``."""

    p99_s: float  # as the moves read it
    own_p99_s: float  # the interval's own
    saturated: bool  # the interval's gap P99 lies in the top bucket (never excused nor paid back)
    why: Literal["as_is", "excused", "payback"] = "as_is"
    hour_share: float = math.nan  # the last hour's share of gaps over the target, when excused or paid back
    factor: float = 1.0  # how much longer a payback reads the gaps

    @property
    def named_p99_s(self) -> float:
        """The figure the reasons name: the interval's own when excused (the note then says what the
        budget excused), else the figure as read (the payback note names the interval's own)."""
        return self.own_p99_s if self.why == "excused" else self.p99_s


def read_gaps(spec: BatchProfileSpec, obs: Observations, config: PolicyConfig) -> GapReading:
    """The interval's gaps as the moves read them: at the target when the error budget excuses
    them (:func:`excused_gap_share`), longer while the hour is over budget (:func:`gap_payback`),
    else as observed."""
    own = obs.itl_p99_s
    target_ms = spec.slo.inter_token_p99_ms
    excused = excused_gap_share(spec, obs, config)
    if excused is not None and target_ms is not None:
        return GapReading(target_ms / 1000.0, own, obs.itl_p99_saturated, "excused", excused)
    payback = gap_payback(spec, obs, config)
    if payback is not None:
        share, factor = payback
        return GapReading(own * factor, own, obs.itl_p99_saturated, "payback", share, factor)
    return GapReading(own, own, obs.itl_p99_saturated)
