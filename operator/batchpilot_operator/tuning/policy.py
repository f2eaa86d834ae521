"""The tuning policy: (spec, window in force, observations, state, now) -> decision.

How it works
------------

Every ``intervalSeconds`` the policy reads the P99 of the SLO's latency metric and
compares it with ``slo.p99Ms``. It first refuses to act on what it cannot trust: NaN
quantiles (no traffic is *unknown*, not fast), fewer than ``min_samples`` (20) latency
observations in the rate window, or a decision inside ``cooldownSeconds`` of the last
change all give *hold*. A P99 that lies in the top finite histogram bucket (or beyond)
is *saturated*: its value is only a lower bound, so it counts as "far over" the SLO.

Memory comes first. When sequences are being preempted (KV cache exhausted mid-decode:
recomputation wastes the GPU and stalls the victims) the policy lowers the **cap**
below the running batch and remembers it as a ceiling that lifts one step at a time
only after 20 calm intervals; while KV usage is above 90 % the cap is never raised.
Otherwise the P99-to-SLO ratio falls in one of three zones: **over** (P99 > SLO),
**headroom** (P99 < 60 % of the SLO) and the **dead band** in between, where nothing
but a badly wrong wait (off by 3x) is touched, and a too-short one only after four intervals
under 85 % of the SLO. That band, plus a two-interval confirmation before any step up of
target and wait, and no wait move under 25 % with headroom (the fill time follows the
arrival rate's noise), is the hysteresis that keeps noise around the SLO from making it
flap: over 200 intervals of noise around the SLO no field flaps (test_policy_noise.py).

The cap is a throughput lever first. A backlog the running batch cannot absorb (the
batch at >= 70 % of the cap and a queue of a quarter of the cap or more) raises the cap
by one step whatever P99 says, since a smaller batch would only grow the queue. Within
the SLO (dead band included) the cap is kept at four times the running batch, so that
a burst finds free slots (a spare slot costs nothing until it is used), up to the
ceiling set by the friendliness class (``low`` 32, ``medium`` 128, ``high`` the bounds;
in ``auto`` the class measured from step time per batch size). The cap goes *down* for
latency only when P99 is over, the queue is short, and a decode step at the current
batch takes more than a fifth of the SLO: then the batch itself is what is slow. So,
all else equal, a worse P99 never yields a larger cap than a better one (monotone).

Target and wait trade latency for fuller batches. Over the SLO both step down at once,
by a fraction of ``maxStepFraction`` that grows with the overshoot (all of it when
saturated). With confirmed headroom the target rises as far as the load reliably
fills it (half the running batch plus a third of the arrivals expected within the wait,
so that admissions fire on the target rather than on the timer), never past the
measured knee in ``auto`` mode, where throughput stops growing with the batch. The
wait follows the arrival rate: 1.5x the time arrivals take to fill the gap between
the running batch and the target, so short under heavy load and longer (up to the
bound) under light load, never above a tenth of the SLO (a wait is latency spent for
sure), and left alone when the running batch already exceeds the target (then every
arrival is admitted at once and the wait never fires). The tail-mark ratio stays at
2.0 unless more than a fifth of admissions get marked (marking too early marks
everyone): then it rises by 0.25, and drifts back when marking becomes rare; it only
moves together with another field, never as a decision of its own, and not
at all when the new window has no wait (every queued request is then admitted
at the next step with room, oldest first, so marking changes nothing).

A wait only pays while the engine would otherwise idle. Under continuous batching
a request held back while sequences decode joins a step that runs anyway: it saves
no step and spends its latency (on the benchmark's trace at load x0.3, waits of up to
100 ms left the number of steps unchanged within 0.003 % and raised P99 from 0.42 s
to 0.55 s). So when the engine decodes half of the time or more (generated tokens per
second over the mean batch is decode steps per second; times the step time at that
batch, busy time), the wait goes to its lower bound, with no confirmation needed since
that only shortens latency, and a target the running batch does not reach comes down
to what it fills, so that admissions still fire on the target. The arrival-following
wait above is for an engine that idles between requests.

The prompt-token budget per step (``maxPrefillTokens``) is the lever between the two tails an
iteration-level engine trades: a long prompt prefilled in one step stalls every decode of that
step (inter-token gap), a small budget spreads it over many steps (first token later). It moves
only for an SLO with ``interTokenP99Ms``, and by the ratio of each P99 to its target: the gap
grows about linearly with a step's prompt tokens and a queue's first-token delay about
inversely, so sqrt(TTFT ratio / gap ratio) is the move that balances the two. Over the
inter-token target the budget comes down at once towards the budget that puts the gap at 85 %
of its target, but no further than the balance when first tokens are tight too, and not at all
when they are further over than the gaps (a cut would move the pain to the worse tail); when it
is already at its lower bound and the batch is at its cap, the cap comes down instead (the
decode part of a step grows with the batch). A cut also sets a ceiling: the budget does not rise
past it again until the gaps have stayed within target for 20 intervals, then by one step at a
time (as the memory ceiling of the cap does), because the gap's P99 is set by the longest
prompts, which a raise only meets at the next burst. The budget rises when the gaps are under
70 % of their target while first tokens are past their headroom (towards the 85 % point), or
when first tokens are over while the gaps are within target (towards the balance, never past
95 % of the gap target), by at most the step limit and never past the ceiling. A move under 5 %
is not made. Otherwise it holds: a budget raised while nothing contends would only show its cost
at the next burst. An unset budget (whole prompts) counts as the top of its bounds.

An SLO may also state the inter-token target alone (no ``p99Ms``). Then the gaps take the place
of the P99 above wherever it decides alone: the data gate, headroom and the dead band; nothing
is "over" for first tokens (no target and wait cuts, no latency cut of the cap for slow steps, no
balance limiting a budget cut), and the budget rises, within the same ceiling, when the gaps are
under 70 % of their target while prompts wait in the queue.

Every field moves at most ``maxStepFraction`` of its value per decision (or one unit
--- one sequence, 5 ms, 0.1 --- when that is larger, so that a field at 0 or 1 can
move at all), every field stays within ``tuning.bounds``, and target <= cap always.
A window in force that lies outside the bounds (the bounds were edited) is clamped
into them at once: bounds win over the step limit and the cooldown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from batchpilot_operator.api.profile import BatchProfileSpec, Friendliness, WindowBounds
from batchpilot_operator.tuning.friendliness import CLASS_CAP_CEILING, FriendlinessEstimate, measure, merge_curve
from batchpilot_operator.tuning.observations import Observations, known
from batchpilot_runtime.contract.window import Window

Direction = Literal["up", "down", "hold", "reset"]

WAIT_MIN_STEP_MS = 5
RATIO_MIN_STEP = 0.1
SIZE_MIN_STEP = 1


@dataclass(frozen=True)
class PolicyConfig:
    """Constants of the policy (not part of the resource; tests and the simulator may vary them)."""

    min_samples: int = 20
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
    budget_raise_ttft_ratio: float = 0.6  # first tokens this close to their target ask for a larger budget


DEFAULT_CONFIG = PolicyConfig()


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between intervals: in the operator's memory, and in the resource's
    ``status.policy`` (:mod:`batchpilot_operator.tuning.policy_memo`) so that a restart continues."""

    last_change_s: float | None = None
    headroom_streak: int = 0
    under_streak: int = 0  # intervals in a row under wait_raise_ratio of the SLO (and gaps within target)
    calm_streak: int = 0
    kv_cap_ceiling: int | None = None
    budget_ceiling: int | None = None  # the budget a too-long gap last brought it down to
    itl_calm_streak: int = 0
    step_curve: tuple[tuple[int, float], ...] = ()
    decisions: int = 0


