"""The policy's moves: pure functions from the window in force and one interval's reading to new
field values, each with the cause that :mod:`batchpilot_operator.tuning.reasons` puts in words.

Every move keeps the invariants of :mod:`batchpilot_operator.tuning.limits`: a field moves at
most one step per decision and stays within ``tuning.bounds``. Nothing here reads a clock or the
policy's memory; what a move needs of the memory (a ceiling, a confirmed streak) is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from batchpilot_operator.api.profile import BatchProfileSpec, Friendliness
from batchpilot_operator.tuning.friendliness import FriendlinessEstimate
from batchpilot_operator.tuning.limits import WAIT_MIN_STEP_MS, cap_floor, limit_ratio, limit_size, limit_wait
from batchpilot_operator.tuning.observations import Observations, known
from batchpilot_runtime.contract.window import Window

Direction = Literal["up", "down", "hold", "reset"]


@dataclass(frozen=True)
class PolicyConfig:
    """Constants of the policy (not part of the resource; tests and the simulator may vary them)."""

    min_samples: int = 20
    sparse_budget_min_gaps: float = 500.0  # gaps in the rate window that let a sparse interval raise the budget
    headroom_ratio: float = 0.6  # P99 below this share of the SLO is headroom
    up_confirm_intervals: int = 2  # headroom must last this many intervals before going up
    wait_min_change: float = 0.25  # with headroom, a smaller relative move of the wait is not worth a decision
    wait_raise_ratio: float = 0.85  # in the dead band, a far too short wait rises only under this share of the SLO
    dead_band_confirm_intervals: int = 4  # ... for this many intervals in a row (so close to the SLO, noise flips it)
    kv_soft_ratio: float = 0.9  # KV usage above this blocks every cap raise
    preemption_share_high: float = 0.01  # preemptions per arrival
    preemptions_per_s_high: float = 0.5
    kv_ceiling_calm_intervals: int = 20  # memory-calm intervals before the memory ceiling lifts
    wait_fill_margin: float = 1.5
    wait_slo_fraction: float = 0.1
    cap_reach_ratio: float = 0.7  # the running batch "reaches" the cap above this share of it
    cap_spare_factor: float = 4.0  # within the SLO the cap keeps this multiple of the running batch
    queue_bound_share: float = 0.25  # a queue this share of the cap (with the cap reached) is a backlog
    default_tail_ratio: float = 2.0
    tail_share_high: float = 0.2
    tail_share_low: float = 0.05
    step_slo_share: float = 0.2  # a decode step longer than this share of the SLO makes the cap a latency cause
    busy_share_no_wait: float = 0.5  # decoding this share of the time or more, a wait buys nothing
    itl_raise_ratio: float = 0.7  # the budget may rise only with the inter-token P99 under this share of its target
    itl_setpoint_ratio: float = 0.85  # ... and towards the budget that puts it at this share
    budget_ceiling_calm_intervals: int = 20  # gaps within target this long before the budget ceiling lifts
    budget_min_change: float = 0.05  # a smaller relative move of the budget is not worth a decision
    budget_raise_ttft_ratio: float = 0.5  # first tokens this close to their target ask for a larger budget
    # A raise for first tokens over target aims the gaps at most at this share of their target: close
    # to it, as the P99 over a day runs under that of its busy intervals (87 ms against 93-94 ms at
    # 100 ms on the Azure replay); at the target itself a raise after a x1.5 step-cost change
    # overshot and both tails took 9 intervals to recover, against 3 at 0.98.
    itl_raise_top_ratio: float = 0.98
    # The inter-token SLO's error budget: a P99 lets 1 % of the gaps run over. An interval whose gap
    # P99 is over its target by at most 1 / excuse_ratio (11 %) is not cut while the last hour has
    # spent little of that budget; the excuse narrows to nothing as the hour's share over the target
    # reaches budget_aim of the budget. The hour's P99 runs under the busy intervals' (87 ms against
    # 93-94 ms at 100 ms on the Azure replay), so strict per-interval cuts leave first tokens waiting
    # for room the SLO has. Only cuts are excused: raises read the interval as it is, so the budget
    # does not float up in calm intervals (an error budget that also relaxed raises took 11
    # intervals instead of 4 to recover from a x1.5 step-cost change).
    gap_budget_share: float = 0.01
    gap_excuse_ratio: float = 0.9
    gap_budget_aim: float = 0.8
    gap_budget_min_gaps: float = 1000.0  # fewer gaps in the hour: no excuse
    # An hour over budget is paid back: each interval's gap P99 is read longer by the hour's share
    # over the budget, at most this factor, so both moves aim the gaps a little lower until the hour
    # is back within 1 %. Interval gaps held just under target (raises stop at 98 % of it) still
    # spend more than 1 % over a day once a few bursts ran over (1.08 % on the steady day at 2 s /
    # 50 ms); a steeper factor (1.1, 1.2) cut budgets for the noisy share of the hour's first
    # minutes and left first tokens over instead.
    gap_payback_max: float = 1.05


DEFAULT_CONFIG = PolicyConfig()


# ---- what one interval's observations say ------------------------------------------------------


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
    target_ms = spec.slo.inter_token_p99_ms
    if target_ms is None:
        return math.nan
    if obs.itl_p99_saturated:
        return math.inf
    return obs.itl_p99_s * 1000.0 / target_ms if known(obs.itl_p99_s) else math.nan


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
    itl: float  # inter-token P99 over its target, the same way
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


def read(spec: BatchProfileSpec, obs: Observations, config: PolicyConfig) -> Reading:
    """The reading of ``obs`` against the spec's SLO."""
    ratio = latency_ratio(spec, obs)
    itl = itl_ratio(spec, obs)
    # The zones of target and wait follow the first-token objective, or the gaps when it is the only one.
    zone_ratio = ratio if spec.slo.p99_ms is not None else itl
    busy = busy_share(obs)
    return Reading(
        ratio=ratio,
        itl=itl,
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


def desired_wait_ms(spec: BatchProfileSpec, target: int, obs: Observations, config: PolicyConfig) -> float:
    """The wait that lets arrivals fill the gap between the running batch and the target.

    Unknown or zero arrival rate: the longest the bounds, the SLO budget and the profile's own
    wait allow. An engine that decodes most of the time: the shortest. Under continuous batching a
    held-back request joins a step that runs anyway, so the wait saves no step there and only adds
    its latency; it only merges prefills into one step when the engine would otherwise idle, which
    saves steps nobody waits for. So it never rises past the profile's own wait
    (:func:`wait_ceiling_ms`).
    """
    bound = spec.tuning.bounds.max_wait_ms
    busy = busy_share(obs)
    if known(busy) and busy >= config.busy_share_no_wait:
        return float(bound.min)
    budget_ms = wait_ceiling_ms(spec, config)
    running = obs.mean_batch_size if known(obs.mean_batch_size) else 0.0
    gap = max(1.0, target - running)
    rate = obs.arrival_rate_per_s
    if not known(rate) or rate <= 0:
        return max(float(bound.min), budget_ms)
    fill_ms = config.wait_fill_margin * gap / rate * 1000.0
    return max(float(bound.min), min(budget_ms, fill_ms))


def wait_ceiling_ms(spec: BatchProfileSpec, config: PolicyConfig) -> float:
    """The longest wait the policy moves to: the profile's own wait, within the bounds and never
    above ``wait_slo_fraction`` of a first-token target.

    A wait raised at light load is in force when the next burst comes, before the policy has seen
    the burst: there it delays every admission, and what it saved (prefills merged while the engine
    idled) no user waited for (issue 31: 20 -> 119 ms on a code-completion hour lost a fifth of the
    capacity of the profile's window held still). A wait above the profile's is for the profile to
    choose."""
    bound = spec.tuning.bounds.max_wait_ms
    ceiling = min(float(bound.max), float(max(bound.min, spec.window.max_wait_ms)))
    slo_ms = spec.slo.p99_ms
    return ceiling if slo_ms is None else max(float(bound.min), min(ceiling, config.wait_slo_fraction * slo_ms))


def fillable_target(obs: Observations, wait_ms: int, config: PolicyConfig) -> float:
    """Largest target the load reliably reaches within the wait: half the mean running batch (the
    running set dips below its mean half of the time) plus a third of the arrivals expected in the
    wait (with three times the needed arrivals expected, Poisson arrivals fill the gap before the
    wait fires at least 95 % of the time)."""
    running = obs.mean_batch_size if known(obs.mean_batch_size) else 0.0
    rate = obs.arrival_rate_per_s if known(obs.arrival_rate_per_s) else 0.0
    return max(1.0, 0.5 * running + rate * wait_ms / 1000.0 / (2 * config.wait_fill_margin))


# ---- the moves -------------------------------------------------------------------------------


def memory_move(spec: BatchProfileSpec, window: Window, reading: Reading) -> tuple[int, int]:
    """Target and cap under memory pressure: the cap below the running batch, the target within it."""
    bounds = spec.tuning.bounds
    fraction = spec.tuning.max_step_fraction
    cap, running = window.hard_cap, reading.running
    base = min(cap, math.ceil(running)) if known(running) and running >= 1 else cap
    new_cap = limit_size(cap, base * (1 - fraction / 2), fraction, cap_floor(bounds), bounds.hard_cap.max)
    return max(bounds.target_batch_size.min, min(window.target_batch_size, new_cap)), new_cap


CapCause = Literal["backlog", "slow_steps", "floor_gaps", "burst_room"]


@dataclass(frozen=True)
class CapMove:
    """The cap after one decision, and what moved it (None: nothing asked it to)."""

    cap: int
    cause: CapCause | None = None


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


TargetWaitCause = Literal["latency", "busy", "fill", "dead_band"]


@dataclass(frozen=True)
class TargetWaitMove:
    """Target and wait after one decision (the target before the cap limits it), and why."""

    target: int
    wait: int
    cause: TargetWaitCause | None = None  # None: neither asked to move
    want_ms: float = math.nan  # the dead band's aim for the wait
    lowered_to: int | None = None  # without a wait, the target brought down to what the batch fills

    @property
    def new_target(self) -> int:
        return self.target if self.lowered_to is None else self.lowered_to


def target_wait_move(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    reading: Reading,
    cap: int,
    estimate: FriendlinessEstimate | None,
    config: PolicyConfig,
    *,
    confirmed_headroom: bool,
    confirmed_under: bool,
) -> TargetWaitMove:
    """Target and wait: down at once when over, up on confirmed headroom as far as arrivals fill
    them, and in the dead band only a wait far from what arrivals need (a raise of it only once
    ``confirmed_under``). ``cap`` is this decision's cap."""
    if reading.over:
        move = _latency_move(spec, window, obs, reading, config)
    elif confirmed_headroom and reading.engine_busy:
        # A larger target would only be reached through a wait, and a wait buys nothing here.
        bound = spec.tuning.bounds.max_wait_ms
        wait = limit_wait(window.max_wait_ms, bound.min, spec.tuning.max_step_fraction, bound.min, bound.max)
        move = TargetWaitMove(window.target_batch_size, wait, "busy")
    elif confirmed_headroom:
        move = _fill_move(spec, window, obs, reading, cap, estimate, config)
    else:
        move = _dead_band_move(spec, window, obs, reading, confirmed_under, config)
    return _lower_unfilled_target(spec, window, obs, reading, move, config)


def _latency_move(
    spec: BatchProfileSpec, window: Window, obs: Observations, reading: Reading, config: PolicyConfig
) -> TargetWaitMove:
    bounds = spec.tuning.bounds
    fraction = spec.tuning.max_step_fraction
    target, wait = window.target_batch_size, window.max_wait_ms
    cut = latency_cut(fraction, reading)
    desired_wait = min(desired_wait_ms(spec, target, obs, config), wait * (1 - cut))
    new_wait = limit_wait(wait, desired_wait, fraction, bounds.max_wait_ms.min, bounds.max_wait_ms.max)
    new_target = target
    # With the running batch at or above the target every arrival is admitted at once: lowering a
    # target that holds nothing back would be a decision (and a push) that changes nothing.
    if not (known(reading.running) and reading.running >= target and new_wait <= bounds.max_wait_ms.min):
        tb = bounds.target_batch_size
        new_target = limit_size(target, target * (1 - cut), fraction, tb.min, tb.max)
    return TargetWaitMove(new_target, new_wait, "latency")


def _fill_move(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    reading: Reading,
    cap: int,
    estimate: FriendlinessEstimate | None,
    config: PolicyConfig,
) -> TargetWaitMove:
    bounds = spec.tuning.bounds
    fraction = spec.tuning.max_step_fraction
    target, wait = window.target_batch_size, window.max_wait_ms
    target_ceiling = min(cap, bounds.target_batch_size.max)
    if spec.batch_friendliness == Friendliness.AUTO and estimate is not None and estimate.knee_batch_size:
        target_ceiling = min(target_ceiling, max(estimate.knee_batch_size, bounds.target_batch_size.min))
    desired_target = min(target * (1 + fraction), fillable_target(obs, wait, config), target_ceiling)
    new_target, new_wait = target, wait
    if desired_target >= target + 1:
        new_target = limit_size(target, desired_target, fraction, bounds.target_batch_size.min, target_ceiling)
    if not (known(reading.running) and reading.running >= new_target):
        desired_wait = desired_wait_ms(spec, new_target, obs, config)
        fill_wait = limit_wait(wait, desired_wait, fraction, bounds.max_wait_ms.min, bounds.max_wait_ms.max)
        # The fill time follows the arrival rate's noise: a move smaller than that is not made,
        # or the wait would chase the noise up and down.
        if new_target != target or abs(fill_wait - wait) >= max(WAIT_MIN_STEP_MS, config.wait_min_change * wait):
            new_wait = fill_wait
    return TargetWaitMove(new_target, new_wait, "fill")


def _dead_band_move(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    reading: Reading,
    confirmed_under: bool,
    config: PolicyConfig,
) -> TargetWaitMove:
    bound = spec.tuning.bounds.max_wait_ms
    target, wait = window.target_batch_size, window.max_wait_ms
    want = desired_wait_ms(spec, target, obs, config)
    if known(reading.running) and reading.running >= target and not reading.engine_busy:
        want = wait  # every arrival is admitted at once: the wait never fires
    # The raise is confirmed like any other: with P99 noisy around the SLO, a cut on one interval
    # and a raise on the next would make the wait oscillate.
    if want < wait / 3 or (want > 3 * wait + WAIT_MIN_STEP_MS and confirmed_under):
        new_wait = limit_wait(wait, want, spec.tuning.max_step_fraction, bound.min, bound.max)
        return TargetWaitMove(target, new_wait, "busy" if reading.engine_busy else "dead_band", want_ms=want)
    return TargetWaitMove(target, wait)


def _lower_unfilled_target(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    reading: Reading,
    move: TargetWaitMove,
    config: PolicyConfig,
) -> TargetWaitMove:
    """Without a wait, a target above the running batch only turns admissions into timer
    admissions (a batch-hit ratio that says nothing): bring it to what the batch fills."""
    bounds = spec.tuning.bounds
    target_fills_itself = known(reading.running) and reading.running >= window.target_batch_size
    if reading.over or not reading.engine_busy or move.wait > bounds.max_wait_ms.min or target_fills_itself:
        return move
    fill = max(bounds.target_batch_size.min, math.floor(fillable_target(obs, move.wait, config)))
    tb = bounds.target_batch_size
    lowered = limit_size(move.target, fill, spec.tuning.max_step_fraction, tb.min, tb.max)
    if lowered >= move.target:
        return move
    return TargetWaitMove(move.target, move.wait, move.cause, move.want_ms, lowered)


def tail_ratio(spec: BatchProfileSpec, window: Window, new_wait: int, obs: Observations, config: PolicyConfig) -> float:
    """Raise the ratio when marking catches too many (marking too early marks everyone), up to the
    profile's own ratio; drift back towards the default when marking is rare again.

    A marked request is admitted at once, so a higher ratio only holds requests for the rest of the
    wait: it never shortens a latency, and a ratio raised at light load still holds them when the
    next burst comes (issue 31: 2 -> 4 on a code-completion hour). Past the profile's ratio it is
    the profile's to choose. Left alone with no wait: every queued request is then admitted at the
    next step that has room, oldest first, so marking changes nothing, and the share it reports only
    measures step length (the rolling P50 wait is half a step).
    """
    current = window.tail_mark_ratio
    share = obs.tail_marked_share
    bounds = spec.tuning.bounds
    if not known(share) or new_wait == 0:
        return current
    if share > config.tail_share_high:
        if current >= spec.window.tail_mark_ratio:
            return current
        desired = min(current + 0.25, spec.window.tail_mark_ratio)
    elif share < config.tail_share_low and current > config.default_tail_ratio:
        desired = max(config.default_tail_ratio, current - 0.25)
    else:
        return current
    fraction = spec.tuning.max_step_fraction
    return limit_ratio(current, desired, fraction, bounds.tail_mark_ratio.min, bounds.tail_mark_ratio.max)


def direction(moves: tuple[tuple[int, int], ...], over: bool) -> Direction | None:
    """ "up" when the window only grows, "down" when it only shrinks; a mixed move (the cap raised
    for a backlog while target and wait fall for latency) is named by what drives it: "down"
    while P99 is over the SLO, "up" otherwise. None when no size or wait field moved."""
    grew = any(new > old for old, new in moves)
    shrank = any(new < old for old, new in moves)
    if grew and shrank:
        return "down" if over else "up"
    if grew:
        return "up"
    if shrank:
        return "down"
    return None
