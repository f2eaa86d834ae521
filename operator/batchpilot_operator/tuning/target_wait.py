"""The moves of target and wait (and of the tail-mark ratio, which rides along with the wait):
down at once over the SLO, up on confirmed headroom as far as arrivals fill them, and the wait
towards what arrivals need.

Every move keeps the invariants of :mod:`batchpilot_operator.tuning.limits`: a field moves at most
one step per decision and stays within ``tuning.bounds``. Pure: what a move needs of the policy's
memory (a confirmed streak) is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from batchpilot_operator.api.profile import BatchProfileSpec, Friendliness
from batchpilot_operator.tuning.config import PolicyConfig
from batchpilot_operator.tuning.friendliness import FriendlinessEstimate
from batchpilot_operator.tuning.limits import WAIT_MIN_STEP_MS, limit_ratio, limit_size, limit_wait
from batchpilot_operator.tuning.observations import Observations, known
from batchpilot_operator.tuning.reading import Reading, busy_share, latency_cut
from batchpilot_runtime.contract.window import Window


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


TargetWaitCause = Literal["latency", "busy", "fill", "dead_band"]


@dataclass(frozen=True)
class TargetWaitMove:
    """Target and wait after one decision (the target before the cap limits it), and why."""

    target: int
    wait: int
    cause: TargetWaitCause | None = None  # None: neither asked to move
    want_ms: float = math.nan  # the dead band's aim for the wait
    lowered_to: int | None = None  # without a wait, the target brought down to what the batch fills
    reason: str = ""  # what the move does and why, as the decision's reason says it

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
    move = _lower_unfilled_target(spec, window, obs, reading, move, config)
    return replace(move, reason=_said(window, reading, move))


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


def _said(window: Window, reading: Reading, move: TargetWaitMove) -> str:
    """What ``move`` does and why, as the decision's reason says it."""
    busy_why = f"the engine decodes {reading.busy:.0%} of the time, so a held request would only join a later step"
    text = ""
    if move.cause == "latency":
        text = "lowering wait and target" if move.target != window.target_batch_size else "lowering the wait"
    elif move.cause == "busy":
        text = f"dropping the wait ({busy_why})"
    elif move.cause == "fill":
        # Say what moved: with a larger target the fill time can still ask for a shorter wait.
        moved = [
            f"{'raising' if new > old else 'lowering'} the {name} to {new}{unit}"
            for name, old, new, unit in (
                ("target", window.target_batch_size, move.target, ""),
                ("wait", window.max_wait_ms, move.wait, " ms"),
            )
            if new != old
        ]
        text = f"{' and '.join(moved)}, as far as arrivals fill them"
    elif move.cause == "dead_band":
        text = f"moving the wait towards {move.want_ms:.0f} ms, the time arrivals take to fill the target"
    if move.lowered_to is not None:
        lowered = f"lowering the target to {move.lowered_to}, what the running batch fills"
        text = "; ".join(p for p in (text, lowered) if p)
    return text


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