@dataclass(frozen=True)
class Decision:
    """A policy outcome: the window to put in force (the same one on hold), and why."""

    window: Window
    direction: Direction
    reason: str
    state: PolicyState
    friendliness: FriendlinessEstimate | None = field(default=None)

    @property
    def changed(self) -> bool:
        return self.direction in ("up", "down", "reset")


def allowed_step(old: float, fraction: float, min_step: float) -> float:
    """Largest change of a field in one decision: ``fraction`` of it, or ``min_step``."""
    return max(abs(old) * fraction, min_step)


def _limit_int(old: int, desired: float, fraction: float, lo: int, hi: int) -> int:
    step = allowed_step(old, fraction, SIZE_MIN_STEP)
    if desired > old:
        value = min(math.floor(desired), math.floor(old + step))
    else:
        value = max(math.ceil(desired), math.ceil(old - step))
    return max(lo, min(hi, value))


def _limit_wait(old: int, desired: float, fraction: float, lo: int, hi: int) -> int:
    step = allowed_step(old, fraction, WAIT_MIN_STEP_MS)
    if desired > old:
        value = min(math.floor(desired), math.floor(old + step))
    else:
        value = max(math.ceil(desired), math.ceil(old - step))
    return max(lo, min(hi, value))


def _limit_ratio(old: float, desired: float, fraction: float, lo: float, hi: float) -> float:
    step = allowed_step(old, fraction, RATIO_MIN_STEP)
    value = min(desired, old + step) if desired > old else max(desired, old - step)
    # Rounded for a readable status, then clamped so that rounding cannot step outside the bounds.
    return max(lo, min(hi, round(value, 3)))


