"""The prompt-token budget's move.

The budget is the lever between the two tails an iteration-level engine trades (see the policy's
docstring): :func:`budget_move` moves it by the ratio of each P99 to its target, at most one step per
decision and within ``tuning.bounds``. It reads the gaps as :mod:`batchpilot_operator.tuning.error_budget`
has them read (:class:`~batchpilot_operator.tuning.error_budget.GapReading`). Pure: nothing here reads
a clock or the policy's memory; the ceiling a cut set is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from batchpilot_operator.api.profile import BatchProfileSpec, LatencyMetric
from batchpilot_operator.tuning.config import PolicyConfig
from batchpilot_operator.tuning.limits import limit_size
from batchpilot_operator.tuning.observations import Observations, known
from batchpilot_operator.tuning.reading import Reading
from batchpilot_runtime.contract.window import Window


@dataclass(frozen=True)
class BudgetMove:
    """The prompt-token budget after one decision, and whether (and how) it moved."""

    budget: int | None
    change: Literal["lower", "raise"] | None = None  # None: it holds
    itl_over: bool = False
    # What asked for a raise: first tokens near or over their target, prompts in the queue (an SLO
    # without a first-token objective), or only the gaps' room under their target.
    cause: Literal["first_tokens", "queue", "room"] | None = None
    # Gaps over target that the budget does not explain: the step's prompt part at this budget is too
    # small for a cut to bring them under (see :func:`unexplained_by_budget`); the budget holds.
    unexplained: bool = False
    # Gaps over target, first tokens past half theirs, and the cut would leave a step's prompt chunk
    # alone over the gap target (see :func:`chunk_over_target`); the budget holds.
    chunk_over: bool = False
    reason: str = ""  # what the move does and why, as the decision's reason says it; "" when it holds


def prefill_top(spec: BatchProfileSpec, obs: Observations) -> float:
    """Prompt tokens one step can prefill within the first-token target (inf when unknown).

    A request that arrives as a step starts cannot begin its own prefill before that step ends, so
    a step longer than the target makes it miss however short the queue is; a budget past this only
    lets several long prompts share one such step."""
    target_ms = spec.slo.p99_ms
    per_token_s = obs.prefill_s_per_token
    if target_ms is None or spec.slo.latency_metric != LatencyMetric.TTFT or not known(per_token_s):
        return math.inf
    return math.inf if per_token_s <= 0 else target_ms / 1000.0 / per_token_s


def gap_room_factor(
    spec: BatchProfileSpec, obs: Observations, gap_p99_s: float, budget: int, share: float, ratio: float
) -> float:
    """The budget factor that would bring the inter-token P99 (``gap_p99_s``, as read) to ``share`` of
    its target.

    A gap is one step's time: its decodes' part stays and its prompt part grows by
    ``prefill_s_per_token`` a token, so the room left under the target buys (room / cost per token)
    more tokens. A budget read as proportional to the gap (``share / ratio``) underrates that room
    by the decodes' share of the step. Proportional when the cost per token is unknown."""
    target_ms = spec.slo.inter_token_p99_ms
    per_token_s = obs.prefill_s_per_token
    if target_ms is None or not (known(per_token_s) and per_token_s > 0 and known(gap_p99_s)):
        return share / max(ratio, 1e-3)
    room_s = share * target_ms / 1000.0 - gap_p99_s
    return max(1.0, budget + room_s / per_token_s) / budget


def chunk_fit(spec: BatchProfileSpec, obs: Observations, share: float) -> int:
    """The budget whose prompt chunk alone takes ``share`` of the inter-token target (a large int
    when the target or the cost per prompt token is unknown)."""
    target_ms, per_token_s = spec.slo.inter_token_p99_ms, obs.prefill_s_per_token
    if target_ms is None or not (known(per_token_s) and per_token_s > 0):
        return 1 << 30
    return int(share * target_ms / 1000.0 / per_token_s)


