"""``serve --step-log FILE``: every engine step's composition and seconds, one JSON line each.

The simulator charges a step by its composition (``replay.cost_model.StepComposition``); this log
holds the compositions a serving runtime really ran and what each cost on its host, under its real
traffic, with everything that shares the step's interpreter (HTTP, streaming, the event loop).
``batchpilot-runtime calibrate --from-step-log FILE`` fits the cost model to it, and a benchmark
compares the model with it step by step. A line::

    {"at_s": 12.503, "seconds": 0.1214, "forward_seconds": 0.1107, "prefill_tokens": 64,
     "decode_seqs": 11, "kv_tokens": 3187, "batch_size": 12}

``at_s`` is the step's start on the monotonic clock. The file is written by the engine thread,
line-buffered, and closed when the runtime stops; one line costs a few microseconds.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from batchpilot_runtime.contract.admin_api import WindowState
from batchpilot_runtime.engine.types import EngineObserver
from batchpilot_runtime.replay.cost_model import StepComposition
from batchpilot_runtime.scheduling.types import RequestTimings, StepStats

STEP_LOG_FIELDS = ("at_s", "seconds", "forward_seconds", "prefill_tokens", "decode_seqs", "kv_tokens", "batch_size")


class StepLogError(ValueError):
    """A step log that cannot be read; the message names the file and the line."""


def read_step_log(path: Path) -> list[tuple[StepComposition, float]]:
    """Every step of a log as the cost model's ``(composition, seconds)`` samples."""
    samples: list[tuple[StepComposition, float]] = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                step = json.loads(line)
                composition = StepComposition(
                    _count(step, "prefill_tokens"), _count(step, "decode_seqs"), _count(step, "kv_tokens")
                )
                seconds = step["seconds"]
                if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
                    raise ValueError(f"seconds must be a number > 0, got {seconds!r}")
            except (ValueError, KeyError, TypeError) as error:
                detail = f"missing field {error}" if isinstance(error, KeyError) else str(error)
                raise StepLogError(f"{path}:{number}: {detail}") from None
            samples.append((composition, float(seconds)))
    if not samples:
        raise StepLogError(f"{path}: no steps")
    return samples


def _count(step: dict[str, object], name: str) -> int:
    value = step[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


class StepLogObserver:
    """An ``EngineObserver`` that writes each step to the log and hands every event on to ``inner``."""

    def __init__(self, inner: EngineObserver, path: Path) -> None:
        self.inner = inner
        self.path = path
        self._file: IO[str] = path.open("w", buffering=1)
        # close() comes from the event loop's thread; after a failed start the engine thread may still step.
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def on_step(self, stats: StepStats, step_seconds: float, forward_seconds: float) -> None:
        self.inner.on_step(stats, step_seconds, forward_seconds)
        if stats.batch_size > 0:
            line = {
                "at_s": round(time.monotonic() - step_seconds, 6),
                "seconds": round(step_seconds, 7),
                "forward_seconds": round(forward_seconds, 7),
                "prefill_tokens": stats.num_prefill_tokens,
                "decode_seqs": stats.num_decode_seqs,
                "kv_tokens": stats.kv_tokens,
                "batch_size": stats.batch_size,
            }
            with self._lock:
                if not self._file.closed:
                    self._file.write(json.dumps(line) + "\n")

    def on_admitted(self, lane: str, queue_wait_s: float) -> None:
        self.inner.on_admitted(lane, queue_wait_s)

    def on_first_token(self, lane: str, ttft_s: float) -> None:
        self.inner.on_first_token(lane, ttft_s)

    def on_request_finished(self, timings: RequestTimings, outcome: str) -> None:
        self.inner.on_request_finished(timings, outcome)

    def on_tokens(self, lane: str, inter_token_gaps_s: Sequence[float]) -> None:
        self.inner.on_tokens(lane, inter_token_gaps_s)

    def on_window(self, state: WindowState) -> None:
        self.inner.on_window(state)