def _clamp_into_bounds(window: Window, bounds: WindowBounds) -> Window:
    cap = bounds.hard_cap.clamp(window.hard_cap)
    cap = max(cap, bounds.target_batch_size.min)
    target = min(bounds.target_batch_size.clamp(window.target_batch_size), cap)
    return window.model_copy(
        update={
            "target_batch_size": target,
            "hard_cap": cap,
            "max_wait_ms": bounds.max_wait_ms.clamp(window.max_wait_ms),
            "tail_mark_ratio": bounds.tail_mark_ratio.clamp(window.tail_mark_ratio),
            "max_prefill_tokens": (
                None
                if window.max_prefill_tokens is None
                else bounds.max_prefill_tokens.clamp(window.max_prefill_tokens)
            ),
        }
    )


def _lift_ceiling(ceiling: int | None, streak: int, needed: int, fraction: float, top: int) -> tuple[int | None, int]:
    """A ceiling one step higher once ``streak`` calm intervals reach ``needed`` (the streak then
    restarts); gone once it reaches ``top``. Returns the ceiling and the streak."""
    if ceiling is None or streak < needed:
        return ceiling, streak
    lifted = math.floor(ceiling + allowed_step(ceiling, fraction, SIZE_MIN_STEP))
    return (None if lifted >= top else lifted), 0


def cap_ceiling(spec: BatchProfileSpec, estimate: FriendlinessEstimate | None, state: PolicyState) -> int:
    """Highest cap the policy may choose now: bounds, friendliness class, memory ceiling."""
    ceiling = spec.tuning.bounds.hard_cap.max
    friendliness = spec.batch_friendliness
    if friendliness == Friendliness.AUTO:
        measured = estimate.measured_class if estimate is not None else None
        friendliness = measured or Friendliness.MEDIUM
    ceiling = min(ceiling, CLASS_CAP_CEILING[friendliness])
    if state.kv_cap_ceiling is not None:
        ceiling = min(ceiling, state.kv_cap_ceiling)
    return max(ceiling, spec.tuning.bounds.hard_cap.min, spec.tuning.bounds.target_batch_size.min)


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


def desired_wait_ms(spec: BatchProfileSpec, target: int, obs: Observations, config: PolicyConfig) -> float:
    """The wait that lets arrivals fill the gap between the running batch and the target.

    Unknown or zero arrival rate: the longest the bounds and the SLO budget allow. An engine
    that decodes most of the time: the shortest. Under continuous batching a held-back request
    joins a step that runs anyway, so the wait saves no step there and only adds its latency
    (measured on the benchmark's trace at load x0.3: the same steps within 0.003 %, P99
    0.42 s -> 0.55 s); it only merges prefills into one step when the engine would otherwise idle.
    """
    bound = spec.tuning.bounds.max_wait_ms
    busy = busy_share(obs)
    if known(busy) and busy >= config.busy_share_no_wait:
        return float(bound.min)
    slo_ms = spec.slo.p99_ms
    # Without a latency objective of its own, the wait is only bounded by the bounds.
    budget_ms = float(bound.max) if slo_ms is None else min(float(bound.max), config.wait_slo_fraction * slo_ms)
    running = obs.mean_batch_size if known(obs.mean_batch_size) else 0.0
    gap = max(1.0, target - running)
    rate = obs.arrival_rate_per_s
    if not known(rate) or rate <= 0:
        return max(float(bound.min), budget_ms)
    fill_ms = config.wait_fill_margin * gap / rate * 1000.0
    return max(float(bound.min), min(budget_ms, fill_ms))


def _memory_pressure(obs: Observations, config: PolicyConfig) -> str | None:
    if known(obs.preemptions_per_s) and obs.preemptions_per_s > 0:
        per_arrival = (
            obs.preemptions_per_s / obs.arrival_rate_per_s
            if known(obs.arrival_rate_per_s) and obs.arrival_rate_per_s > 0
            else math.inf
        )
        if obs.preemptions_per_s >= config.preemptions_per_s_high or per_arrival >= config.preemption_share_high:
            return f"{obs.preemptions_per_s:.2g} preemptions/s"
    return None


def step_time_s(obs: Observations) -> float:
    """Mean decode step time at the running batch's size (the nearest measured bucket at or above it)."""
    if not obs.step_s_by_batch:
        return math.nan
    running = obs.mean_batch_size if known(obs.mean_batch_size) else 1.0
    at_or_above = [b for b in obs.step_s_by_batch if b >= running]
    bucket = min(at_or_above) if at_or_above else max(obs.step_s_by_batch)
    return obs.step_s_by_batch[bucket]


