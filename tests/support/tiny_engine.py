"""The engine as the engine tests build it: the tiny preset with seeded random weights and a small
KV cache, and a poll for what the engine thread has reached (real time, never asserted on)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.engine.engine import Engine

VOCAB = 320  # the tiny preset's
KV_TOKENS = 64 * 16  # 64 blocks of 16: the largest hardCap such an engine accepts is 64
DEADLINE_S = 60.0  # real time allowed for the engine thread to reach a state


def tiny_engine(window: Window, *, kv_cache_tokens: int = KV_TOKENS, **options: Any) -> Engine:
    """``Engine.build`` of the tiny preset (seed 0) under ``window``; ``options`` are its other arguments."""
    return Engine.build(
        model_name="tiny", preset="tiny", seed=0, window=window, kv_cache_tokens=kv_cache_tokens, **options
    )


async def wait_until(condition: Callable[[], object], what: str) -> None:
    """Poll ``condition`` every 10 ms until it holds; fail naming ``what`` after ``DEADLINE_S``."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
