"""The tuning policy: (spec, window in force, observations, state, now) -> decision.

:func:`decide` applies the gates and orders the moves; the moves themselves are pure functions, one
module a lever (:mod:`~batchpilot_operator.tuning.budget`, :mod:`~batchpilot_operator.tuning.cap`,
:mod:`~batchpilot_operator.tuning.target_wait`), reading one interval through
:mod:`~batchpilot_operator.tuning.reading` and its gaps through
:mod:`~batchpilot_operator.tuning.error_budget` (their step limits in
:mod:`batchpilot_operator.tuning.limits`). Each move returns its reason with it;
:mod:`batchpilot_operator.tuning.reasons` says the rest (the gates' holds, where P99 stands) and joins
the reasons of the moves that moved a field into the decision's.

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
the running batch and the target, so short under heavy load and longer under light
load, but never past the profile's own wait (nor the bound, nor a tenth of the SLO: a wait
is latency spent for sure), since a wait raised while the engine idles is still in force
when the next burst comes, before the policy has seen it (issue 31), and left alone when the running batch already exceeds the target (then every
arrival is admitted at once and the wait never fires). The tail-mark ratio stays at
2.0 unless more than a fifth of admissions get marked (marking too early marks
everyone): then it rises by 0.25, up to the profile's own ratio (a marked request is
admitted at once, so a higher ratio never shortens a latency), and drifts back when marking becomes rare; it only
moves together with another field, never as a decision of its own, and not
at all when the new window has no wait (every queued request is then admitted
at the next step with room, oldest first, so marking changes nothing).

A wait only pays while the engine would otherwise idle. Under continuous batching
a request held back while sequences decode joins a step that runs anyway: it saves
no step and spends its latency (measured figures: tests/bench/NOTES.md). So when the
engine decodes half of the time or more (generated tokens per second over the mean
batch is decode steps per second; times the step time at that batch, busy time),
the wait goes to its lower bound, with no confirmation needed since that only shortens
latency, and a target the running batch does not reach comes down to what it fills, so
that admissions still fire on the target. The arrival-following wait above is for an
engine that idles between requests.

The prompt-token budget per step (``maxPrefillTokens``) is the lever between the two tails an
iteration-level engine trades: a long prompt prefilled in one step stalls every decode of that
step (inter-token gap), a small budget spreads it over many steps (first token later). It moves
only for an SLO with ``interTokenP99Ms``, and by the ratio of each P99 to its target: the gap
grows about linearly with a step's prompt tokens and a queue's first-token delay about
inversely, so sqrt(TTFT ratio / gap ratio) is the move that balances the two. Over the
inter-token target the budget comes down at once towards the budget that puts the gap at 85 %
of its target, but no further than the balance when first tokens are tight too, and not at all
when they are further over than the gaps (a cut would move the pain to the worse tail), nor when
the gap less its prompt part (the budget at ``Observations.prefill_s_per_token``) is still over the
85 % point and the prompt part under half the gap, in a rate window the window in force has filled:
no cut explains it (:func:`batchpilot_operator.tuning.budget.unexplained_by_budget`), nor when
first tokens are past half their target and a step's prompt chunk alone would still run over the
gap target after the cut: that cut only splits each long prompt into more steps over the target
(:func:`batchpilot_operator.tuning.budget.chunk_over_target`).
Then, or when the budget is already at its lower bound, and the batch is at its cap, the cap comes
down instead (the decode part of a step grows with the batch). A cut also sets a ceiling: the budget does not rise
past it again until the gaps have stayed within target for 20 intervals, then by one step at a
time (as the memory ceiling of the cap does), because the gap's P99 is set by the longest
prompts, which a raise only meets at the next burst. The budget rises when the gaps are under
70 % of their target (towards the 85 % point), whatever first tokens read (a budget kept low while
they have slack meets the next burst with more steps to prefill it; the gap target bounds the
raise's cost), or when first tokens are over while the gaps are within target (towards the balance, never past
98 % of the gap target), by at most the step limit and never past the ceiling. How many tokens
the room under 98 % buys is read from a prompt token's step cost
(``Observations.prefill_s_per_token``): only the prompt part of a gap grows with the budget. For a
first-token SLO a raise also stops at the prompt tokens one step prefills within the first-token
target: a request that arrives as a step starts waits for that step to end, so a longer step
makes it miss however short the queue is. A move under 5 % is not made. Otherwise it holds. An
unset budget (whole prompts) counts as the top of its bounds. An interval with too few requests
for a first-token P99 may still raise the budget alone on its gaps' room, when they are many
enough to read (:func:`batchpilot_operator.tuning.budget.sparse_room_budget`).

The gaps' target is a P99: 1 % of the gaps may run over it, the SLO's error budget. An interval
whose gap P99 is over its target by at most 1/0.9 is read at the target (no cut, no ceiling) while
the last hour's share of gaps over the target (``Observations.itl_window_buckets``) is under 0.8 %,
the excuse narrowing linearly to nothing as that share reaches it; raises always read the interval
as it is (:func:`batchpilot_operator.tuning.error_budget.excused_gap_share`). An hour that spent more than
the 1 % is paid back: each interval's gap P99 is read longer by the hour's share over 1 %, at most
5 %, so cuts go a little deeper and raises stop a little lower until the hour is back within budget
(:func:`batchpilot_operator.tuning.error_budget.gap_payback`).

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

from batchpilot_operator.api.profile import BatchProfileSpec, WindowBounds
from batchpilot_operator.tuning import reasons
from batchpilot_operator.tuning.budget import BudgetMove, budget_move, sparse_room_budget
from batchpilot_operator.tuning.cap import cap_move, memory_move
from batchpilot_operator.tuning.config import DEFAULT_CONFIG, PolicyConfig
from batchpilot_operator.tuning.error_budget import read_gaps
from batchpilot_operator.tuning.friendliness import FriendlinessEstimate, measure, merge_curve
from batchpilot_operator.tuning.limits import (
    RATIO_MIN_STEP,
    SIZE_MIN_STEP,
    WAIT_MIN_STEP_MS,
    allowed_step,
    cap_ceiling,
    clamp_into_bounds,
    lift_ceiling,
)
from batchpilot_operator.tuning.observations import Observations, known
from batchpilot_operator.tuning.reading import (
    Reading,
    busy_share,
    itl_ratio,
    latency_ratio,
    read,
    slo_over,
    step_time_s,
)
from batchpilot_operator.tuning.target_wait import desired_wait_ms, tail_ratio, target_wait_move
from batchpilot_runtime.contract.window import Window

__all__ = [
    "DEFAULT_CONFIG",
    "RATIO_MIN_STEP",
    "SIZE_MIN_STEP",
    "WAIT_MIN_STEP_MS",
    "Decision",
    "Direction",
    "PolicyConfig",
    "PolicyState",
    "allowed_step",
    "busy_share",
    "decide",
    "desired_wait_ms",
    "itl_ratio",
    "latency_ratio",
    "slo_over",
    "step_time_s",
]


Direction = Literal["up", "down", "hold", "reset"]


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


def decide(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    state: PolicyState,
    now_s: float,
    config: PolicyConfig = DEFAULT_CONFIG,
) -> Decision:
    """One tuning decision. Pure: same inputs, same decision."""
    # 1. Fold this interval's step times into the friendliness curve (whatever else happens).
    curve = merge_curve(state.step_curve, obs.step_s_by_batch)
    estimate = measure(dict(curve)) if curve else None
    state = replace(state, step_curve=curve, decisions=state.decisions + 1)

    # 2. Bounds win over everything, including the cooldown.
    bounds = spec.tuning.bounds
    if bounds.fields_outside(window) or window.target_batch_size > window.hard_cap:
        clamped = clamp_into_bounds(window, bounds)
        state = replace(state, last_change_s=now_s, headroom_streak=0)
        return Decision(clamped, "reset", reasons.reset(window), state, estimate)

    # 3. Refuse to act on what cannot be trusted (a sparse interval may still raise the budget).
    untrusted = _untrusted(spec, obs, config)
    if untrusted is not None:
        return _sparse(spec, window, obs, replace(state, headroom_streak=0), now_s, estimate, untrusted, config)
    # The gaps as the error budget has them read: at the target when it excuses them, longer while
    # the last hour is over it; every reason from here on ends with the note that says which.
    reading = read(spec, obs, read_gaps(spec, obs, config), config)
    state = _advance_streaks(state, spec, reading, config)
    if state.last_change_s is not None and now_s - state.last_change_s < spec.tuning.cooldown_seconds:
        left_s = spec.tuning.cooldown_seconds - (now_s - state.last_change_s)
        why = reasons.cooldown(spec, obs, reading, left_s) + reasons.error_budget(spec, reading.gaps, config)
        return Decision(window, "hold", why, state, estimate)

    # 4. The budget, from the two tails; a cut sets the ceiling that later raises stop below.
    settled = state.last_change_s is None or (known(obs.window_s) and now_s - state.last_change_s >= obs.window_s)
    budget = budget_move(spec, window, obs, reading, config, state.budget_ceiling, settled)
    if budget.itl_over and budget.budget is not None:
        state = replace(state, budget_ceiling=budget.budget, itl_calm_streak=0)

    # 5. Memory pressure: lower the cap and remember it as a ceiling.
    if reading.pressure:
        memory = memory_move(spec, window, obs, reading)
        state = replace(state, kv_cap_ceiling=memory.cap, calm_streak=0, headroom_streak=0)
        fields: Fields = (
            memory.target,
            memory.cap,
            window.max_wait_ms,
            window.tail_mark_ratio,
            window.max_prefill_tokens,
        )
        return _change(window, fields, "down", memory.reason, state, now_s, estimate)

    # 6. The cap, then target and wait within it, the tail ratio riding along.
    return _levers(spec, window, obs, reading, budget, state, now_s, estimate, config)


def _levers(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    reading: Reading,
    budget: BudgetMove,
    state: PolicyState,
    now_s: float,
    estimate: FriendlinessEstimate | None,
    config: PolicyConfig,
) -> Decision:
    """The last steps of :func:`decide`: the cap, target and wait within it, and the tail ratio
    beside ``budget``, named and said; or a hold when nothing moves."""
    ceiling = cap_ceiling(spec, estimate, state.kv_cap_ceiling)
    cap_moved = cap_move(spec, window, reading, ceiling, config, gaps_beyond_budget=budget.unexplained)
    confirmed = reading.headroom and state.headroom_streak >= config.up_confirm_intervals
    under = state.under_streak >= config.dead_band_confirm_intervals
    target_wait = target_wait_move(
        spec, window, obs, reading, cap_moved.cap, estimate, config, confirmed_headroom=confirmed, confirmed_under=under
    )
    new_target, new_cap, new_wait = min(target_wait.new_target, cap_moved.cap), cap_moved.cap, target_wait.wait
    note = reasons.error_budget(spec, reading.gaps, config)

    # 7. The tail ratio only rides along with another change: on its own it would be a decision
    # (and a push) for a second-order knob.
    in_force = (window.target_batch_size, window.hard_cap, window.max_wait_ms, window.max_prefill_tokens)
    tail = window.tail_mark_ratio
    if (new_target, new_cap, new_wait, budget.budget) != in_force:
        tail = tail_ratio(spec, window, new_wait, obs, config)
    if (new_target, new_cap, new_wait, budget.budget, tail) == (*in_force, window.tail_mark_ratio):
        why = reasons.hold(
            spec, obs, reading, confirmed, gaps_beyond_budget=budget.unexplained, chunk_over_target=budget.chunk_over
        )
        return Decision(window, "hold", why + note, state, estimate)

    # 8. Name the direction and say why.
    fields: Fields = (new_target, new_cap, new_wait, tail, budget.budget)
    moved = _direction(window, fields, spec.tuning.bounds, reading)
    streak = state.headroom_streak if confirmed else None
    moves = (budget, cap_moved, target_wait)
    reason = reasons.change(spec, obs, window, _window(window, fields), reading, moves, streak) + note
    if moved == "up":
        state = replace(state, headroom_streak=0)
    return _change(window, fields, moved, reason, state, now_s, estimate)


def _sparse(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    state: PolicyState,
    now_s: float,
    estimate: FriendlinessEstimate | None,
    untrusted: str,
    config: PolicyConfig,
) -> Decision:
    """The decision on an interval the data gates refuse (``untrusted`` says why): a hold, or the
    budget raise its gaps alone allow (:func:`sparse_room_budget`), never inside the cooldown."""
    in_cooldown = state.last_change_s is not None and now_s - state.last_change_s < spec.tuning.cooldown_seconds
    raised = None if in_cooldown else sparse_room_budget(spec, window, obs, config, state.budget_ceiling)
    if raised is None:
        return Decision(window, "hold", untrusted, state, estimate)
    reason = reasons.sparse_budget_raise(spec, obs, raised, config)
    fields: Fields = (window.target_batch_size, window.hard_cap, window.max_wait_ms, window.tail_mark_ratio, raised)
    return _change(window, fields, "up", reason, state, now_s, estimate)


def _untrusted(spec: BatchProfileSpec, obs: Observations, config: PolicyConfig) -> str | None:
    """Why this interval cannot be acted on (no data for the deciding objective, too few
    samples), or None."""
    # NaN where the SLO has no such objective (the other one then decides alone) or no data.
    ratio = latency_ratio(spec, obs) if spec.slo.p99_ms is not None else itl_ratio(spec, obs)
    if math.isnan(ratio):
        return reasons.no_data(spec)
    if not known(obs.samples) or obs.samples < config.min_samples:
        return reasons.too_sparse(obs, config)
    return None


def _advance_streaks(state: PolicyState, spec: BatchProfileSpec, reading: Reading, config: PolicyConfig) -> PolicyState:
    """The memory after this interval: streaks counted on, and the memory and budget ceilings
    lifted a step after enough calm intervals."""
    bounds = spec.tuning.bounds
    fraction = spec.tuning.max_step_fraction
    calm = not reading.pressure and not reading.soft_full
    # Memory calm for a while: the cap may climb one more step.
    kv_ceiling, calm_streak = lift_ceiling(
        state.kv_cap_ceiling,
        state.calm_streak + 1 if calm else 0,
        config.kv_ceiling_calm_intervals,
        fraction,
        bounds.hard_cap.max,
    )
    # The same for the budget: a gap over its target sets a ceiling, lifted a step after calm.
    budget_ceiling, itl_calm_streak = lift_ceiling(
        state.budget_ceiling,
        state.itl_calm_streak + 1 if reading.itl <= 1.0 else 0,
        config.budget_ceiling_calm_intervals,
        fraction,
        bounds.max_prefill_tokens.max,
    )
    under = reading.zone_ratio < config.wait_raise_ratio and not reading.itl_over
    return replace(
        state,
        calm_streak=calm_streak,
        kv_cap_ceiling=kv_ceiling,
        headroom_streak=state.headroom_streak + 1 if reading.headroom and not reading.pressure else 0,
        under_streak=state.under_streak + 1 if under else 0,
        budget_ceiling=budget_ceiling,
        itl_calm_streak=itl_calm_streak,
    )


Fields = tuple[int, int, int, float, int | None]  # target, cap, wait, tail-mark ratio, prefill budget


def _direction(window: Window, fields: Fields, bounds: WindowBounds, reading: Reading) -> Direction:
    target, cap, wait, tail, budget = fields
    top = bounds.max_prefill_tokens.max + 1  # an unset budget (whole prompts) is above any set one
    budgets = (window.max_prefill_tokens or top, budget or top)
    sizes = ((window.target_batch_size, target), (window.hard_cap, cap), (window.max_wait_ms, wait), budgets)
    moved = direction(sizes, reading.over or reading.itl_over)
    if moved is None:  # only the tail ratio moved
        return "up" if tail > window.tail_mark_ratio else "down"
    return moved


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


def _window(window: Window, fields: Fields) -> Window:
    target, cap, wait, tail, budget = fields
    return Window(
        target_batch_size=min(target, cap),
        hard_cap=cap,
        max_wait_ms=wait,
        tail_mark_ratio=tail,
        max_prefill_tokens=budget,
        generation=window.generation,  # numbering a window put in force is the control loop's
    )


def _change(
    window: Window,
    fields: Fields,
    moved: Direction,
    reason: str,
    state: PolicyState,
    now_s: float,
    estimate: FriendlinessEstimate | None,
) -> Decision:
    """The decision that puts ``fields`` in force, or a hold when they are the window in force."""
    new_window = _window(window, fields)
    in_force = (window.target_batch_size, window.hard_cap, window.max_wait_ms, window.tail_mark_ratio)
    if (*in_force, window.max_prefill_tokens) == (
        new_window.target_batch_size,
        new_window.hard_cap,
        new_window.max_wait_ms,
        new_window.tail_mark_ratio,
        new_window.max_prefill_tokens,
    ):
        return Decision(window, "hold", reasons.at_limits(reason), state, estimate)
    return Decision(new_window, moved, reason, replace(state, last_change_s=now_s), estimate)