def _tail_ratio(
    window: Window, new_wait: int, obs: Observations, fraction: float, bounds: WindowBounds, config: PolicyConfig
) -> float:
    """Raise the ratio when marking catches too many (marking too early marks everyone); drift back
    towards the default when marking is rare again.

    Left alone with no wait: every queued request is then admitted at the next step that has room,
    oldest first, so marking changes nothing, and the share it reports only measures step length
    (the rolling P50 wait is half a step; at load x0.64 it drove the ratio to its bound).
    """
    current = window.tail_mark_ratio
    share = obs.tail_marked_share
    if not known(share) or new_wait == 0:
        return current
    if share > config.tail_share_high:
        desired = current + 0.25
    elif share < config.tail_share_low and current > config.default_tail_ratio:
        desired = max(config.default_tail_ratio, current - 0.25)
    else:
        return current
    return _limit_ratio(current, desired, fraction, bounds.tail_mark_ratio.min, bounds.tail_mark_ratio.max)


@dataclass(frozen=True)
class BudgetMove:
    """The prompt-token budget after one decision, and why (empty when it holds)."""

    budget: int | None
    why: str = ""
    itl_over: bool = False


def latency_ratio(spec: BatchProfileSpec, obs: Observations) -> float:
    """P99 of the SLO's latency metric over ``slo.p99Ms`` (inf when saturated; NaN without a
    target or data)."""
    target_ms = spec.slo.p99_ms
    if target_ms is None:
        return math.nan
    if obs.p99_saturated:
        return math.inf
    return obs.p99_s * 1000.0 / target_ms if known(obs.p99_s) else math.nan


def slo_over(spec: BatchProfileSpec, obs: Observations) -> bool | None:
    """Whether any P99 objective of the SLO is over its target; None when none of them has data."""
    ratios = [r for r in (latency_ratio(spec, obs), itl_ratio(spec, obs)) if not math.isnan(r)]
    return any(r > 1.0 for r in ratios) if ratios else None


def itl_ratio(spec: BatchProfileSpec, obs: Observations) -> float:
    """Inter-token P99 over its target (inf when saturated; NaN without a target or data)."""
    target_ms = spec.slo.inter_token_p99_ms
    if target_ms is None:
        return math.nan
    if obs.itl_p99_saturated:
        return math.inf
    return obs.itl_p99_s * 1000.0 / target_ms if known(obs.itl_p99_s) else math.nan


def budget_move(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    ttft_ratio: float,
    config: PolicyConfig,
    ceiling: int | None = None,
) -> BudgetMove:
    """The budget from the two tails: see the module docstring. ``ttft_ratio`` is NaN when the SLO
    has no first-token objective: then nothing limits a cut, and a raise needs a queue instead."""
    budget = window.max_prefill_tokens
    ratio = itl_ratio(spec, obs)
    if math.isnan(ratio):
        return BudgetMove(budget)
    bound = spec.tuning.bounds.max_prefill_tokens
    fraction = spec.tuning.max_step_fraction
    current = bound.max if budget is None else budget
    itl_text = (
        "inter-token P99 beyond the top bucket"
        if math.isinf(ratio)
        else f"inter-token P99 {obs.itl_p99_s * 1000:.0f} ms"
    )
    target_text = f"{spec.slo.inter_token_p99_ms:.0f} ms"
    top = bound.max if ceiling is None else max(bound.min, min(bound.max, ceiling))
    # The gap grows about linearly with a step's prompt tokens and the first-token delay of a
    # queue about inversely: sqrt(TTFT ratio / gap ratio) is the move that would balance the two.
    # Without a first-token objective nothing holds a cut back (balance 0).
    first_tokens = not math.isnan(ttft_ratio)
    balance = math.sqrt(ttft_ratio / ratio) if first_tokens and ratio > 0 else (math.inf if first_tokens else 0.0)
    if ratio > 1.0:
        # Aim the gap at the setpoint, but not past the balance when first tokens are tight too.
        factor = 1.0 - fraction if math.isinf(ratio) else max(config.itl_setpoint_ratio / ratio, balance)
        if factor > 1.0 - config.budget_min_change:
            # First tokens at least as far over: a cut would only move the pain to the worse tail.
            return BudgetMove(budget, itl_over=True)
        new = _limit_int(current, current * factor, fraction, bound.min, bound.max)
        if new == budget:
            return BudgetMove(budget, itl_over=True)
        why = f"lowering the prefill budget to {new} tokens ({itl_text} over its {target_text} target)"
        return BudgetMove(new, why, itl_over=True)
    if budget is None:
        return BudgetMove(budget)
    # Without a first-token objective, prompts waiting in the queue are what asks for a larger budget.
    first_tokens_wait = (
        ttft_ratio > config.budget_raise_ttft_ratio
        if first_tokens
        else known(obs.queue_depth) and obs.queue_depth >= 1.0
    )
    if ratio < config.itl_raise_ratio and first_tokens_wait:
        factor = min(1 + fraction, config.itl_setpoint_ratio / max(ratio, 1e-3))
    elif ttft_ratio > 1.0:
        # First tokens over, gaps within target but close: balance, never past the gap target.
        factor = min(balance, 0.95 / ratio)
    else:
        return BudgetMove(budget)
    if factor < 1.0 + config.budget_min_change:
        return BudgetMove(budget)
    new = _limit_int(current, current * factor, fraction, bound.min, top)
    if new <= budget:
        return BudgetMove(budget)
    need = "first tokens need it" if first_tokens else f"{obs.queue_depth:.0f} prompts wait"
    why = f"raising the prefill budget to {new} tokens ({need}; {itl_text} leaves room under {target_text})"
    return BudgetMove(new, why)


