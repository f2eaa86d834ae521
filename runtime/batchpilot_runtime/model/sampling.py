"""Token sampling: greedy, temperature and top-p, with a per-request seeded generator.

Each row is sampled from its own logits with its own generator, so a request's tokens
depend on its seed and its logits only, never on which other requests share the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchpilot_runtime.model.sampling_ranges import MAX_TOP_P, MIN_TEMPERATURE, SEED_LIMIT

# Below this the softmax of logits / temperature is one-hot up to float32 precision, and
# the division itself under- or overflows (1e-300 is 0 in float32): sample greedily.
GREEDY_BELOW_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature`` 0 (or below 1e-4) is greedy (argmax; seed and top_p unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= MAX_TOP_P:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed: must be in [0, 2**63), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded from ``params.seed`` (None when greedy or unseeded).

    Create one per request and keep it for the request's life: its state advances with
    every sampled token, which is what makes a seeded request reproducible.
    """
    if params.is_greedy or params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise.

    probs: [V] summing to 1. The most likely token is always kept.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, sorted_ids = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
    keep = mass_before < top_p
    # Kept whatever the comparison says: a top_p below float32's smallest value (5e-324 rounds to 0)
    # would otherwise keep nothing and divide by zero.
    keep[0] = True
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    kept = torch.zeros_like(probs).scatter_(0, sorted_ids, sorted_probs)
    return kept / kept.sum()


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Pick one token per row of ``logits`` [S, V].

    Greedy rows share one argmax (ties go to the lowest id). Sampled rows each use their own
    generator, or torch's global one when None (not reproducible).
    """
    num_rows = logits.shape[0]
    if len(params) != num_rows:
        raise ValueError(f"params: {len(params)} entries for {num_rows} logit rows")
    if len(generators) != num_rows:
        raise ValueError(f"generators: {len(generators)} entries for {num_rows} logit rows")
    if num_rows == 0:
        return []
    # one device->host copy for all greedy rows
    tokens: list[int] = torch.argmax(logits, dim=-1).tolist()
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if row_params.is_greedy:
            continue
        row_logits = logits[row].float()
        # Shift so the largest logit is 0 before dividing: a tiny temperature then sends
        # the others to -inf (probability 0) instead of overflowing every logit to inf (NaN).
        shifted = row_logits - row_logits.max()
        probs = torch.softmax(shifted / row_params.temperature, dim=-1)
        probs = top_p_filter(probs, row_params.top_p)
        if generator is not None and generator.device != probs.device:
            probs = probs.to(generator.device)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens
