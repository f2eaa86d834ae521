"""The words of a decision that no single move says: the gates' holds, where P99 stands, what the
error budget changed in the reading of the gaps, and the sentence that joins the moves' own reasons
(each move says what it does: :mod:`~batchpilot_operator.tuning.budget`,
:mod:`~batchpilot_operator.tuning.cap`, :mod:`~batchpilot_operator.tuning.target_wait`).

No arithmetic that decides anything lives here; the texts are part of the operator's interface
(status, events, logs) and tests pin them.
"""

from __future__ import annotations

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.tuning.budget import BudgetMove
from batchpilot_operator.tuning.cap import CapMove
from batchpilot_operator.tuning.config import PolicyConfig
from batchpilot_operator.tuning.error_budget import GapReading
from batchpilot_operator.tuning.observations import Observations, known
from batchpilot_operator.tuning.reading import Reading
from batchpilot_operator.tuning.target_wait import TargetWaitMove
from batchpilot_runtime.contract.window import Window

AT_LIMITS = ", but the window is already at its limits; holding."


def reset(window: Window) -> str:
    return f"The window in force ({window.describe()}) lay outside tuning.bounds; clamped into them."


def no_data(spec: BatchProfileSpec) -> str:
    what = "latency" if spec.slo.p99_ms is not None else "inter-token"
    return f"No {what} data this interval (no traffic or no series); holding."


def too_sparse(obs: Observations, config: PolicyConfig) -> str:
    samples = "an unknown number of" if not known(obs.samples) else f"{obs.samples:.0f}"
    return f"Too sparse: P99 rests on {samples} requests (< {config.min_samples}); holding."


def sparse_budget_raise(spec: BatchProfileSpec, obs: Observations, budget: int, config: PolicyConfig) -> str:
    samples = "an unknown number of" if not known(obs.samples) else f"{obs.samples:.0f}"
    return (
        f"Too sparse for the first-token P99 ({samples} requests, < {config.min_samples}), but "
        f"{obs.tokens_per_s * obs.window_s:.0f} gaps put the inter-token P99 at {obs.itl_p99_s * 1000:.0f} ms, "
        f"under its {spec.slo.inter_token_p99_ms:.0f} ms target: raising the prefill budget to {budget} tokens "
        "so that the next burst needs fewer steps."
    )


def _objective(spec: BatchProfileSpec, obs: Observations, gaps: GapReading) -> tuple[str, str]:
    """The P99 that decides (first tokens, else the gaps) and its target, as the reasons name them."""
    if spec.slo.p99_ms is not None:
        p99_ms = obs.p99_s * 1000
        p99_text = f"P99 beyond {p99_ms:.0f} ms (top bucket)" if obs.p99_saturated else f"P99 {p99_ms:.0f} ms"
        return p99_text, f"SLO {spec.slo.p99_ms:.0f} ms"
    p99_text = (
        "inter-token P99 beyond the top bucket"
        if obs.itl_p99_saturated
        else f"inter-token P99 {gaps.named_p99_s * 1000:.0f} ms"
    )
    return p99_text, f"its {spec.slo.inter_token_p99_ms:.0f} ms target"


def cooldown(spec: BatchProfileSpec, obs: Observations, reading: Reading, left_s: float) -> str:
    p99_text, slo_text = _objective(spec, obs, reading.gaps)
    return f"{p99_text} vs {slo_text}, but in cooldown for {left_s:.0f} s more; holding."


def error_budget(spec: BatchProfileSpec, gaps: GapReading, config: PolicyConfig) -> str:
    """What the error budget changed in the reading of the gaps, said after every reason of the
    decision past the data gates ("" when the gaps are read as they are)."""
    if gaps.why == "excused":
        return (
            f" Inter-token P99 {gaps.own_p99_s * 1000:.0f} ms is over its {spec.slo.inter_token_p99_ms:.0f} ms"
            f" target this interval, within the error budget: {gaps.hour_share:.2%} of the last hour's gaps"
            f" over it ({config.gap_budget_share:.0%} allowed), so not cut."
        )
    if gaps.why == "payback":
        return (
            f" The interval's inter-token P99 of {gaps.own_p99_s * 1000:.0f} ms is read {gaps.factor - 1:.0%}"
            f" longer ({gaps.own_p99_s * gaps.factor * 1000:.0f} ms) until the error budget is paid back:"
            f" {gaps.hour_share:.2%} of the last hour's gaps were over the {spec.slo.inter_token_p99_ms:.0f} ms"
            f" target ({config.gap_budget_share:.0%} allowed)."
        )
    return ""