def decide(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    state: PolicyState,
    now_s: float,
    config: PolicyConfig = DEFAULT_CONFIG,
) -> Decision:
    """One tuning decision. Pure: same inputs, same decision."""
    bounds = spec.tuning.bounds
    fraction = spec.tuning.max_step_fraction
    has_ttft = spec.slo.p99_ms is not None
    slo_s = spec.slo.p99_ms / 1000.0 if spec.slo.p99_ms is not None else math.nan

    # 1. Fold this interval's step times into the friendliness curve (whatever else happens).
    curve = merge_curve(state.step_curve, obs.step_s_by_batch)
    estimate = measure(dict(curve)) if curve else None
    state = replace(state, step_curve=curve, decisions=state.decisions + 1)

    def hold(reason: str, new_state: PolicyState) -> Decision:
        return Decision(window, "hold", reason, new_state, estimate)

    # 2. Bounds win over everything, including the cooldown.
    if bounds.fields_outside(window) or window.target_batch_size > window.hard_cap:
        clamped = _clamp_into_bounds(window, bounds).with_generation(window.generation + 1)
        return Decision(
            clamped,
            "reset",
            f"The window in force ({window.describe()}) lay outside tuning.bounds; clamped into them.",
            replace(state, last_change_s=now_s, headroom_streak=0),
            estimate,
        )

    # 3. Refuse to act on what cannot be trusted.
    # NaN where the SLO has no such objective (the other one then decides alone) or no data.
    ratio = latency_ratio(spec, obs)
    itl = itl_ratio(spec, obs)
    if math.isnan(ratio if has_ttft else itl):
        what = "latency" if has_ttft else "inter-token"
        return hold(
            f"No {what} data this interval (no traffic or no series); holding.", replace(state, headroom_streak=0)
        )
    if not known(obs.samples) or obs.samples < config.min_samples:
        samples = "an unknown number of" if not known(obs.samples) else f"{obs.samples:.0f}"
        return hold(
            f"Too sparse: P99 rests on {samples} requests (< {config.min_samples}); holding.",
            replace(state, headroom_streak=0),
        )
    saturated = obs.p99_saturated
    if spec.slo.p99_ms is not None:
        p99_text = (
            f"P99 beyond {obs.p99_s * 1000:.0f} ms (top bucket)" if saturated else f"P99 {obs.p99_s * 1000:.0f} ms"
        )
        slo_text = f"SLO {spec.slo.p99_ms:.0f} ms"
    else:
        p99_text = (
            "inter-token P99 beyond the top bucket"
            if obs.itl_p99_saturated
            else f"inter-token P99 {obs.itl_p99_s * 1000:.0f} ms"
        )
        slo_text = f"its {spec.slo.inter_token_p99_ms:.0f} ms target"

    pressure = _memory_pressure(obs, config)
    calm = pressure is None and not (known(obs.kv_usage_ratio) and obs.kv_usage_ratio >= config.kv_soft_ratio)
    calm_streak = state.calm_streak + 1 if calm else 0
    # Memory calm for a while: the cap may climb one more step.
    kv_ceiling, calm_streak = _lift_ceiling(
        state.kv_cap_ceiling, calm_streak, config.kv_ceiling_calm_intervals, fraction, bounds.hard_cap.max
    )
    over = ratio > 1.0
    itl_over = itl > 1.0
    # The zones of target and wait follow the first-token objective, or the gaps when it is the only one.
    zone_ratio = ratio if has_ttft else itl
    headroom = zone_ratio < config.headroom_ratio and not itl_over
    headroom_streak = state.headroom_streak + 1 if headroom and pressure is None else 0
    under_streak = state.under_streak + 1 if zone_ratio < config.wait_raise_ratio and not itl_over else 0
    # The same for the budget: a gap over its target sets a ceiling, lifted a step after calm.
    itl_calm_streak = state.itl_calm_streak + 1 if itl <= 1.0 else 0
    budget_ceiling, itl_calm_streak = _lift_ceiling(
        state.budget_ceiling,
        itl_calm_streak,
        config.budget_ceiling_calm_intervals,
        fraction,
        bounds.max_prefill_tokens.max,
    )
    state = replace(
        state,
        calm_streak=calm_streak,
        kv_cap_ceiling=kv_ceiling,
        headroom_streak=headroom_streak,
        under_streak=under_streak,
        budget_ceiling=budget_ceiling,
        itl_calm_streak=itl_calm_streak,
    )

    if state.last_change_s is not None and now_s - state.last_change_s < spec.tuning.cooldown_seconds:
        left = spec.tuning.cooldown_seconds - (now_s - state.last_change_s)
        return hold(f"{p99_text} vs {slo_text}, but in cooldown for {left:.0f} s more; holding.", state)

    target, cap, wait = window.target_batch_size, window.hard_cap, window.max_wait_ms
    budget = budget_move(spec, window, obs, ratio, config, state.budget_ceiling)
    if budget.itl_over and budget.budget is not None:
        # Raises stop below what was too much, until the gaps have been calm for a while.
        state = replace(state, budget_ceiling=budget.budget, itl_calm_streak=0)
    cap_floor = max(bounds.hard_cap.min, bounds.target_batch_size.min)
    running = obs.mean_batch_size if known(obs.mean_batch_size) else math.nan
    queue = obs.queue_depth if known(obs.queue_depth) else 0.0

    # 4. Memory pressure: lower the cap and remember it as a ceiling.
    if pressure is not None:
        base = min(cap, math.ceil(running)) if known(running) and running >= 1 else cap
        new_cap = _limit_int(cap, base * (1 - fraction / 2), fraction, cap_floor, bounds.hard_cap.max)
        new_target = max(bounds.target_batch_size.min, min(target, new_cap))
        state = replace(state, kv_cap_ceiling=new_cap, calm_streak=0, headroom_streak=0)
        return _change(
            window,
            new_target,
            new_cap,
            wait,
            window.tail_mark_ratio,
            "down",
            f"{pressure}: lowering the cap to {new_cap} (and not raising it again until memory is calm).",
            state,
            now_s,
            estimate,
        )

    # 5. The cap: throughput when the backlog needs it, step time when the batch itself is slow.
    ceiling = cap_ceiling(spec, estimate, state)
    soft_full = known(obs.kv_usage_ratio) and obs.kv_usage_ratio >= config.kv_soft_ratio
    cap_reached = known(running) and running >= config.cap_reach_ratio * cap
    queue_bound = cap_reached and queue >= max(2.0, config.queue_bound_share * cap)
    confirmed_headroom = headroom and headroom_streak >= config.up_confirm_intervals
    severity = 1.0 if saturated else min(1.0, max(0.3, ratio - 1.0))
    cut = fraction * severity
    new_cap = cap
    cap_why = ""
    slow_steps = over and step_time_s(obs) > config.step_slo_share * slo_s
    budget_floor = bounds.max_prefill_tokens.min
    floor_gaps = itl_over and (window.max_prefill_tokens or bounds.max_prefill_tokens.max) <= budget_floor
    if queue_bound and not soft_full and cap < ceiling:
        # A backlog that the running batch cannot absorb is a throughput problem, whatever P99 says.
        new_cap = _limit_int(cap, cap * (1 + fraction), fraction, cap_floor, min(ceiling, bounds.hard_cap.max))
        cap_why = f"raising the cap to {new_cap} ({queue:.0f} waiting with the batch at its cap)"
    elif cap_reached and not queue_bound and (slow_steps or floor_gaps):
        # The cap comes down for latency when the batch itself is slow: steps too long for the TTFT
        # SLO, or gaps too long with the budget already at its floor (what is left of a step is the
        # batch's decode). Both read the window in force, not this decision's other moves, and the
        # deeper cut wins, so that a worse first-token P99 never leaves a larger cap.
        cap_cuts: list[tuple[int, str]] = []
        if slow_steps:
            ttft_cap = _limit_int(cap, cap * (1 - cut), fraction, cap_floor, bounds.hard_cap.max)
            cap_cuts.append(
                (ttft_cap, f"steps of {step_time_s(obs) * 1000:.0f} ms at this batch are too long for the SLO")
            )
        if floor_gaps:
            itl_cut = fraction * (1.0 if math.isinf(itl) else min(1.0, max(0.3, itl - 1.0)))
            itl_cap = _limit_int(cap, cap * (1 - itl_cut), fraction, cap_floor, bounds.hard_cap.max)
            cap_cuts.append((itl_cap, "the prefill budget is at its floor and gaps are still too long"))
        new_cap, why = min(cap_cuts)
        cap_why = f"lowering the cap to {new_cap} ({why})"
    elif (
        not over
        and not itl_over
        and known(running)
        and running * config.cap_spare_factor > cap
        and not soft_full
        and cap < ceiling
    ):
        # Within the SLO the cap keeps room for a burst of a few times the running batch: a spare
        # slot costs nothing until it is used, and a missing one turns the next burst into a queue.
        new_cap = _limit_int(
            cap, running * config.cap_spare_factor, fraction, cap_floor, min(ceiling, bounds.hard_cap.max)
        )
        cap_why = f"raising the cap to {new_cap} (room for a burst over the running batch of {running:.0f})"

    # 6. Target and wait: down at once when over, up on confirmed headroom as far as arrivals fill it.
    new_target, new_wait = target, wait
    target_why = ""
    # With the running batch at or above the target every arrival is admitted at once: the wait never fires.
    target_fills_itself = known(running) and running >= target
    busy = busy_share(obs)
    engine_busy = known(busy) and busy >= config.busy_share_no_wait
    busy_why = f"the engine decodes {busy:.0%} of the time, so a held request would only join a later step"
    if over:
        new_wait = _limit_wait(
            wait,
            min(desired_wait_ms(spec, target, obs, config), wait * (1 - cut)),
            fraction,
            bounds.max_wait_ms.min,
            bounds.max_wait_ms.max,
        )
        if not (target_fills_itself and new_wait <= bounds.max_wait_ms.min):
            # A target the running batch already exceeds holds nothing back: lowering it would be a
            # decision (and a push) that changes nothing.
            new_target = _limit_int(
                target, target * (1 - cut), fraction, bounds.target_batch_size.min, bounds.target_batch_size.max
            )
        target_why = "lowering wait and target" if new_target != target else "lowering the wait"
    elif confirmed_headroom and engine_busy:
        # A larger target would only be reached through a wait, and a wait buys nothing here.
        new_wait = _limit_wait(wait, bounds.max_wait_ms.min, fraction, bounds.max_wait_ms.min, bounds.max_wait_ms.max)
        target_why = f"dropping the wait ({busy_why})"
    elif confirmed_headroom:
        target_ceiling = min(new_cap, bounds.target_batch_size.max)
        if spec.batch_friendliness == Friendliness.AUTO and estimate is not None and estimate.knee_batch_size:
            target_ceiling = min(target_ceiling, max(estimate.knee_batch_size, bounds.target_batch_size.min))
        desired_target = min(target * (1 + fraction), _fillable_target(obs, wait, config), target_ceiling)
        if desired_target >= target + 1:
            new_target = _limit_int(target, desired_target, fraction, bounds.target_batch_size.min, target_ceiling)
        if not (known(running) and running >= new_target):
            fill_wait = _limit_wait(
                wait,
                desired_wait_ms(spec, new_target, obs, config),
                fraction,
                bounds.max_wait_ms.min,
                bounds.max_wait_ms.max,
            )
            # The fill time follows the arrival rate's noise: a move smaller than that is not made,
            # or the wait would chase the noise up and down.
            if new_target != target or abs(fill_wait - wait) >= max(WAIT_MIN_STEP_MS, config.wait_min_change * wait):
                new_wait = fill_wait
        # Say what moved: with a larger target the fill time can still ask for a shorter wait.
        moved = [
            f"{'raising' if new > old else 'lowering'} the {name} to {new}{unit}"
            for name, old, new, unit in (("target", target, new_target, ""), ("wait", wait, new_wait, " ms"))
            if new != old
        ]
        target_why = f"{' and '.join(moved)}, as far as arrivals fill them"
    else:
        # Dead band: only a wait far from what the arrival rate needs is moved.
        want = desired_wait_ms(spec, target, obs, config)
        if target_fills_itself and not engine_busy:
            want = wait
        # The raise is confirmed like any other: with P99 noisy around the SLO, a cut on one interval
        # and a raise on the next would make the wait oscillate.
        confirmed_under = under_streak >= config.dead_band_confirm_intervals
        if want < wait / 3 or (want > 3 * wait + WAIT_MIN_STEP_MS and confirmed_under):
            new_wait = _limit_wait(wait, want, fraction, bounds.max_wait_ms.min, bounds.max_wait_ms.max)
            target_why = (
                f"dropping the wait ({busy_why})"
                if engine_busy
                else f"moving the wait towards {want:.0f} ms, the time arrivals take to fill the target"
            )
    if not over and engine_busy and new_wait <= bounds.max_wait_ms.min and not target_fills_itself:
        # Without a wait, a target above the running batch only turns admissions into timer
        # admissions (a batch-hit ratio that says nothing): bring it to what the batch fills.
        fill = max(bounds.target_batch_size.min, math.floor(_fillable_target(obs, new_wait, config)))
        lowered = _limit_int(new_target, fill, fraction, bounds.target_batch_size.min, bounds.target_batch_size.max)
        if lowered < new_target:
            new_target = lowered
            target_why = "; ".join(
                p for p in (target_why, f"lowering the target to {lowered}, what the running batch fills") if p
            )
    new_target = min(new_target, new_cap)
    # The tail ratio only rides along with another change: on its own it would be a decision
    # (and a push) for a second-order knob.
    tail = window.tail_mark_ratio
    new_budget = budget.budget
    if (new_target, new_cap, new_wait, new_budget) != (target, cap, wait, window.max_prefill_tokens):
        tail = _tail_ratio(window, new_wait, obs, fraction, bounds, config)

    if (new_target, new_cap, new_wait, tail, new_budget) == (
        target,
        cap,
        wait,
        window.tail_mark_ratio,
        window.max_prefill_tokens,
    ):
        if itl_over:
            return hold(
                f"Inter-token P99 {obs.itl_p99_s * 1000:.0f} ms over its {spec.slo.inter_token_p99_ms:.0f} ms "
                "target, but the budget and the cap are already at their limits; holding.",
                state,
            )
        if over:
            return hold(f"{p99_text} over {slo_text}, but the window is already at its limits; holding.", state)
        if confirmed_headroom:
            return hold(
                f"{p99_text} well under {slo_text}, but the load does not fill a larger window; holding.", state
            )
        zone = "under" if headroom else "near"
        return hold(f"{p99_text} {zone} {slo_text} (dead band); holding.", state)
    top = bounds.max_prefill_tokens.max + 1  # an unset budget (whole prompts) is above any set one
    budgets = (window.max_prefill_tokens or top, new_budget or top)
    direction = _direction(((target, new_target), (cap, new_cap), (wait, new_wait), budgets), over or itl_over)
    if direction is None:
        direction = "up" if tail > window.tail_mark_ratio else "down"
    if over:
        lead = f"{p99_text} over {slo_text} ({'saturated' if saturated else f'{ratio:.2f}x the SLO'})"
    elif itl_over and not has_ttft:
        lead = f"{p99_text} over {slo_text}"
    elif itl_over:
        lead = f"{p99_text} within {slo_text}, inter-token P99 over its target"
    elif confirmed_headroom:
        lead = f"{p99_text} well under {slo_text} for {headroom_streak} intervals"
    else:
        lead = f"{p99_text} within {slo_text}"
    actions = "; ".join(
        part
        for part in (
            budget.why if new_budget != window.max_prefill_tokens else "",
            target_why if (new_target, new_wait) != (target, wait) else "",
            cap_why if new_cap != cap else "",
        )
        if part
    )
    if tail != window.tail_mark_ratio:
        actions = "; ".join(p for p in (actions, f"tail-mark ratio to {tail:g}") if p)
    if direction == "up":
        state = replace(state, headroom_streak=0)
    return _change(
        window,
        new_target,
        new_cap,
        new_wait,
        tail,
        direction,
        f"{lead}: {actions}.",
        state,
        now_s,
        estimate,
        new_budget,
    )


