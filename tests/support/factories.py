"""Factories shared by the tests: a BatchProfile spec and a runtime window, each with stated defaults.

A test passes only what its case is about; what it leaves out is the default written here.
"""

from __future__ import annotations

from typing import Any

from batchpilot_operator.api.profile import BatchProfileSpec, parse_spec
from batchpilot_runtime.contract.window import Window


def make_spec_dict(model: str = "chat", **sections: Any) -> dict[str, Any]:
    """A BatchProfile spec as a manifest writes it (camelCase): ``model`` on pods labelled ``app=<model>``,
    window 8/16/40 ms, P99 500 ms, and no cooldown (the first tick may already change the window).

    Each keyword replaces the whole section it names (``tuning={...}`` drops ``cooldownSeconds: 0``)."""
    spec: dict[str, Any] = {
        "model": model,
        "selector": {"matchLabels": {"app": model}},
        "window": {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 40},
        "slo": {"p99Ms": 500},
        "tuning": {"cooldownSeconds": 0},
    }
    spec.update(sections)
    return spec


def make_spec(model: str = "chat", **sections: Any) -> BatchProfileSpec:
    """:func:`make_spec_dict`, validated into the type the operator's core takes."""
    return parse_spec(make_spec_dict(model, **sections))


def make_window(
    *, target: int = 8, cap: int = 16, wait_ms: int = 20, ratio: float = 2.0, generation: int = 0
) -> Window:
    """A runtime window: target 8, hard cap 16, 20 ms wait, tail-mark ratio 2, generation 0."""
    return Window(
        target_batch_size=target, hard_cap=cap, max_wait_ms=wait_ms, tail_mark_ratio=ratio, generation=generation
    )