def chunk_over_target(spec: BatchProfileSpec, obs: Observations, budget: int) -> bool:
    """Whether a step's prompt part alone, at ``budget`` tokens, runs over the inter-token target.

    Above that budget a cut does not bring the gaps of a long prompt's steps under the target: it
    splits the prompt into more steps, each still over it, and every one stalls each decoding
    sequence once more. The share of gaps over the target then falls as the budget *rises*, up to
    whole prompts (issue 31: the Azure replay at 500 ms / 200 ms, x0.68, one budget held still:
    gap P99 202 ms at 4096 tokens, 195 ms at 6000, 197 ms at 8192, and first tokens 526, 512 and
    500 ms). False when the cost per token is unknown."""
    target_ms, per_token_s = spec.slo.inter_token_p99_ms, obs.prefill_s_per_token
    if target_ms is None or not (known(per_token_s) and per_token_s > 0):
        return False
    return budget * per_token_s >= target_ms / 1000.0


def unexplained_by_budget(
    spec: BatchProfileSpec, obs: Observations, gap_p99_s: float, budget: int, config: PolicyConfig
) -> bool:
    """Whether the gaps (``gap_p99_s``, as read) are over their setpoint even with no prompt part at all.

    A gap is a step's time: its decodes' part plus ``budget`` prompt tokens at
    ``Observations.prefill_s_per_token``. When what is left without the prompt part is still over the
    setpoint, no cut brings the gaps under it, and a cut only makes first tokens wait (a demo run beside
    a busy CPU: gaps of 212 ms at a budget of 355 tokens, cut to 229, and first tokens at 1.3 s). The
    cap, not the budget, is then the lever (:func:`batchpilot_operator.tuning.cap.cap_move`). False when the cost is unknown."""
    target_ms, per_token_s = spec.slo.inter_token_p99_ms, obs.prefill_s_per_token
    if target_ms is None or not (known(per_token_s) and per_token_s > 0 and known(gap_p99_s)):
        return False
    prompt_part_s = budget * per_token_s
    # The P99 is read off histogram buckets (interpolated within one, up to a third off at 300 ms), so
    # a prompt part of half the gap or more is taken to explain it.
    if prompt_part_s >= 0.5 * gap_p99_s:
        return False
    return gap_p99_s - prompt_part_s >= config.itl_setpoint_ratio * target_ms / 1000.0


def budget_move(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    reading: Reading,
    config: PolicyConfig,
    ceiling: int | None = None,
    settled: bool = True,
) -> BudgetMove:
    """The budget from the two tails: see the policy's docstring. ``reading.ratio`` is NaN when the
    SLO has no first-token objective: then nothing limits a cut, and a raise needs a queue instead.
    ``settled``: the window in force has been so for the whole rate window, so that its gaps are this
    budget's; only then may gaps be judged beyond what the budget explains (a P99 read across a cut
    still holds the larger budget's steps)."""
    budget, ratio, ttft_ratio = window.max_prefill_tokens, reading.itl, reading.ratio
    if math.isnan(ratio):
        return BudgetMove(budget)
    bound = spec.tuning.bounds.max_prefill_tokens
    current = bound.max if budget is None else budget
    # The gap grows about linearly with a step's prompt tokens and the first-token delay of a
    # queue about inversely: sqrt(TTFT ratio / gap ratio) is the move that would balance the two.
    # Without a first-token objective nothing holds a cut back (balance 0).
    first_tokens = not math.isnan(ttft_ratio)
    balance = math.sqrt(ttft_ratio / ratio) if first_tokens and ratio > 0 else (math.inf if first_tokens else 0.0)
    if ratio > 1.0:
        move = _cut(spec, window, obs, reading, current, balance, config, settled)
    elif budget is None:
        return BudgetMove(budget)
    else:
        top = bound.max if ceiling is None else max(bound.min, min(bound.max, ceiling))
        move = _raise(spec, budget, obs, reading, top, balance, config)
    return replace(move, reason=_said(spec, obs, reading, move))