def _direction(moves: tuple[tuple[int, int], ...], over: bool) -> Direction | None:
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


def _fillable_target(obs: Observations, wait_ms: int, config: PolicyConfig) -> float:
    """Largest target the load reliably reaches within the wait: half the mean running batch (the
    running set dips below its mean half of the time) plus a third of the arrivals expected in the
    wait (with three times the needed arrivals expected, Poisson arrivals fill the gap before the
    wait fires at least 95 % of the time)."""
    running = obs.mean_batch_size if known(obs.mean_batch_size) else 0.0
    rate = obs.arrival_rate_per_s if known(obs.arrival_rate_per_s) else 0.0
    return max(1.0, 0.5 * running + rate * wait_ms / 1000.0 / (2 * config.wait_fill_margin))


def _change(
    window: Window,
    target: int,
    cap: int,
    wait: int,
    tail: float,
    direction: Direction,
    reason: str,
    state: PolicyState,
    now_s: float,
    estimate: FriendlinessEstimate | None,
    budget: int | Literal["keep"] | None = "keep",
) -> Decision:
    target = min(target, cap)
    new_budget = window.max_prefill_tokens if budget == "keep" else budget
    fields = (target, cap, wait, tail, new_budget)
    in_force = (window.target_batch_size, window.hard_cap, window.max_wait_ms, window.tail_mark_ratio)
    if fields == (*in_force, window.max_prefill_tokens):
        return Decision(
            window, "hold", reason.rstrip(".") + ", but the window is already at its limits; holding.", state, estimate
        )
    new_window = Window(
        target_batch_size=target,
        hard_cap=cap,
        max_wait_ms=wait,
        tail_mark_ratio=tail,
        max_prefill_tokens=new_budget,
        generation=window.generation + 1,
    )
    return Decision(new_window, direction, reason, replace(state, last_change_s=now_s), estimate)