def at_limits(reason: str) -> str:
    """A change that turned out to move nothing: the same reason, as a hold."""
    return reason.rstrip(".") + AT_LIMITS


def hold(
    spec: BatchProfileSpec,
    obs: Observations,
    reading: Reading,
    confirmed_headroom: bool,
    *,
    gaps_beyond_budget: bool = False,
    chunk_over_target: bool = False,
) -> str:
    """Why nothing moved past the gates: the limits, or the zone."""
    p99_text, slo_text = _objective(spec, obs, reading.gaps)
    gap_ms = reading.gaps.named_p99_s * 1000
    if reading.itl_over and chunk_over_target:
        per_token_ms = obs.prefill_s_per_token * 1000
        return (
            f"Inter-token P99 {gap_ms:.0f} ms over its {spec.slo.inter_token_p99_ms:.0f} ms "
            f"target and {p99_text} past half of {slo_text}, but a step's prompt chunk alone would still run "
            f"over the gap target after a cut ({per_token_ms * 1000:.1f} us a prompt token): a cut would split "
            "each long prompt into more steps over it, each stalling every decode once more; holding."
        )
    if reading.itl_over and gaps_beyond_budget:
        per_token_ms = obs.prefill_s_per_token * 1000
        return (
            f"Inter-token P99 {gap_ms:.0f} ms over its {spec.slo.inter_token_p99_ms:.0f} ms "
            f"target, more than the prompt part of a step explains ({per_token_ms * 1000:.1f} us a prompt token): "
            "a smaller budget would not bring the gaps under it, only make first tokens wait, and the batch is "
            "under its cap; holding."
        )
    if reading.itl_over:
        return (
            f"Inter-token P99 {gap_ms:.0f} ms over its {spec.slo.inter_token_p99_ms:.0f} ms "
            "target, but the budget and the cap are already at their limits; holding."
        )
    if reading.over:
        return f"{p99_text} over {slo_text}{AT_LIMITS}"
    if confirmed_headroom:
        return f"{p99_text} well under {slo_text}, but the load does not fill a larger window; holding."
    zone = "under" if reading.headroom else "near"
    return f"{p99_text} {zone} {slo_text} (dead band); holding."


def _lead(spec: BatchProfileSpec, obs: Observations, reading: Reading, headroom_streak: int | None) -> str:
    """Where P99 stands; ``headroom_streak`` is None unless headroom is confirmed."""
    p99_text, slo_text = _objective(spec, obs, reading.gaps)
    if reading.over:
        return f"{p99_text} over {slo_text} ({'saturated' if reading.saturated else f'{reading.ratio:.2f}x the SLO'})"
    if reading.itl_over and spec.slo.p99_ms is None:
        return f"{p99_text} over {slo_text}"
    if reading.itl_over:
        return f"{p99_text} within {slo_text}, inter-token P99 over its target"
    if headroom_streak is not None:
        return f"{p99_text} well under {slo_text} for {headroom_streak} intervals"
    return f"{p99_text} within {slo_text}"


def change(
    spec: BatchProfileSpec,
    obs: Observations,
    window: Window,
    new_window: Window,
    reading: Reading,
    moves: tuple[BudgetMove, CapMove, TargetWaitMove],
    headroom_streak: int | None,
) -> str:
    """The reason of a change, "<where P99 stands>: <each field that moved, and why>.", each field's
    part the reason of the move that moved it: ``new_window`` holds the fields this decision puts in
    force; ``headroom_streak`` is None unless headroom is confirmed."""
    budget, cap, target_wait = moves
    target_wait_moved = (new_window.target_batch_size, new_window.max_wait_ms) != (
        window.target_batch_size,
        window.max_wait_ms,
    )
    actions = "; ".join(
        part
        for part in (
            budget.reason if new_window.max_prefill_tokens != window.max_prefill_tokens else "",
            target_wait.reason if target_wait_moved else "",
            cap.reason if new_window.hard_cap != window.hard_cap else "",
        )
        if part
    )
    if new_window.tail_mark_ratio != window.tail_mark_ratio:
        actions = "; ".join(p for p in (actions, f"tail-mark ratio to {new_window.tail_mark_ratio:g}") if p)
    return f"{_lead(spec, obs, reading, headroom_streak)}: {actions}."
