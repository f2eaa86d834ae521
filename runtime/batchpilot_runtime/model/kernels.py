"""Which kernels the model runs: the fastest correct ones unless batch invariance is asked for.

Plain BLAS GEMMs and SDPA are the default on every device: each request's logits equal its
logits alone up to float rounding, so a greedy token can flip where two logits tie to within
rounding. Batch invariance (model.py, attention.py) makes them bitwise equal in any batch and
any prefill chunking, at a cost in speed; it is an opt-in, as vLLM's ``VLLM_BATCH_INVARIANT``:
``--batch-invariant`` on ``serve``, ``generate`` and the runtime benchmark, or the environment
variable ``BATCHPILOT_BATCH_INVARIANT`` for every model a process builds. This module is the one
place that reads the variable; it imports no torch, so the command line can check it early.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

BATCH_INVARIANT_ENV = "BATCHPILOT_BATCH_INVARIANT"

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})


def resolve_batch_invariant(requested: bool | None, environ: Mapping[str, str] | None = None) -> bool:
    """``requested`` when given (a flag or a caller's choice wins), else the environment variable,
    else off. A value of the variable that is neither on nor off is a ValueError naming it."""
    if requested is not None:
        return requested
    raw = (os.environ if environ is None else environ).get(BATCH_INVARIANT_ENV, "")
    text = raw.strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(
        f"{BATCH_INVARIANT_ENV}: must be one of {sorted(_ON)} (on) or {sorted(_OFF - {''})} (off), got {raw!r}"
    )
