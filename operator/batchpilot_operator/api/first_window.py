"""The first window of a profile that gives none, derived from its SLO and the engine's step costs.

The no-regret suite (tests/bench/bench_suite.py, issue 31) found the starting window to be what a
reactive policy cannot undo on bursty traffic: the first burst meets the window in force before any
interval has been observed, and one burst of long prompts at a budget of 512 spends the whole 1 % of
a P99. The window derived here is the one that suite's best static windows share:

- **target and wait at their lower bounds**: under continuous batching a held request only joins a
  later step (tests/bench/NOTES.md), so admissions fire at once;
- **the cap at the friendliness class's ceiling** (medium's for ``auto`` until the class is measured),
  within the bounds, and no larger than the decode steps of a full batch allow: a batch of that
  many decodes must fit in half the inter-token target;
- **the prompt budget the inter-token target allows**: a step's fixed part and its prompt chunk fill
  ``GAP_SHARE`` of the target, leaving the rest to the decodes and their KV reads, which depend on
  traffic the profile cannot know; no more than one step can prefill within the first-token target.
  Without an inter-token target the budget is left unset (the engine's own).

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math

from batchpilot_operator.api.bounds import WindowBounds
from batchpilot_operator.api.step_costs import StepCosts
from batchpilot_runtime.contract.window import WindowFields

GAP_SHARE = 0.6  # of the inter-token target, for a step's fixed part and its prompt chunk
DECODE_SHARE = 0.5  # of the inter-token target, for the decodes of a full batch
TAIL_MARK_RATIO = 2.0  # the window's default


def first_window(
    costs: StepCosts,
    bounds: WindowBounds,
    cap_ceiling: int,
    *,
    inter_token_ms: float | None,
    first_token_ms: float | None,
) -> WindowFields:
    """The starting window for these step costs and objectives, within ``bounds``.

    ``first_token_ms`` is the first-token P99 target (None when the SLO bounds another latency or
    none); ``cap_ceiling`` the friendliness class's ceiling."""
    cap = min(cap_ceiling, bounds.hard_cap.max)
    per_sequence_s = costs.decode_s_per_sequence
    if inter_token_ms is not None and per_sequence_s > 0:
        room_s = DECODE_SHARE * inter_token_ms / 1000.0 - costs.fixed_s
        if room_s < cap * per_sequence_s:  # compared first: a tiny per-sequence cost divides to infinity
            cap = max(1, math.floor(room_s / per_sequence_s))
    cap = max(bounds.hard_cap.clamp(cap), bounds.target_batch_size.min)
    target = min(bounds.target_batch_size.min, cap)
    budget: int | None = None
    if inter_token_ms is not None:
        tokens = (GAP_SHARE * inter_token_ms / 1000.0 - costs.fixed_s) / costs.prefill_s_per_token
        if first_token_ms is not None:
            tokens = min(tokens, first_token_ms / 1000.0 / costs.prefill_s_per_token)
        tokens = min(tokens, float(bounds.max_prefill_tokens.max))  # finite before the floor
        # A hair over the floor: 0.3 s / 100 us is 2999.9999... in floating point.
        budget = bounds.max_prefill_tokens.clamp(max(1, math.floor(tokens + 1e-6)))
    tail = bounds.tail_mark_ratio.clamp(TAIL_MARK_RATIO)
    return WindowFields(
        target_batch_size=target,
        hard_cap=cap,
        max_wait_ms=bounds.max_wait_ms.min,
        tail_mark_ratio=tail,
        max_prefill_tokens=budget,
    )