def _cut(
    spec: BatchProfileSpec,
    window: Window,
    obs: Observations,
    reading: Reading,
    current: int,
    balance: float,
    config: PolicyConfig,
    settled: bool,
) -> BudgetMove:
    """The budget with the gaps over their target (``current``: the budget in force, an unset one at
    the top of its bounds)."""
    budget, ratio, ttft_ratio = window.max_prefill_tokens, reading.itl, reading.ratio
    bound = spec.tuning.bounds.max_prefill_tokens
    fraction = spec.tuning.max_step_fraction
    if settled and not math.isinf(ratio) and unexplained_by_budget(spec, obs, reading.gaps.p99_s, current, config):
        return BudgetMove(budget, itl_over=True, unexplained=True)
    # Aim the gap at the setpoint, but not past the balance when first tokens are tight too.
    factor = 1.0 - fraction if math.isinf(ratio) else max(config.itl_setpoint_ratio / ratio, balance)
    if factor > 1.0 - config.budget_min_change:
        # First tokens at least as far over: a cut would only move the pain to the worse tail.
        return BudgetMove(budget, itl_over=True)
    new = limit_size(current, current * factor, fraction, bound.min, bound.max)
    if new == budget:
        return BudgetMove(budget, itl_over=True)
    first_tokens = not math.isnan(ttft_ratio)
    if first_tokens and ttft_ratio > config.budget_raise_ttft_ratio and chunk_over_target(spec, obs, new):
        # More steps over the gap target for every long prompt, and first tokens that need them.
        return BudgetMove(budget, itl_over=True, chunk_over=True)
    return BudgetMove(new, "lower", itl_over=True)


def _raise(
    spec: BatchProfileSpec,
    budget: int,
    obs: Observations,
    reading: Reading,
    top: int,
    balance: float,
    config: PolicyConfig,
) -> BudgetMove:
    """The budget with the gaps within their target: a raise below ``top`` (the bounds and the ceiling
    a cut set), or a hold."""
    ratio, ttft_ratio = reading.itl, reading.ratio
    bound = spec.tuning.bounds.max_prefill_tokens
    fraction = spec.tuning.max_step_fraction
    first_tokens = not math.isnan(ttft_ratio)
    # Without a first-token objective, prompts waiting in the queue are what asks for a larger budget.
    first_tokens_wait = (
        ttft_ratio > config.budget_raise_ttft_ratio
        if first_tokens
        else known(obs.queue_depth) and obs.queue_depth >= 1.0
    )
    if ratio < config.itl_raise_ratio and (first_tokens_wait or first_tokens):
        # With a first-token objective the gaps' room alone raises the budget: a budget kept low while
        # first tokens have slack meets the next burst with more steps to prefill it (issue 31: on
        # bursty traffic the window in force when a burst comes sets the P99). The gap model bounds
        # what the raise costs: it aims the gaps at the setpoint, under the target.
        factor = min(1 + fraction, config.itl_setpoint_ratio / max(ratio, 1e-3))
        cause: Literal["first_tokens", "queue", "room"] = (
            "room" if not first_tokens_wait else "first_tokens" if first_tokens else "queue"
        )
    elif ttft_ratio > 1.0:
        # First tokens over, gaps within target but close: balance, never past the gap target, whose
        # room is read from the step's own cost per prompt token.
        room = gap_room_factor(spec, obs, reading.gaps.p99_s, budget, config.itl_raise_top_ratio, ratio)
        factor = min(balance, room)
        cause = "first_tokens"
    else:
        return BudgetMove(budget)
    if factor < 1.0 + config.budget_min_change:
        return BudgetMove(budget)
    if cause == "room":
        # Nothing waits for first tokens: no further than the budget whose prompt chunk alone puts a
        # step at the gap setpoint. Quiet gaps rarely hold a full chunk, so their room overstates the
        # budget's (the Azure replay at x0.216: the budget floated to 16384 tokens at 27 ms gaps, and
        # a x1.5 step cost then took 8 cuts and 20 intervals to bring the gaps back under 100 ms).
        top = min(top, max(bound.min, chunk_fit(spec, obs, config.itl_setpoint_ratio)))
        if top < budget * (1.0 + config.budget_min_change):
            return BudgetMove(budget)
    step_top = prefill_top(spec, obs)
    if step_top < top:
        # The estimate moves a little every interval: a raise it would cut under the minimum change holds.
        top = max(bound.min, int(step_top))
        if top < budget * (1.0 + config.budget_min_change):
            return BudgetMove(budget)
    new = limit_size(budget, budget * factor, fraction, bound.min, top)
    if new <= budget:
        return BudgetMove(budget)
    return BudgetMove(new, "raise", cause=cause)


def _said(spec: BatchProfileSpec, obs: Observations, reading: Reading, move: BudgetMove) -> str:
    """What ``move`` does and why, as the decision's reason says it ("" when it holds)."""
    if move.change is None:
        return ""
    itl_text = (
        "inter-token P99 beyond the top bucket"
        if math.isinf(reading.itl)
        else f"inter-token P99 {reading.gaps.named_p99_s * 1000:.0f} ms"
    )
    target_text = f"{spec.slo.inter_token_p99_ms:.0f} ms"
    if move.change == "lower":
        return f"lowering the prefill budget to {move.budget} tokens ({itl_text} over its {target_text} target)"
    need = {
        "first_tokens": "first tokens need it",
        "queue": f"{obs.queue_depth:.0f} prompts wait",
        "room": "so that the next burst needs fewer steps",
    }[move.cause or "room"]
    return f"raising the prefill budget to {move.budget} tokens ({need}; {itl_text} leaves room under {target_text})"


def sparse_room_budget(
    spec: BatchProfileSpec, window: Window, obs: Observations, config: PolicyConfig, ceiling: int | None = None
) -> int | None:
    """The budget an interval with too few requests for a first-token P99 may still raise, or None.

    Few requests can still carry thousands of gaps (each decodes hundreds of tokens), enough for the
    gaps' P99. At a low rate the next burst then meets the budget the gaps allow rather than the
    starting one (issue 31: a budget of 512 held through the quiet minutes before a burst of long
    prompts). Only a raise, and read as if no gap of the interval had shared its step with a prompt
    chunk (a quiet engine mostly decodes alone): the whole budget, not only its increase, must fit in
    the room under the setpoint. A cut, or any move that needs the first-token P99, waits for enough
    requests."""
    budget, target_ms = window.max_prefill_tokens, spec.slo.inter_token_p99_ms
    per_token_s = obs.prefill_s_per_token
    if spec.slo.p99_ms is None or target_ms is None or budget is None:
        return None
    if obs.itl_p99_saturated or not (known(obs.itl_p99_s) and known(per_token_s) and per_token_s > 0):
        return None
    if not (known(obs.tokens_per_s) and known(obs.window_s)):
        return None
    if obs.tokens_per_s * obs.window_s < config.sparse_budget_min_gaps:
        return None
    if obs.itl_p99_s >= config.itl_raise_ratio * target_ms / 1000.0:
        return None
    bound = spec.tuning.bounds.max_prefill_tokens
    top = bound.max if ceiling is None else max(bound.min, min(bound.max, ceiling))
    top = min(top, max(bound.min, int(prefill_top(spec, obs))))
    fits = (config.itl_setpoint_ratio * target_ms / 1000.0 - obs.itl_p99_s) / per_token_s
    if fits < budget * (1.0 + config.budget_min_change):
        return None
    new = limit_size(budget, fits, spec.tuning.max_step_fraction, bound.min, top)
    return new if new > budget else None
