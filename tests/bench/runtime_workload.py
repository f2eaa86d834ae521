"""bench_runtime's workload: the requests every system replays (``Job``), what each system reports
for one (``Outcome``), and the clock the replay runs on (``ReplayClock``)."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from batchpilot_runtime.replay.trace import (
    TraceRequest,
    TraceScaling,
    read_trace,
    scale_trace,
    time_scale_for_rate,
)


@dataclass(frozen=True)
class Job:
    """One request of the replay: when it arrives (s from the replay's start) and what it asks."""

    index: int
    arrival_s: float
    prompt: list[int]
    output_tokens: int


@dataclass(frozen=True)
class Outcome:
    index: int
    arrival_s: float
    first_token_s: float
    finished_s: float
    output_tokens: int


class ReplayClock:
    """Seconds since the replay started: the trace's arrival times live on this clock.

    ``cpu`` (the default) counts this thread's CPU time, plus the idle gaps the replay skips
    instead of sleeping through them. With one torch thread every system computes on the
    calling thread, so this clock measures the work each system does as if it had a core to
    itself: the other processes of a shared machine do not leak into the figures, and the
    systems, run one after the other, are compared on equal terms. ``wall`` is real time (for
    a dedicated machine), where idle gaps are slept.

    ``scale`` (cpu only) multiplies the CPU time counted: 0.8 replays as if on a host 1.25x as fast,
    which moves where static batches close (--clock-scale).
    """

    def __init__(self, kind: str, scale: float = 1.0) -> None:
        if kind not in ("cpu", "wall"):
            raise ValueError(f"clock must be 'cpu' or 'wall', got {kind!r}")
        if scale <= 0 or (kind == "wall" and scale != 1.0):
            raise ValueError(f"clock scale: must be > 0, and 1 with the wall clock, got {scale} ({kind})")
        self.kind = kind
        self.scale = scale
        self._read = time.thread_time if kind == "cpu" else time.monotonic
        self.origin = self._read()
        self.skipped_s = 0.0

    def reset(self) -> None:
        self.origin = self._read()
        self.skipped_s = 0.0

    def __call__(self) -> float:
        return (self._read() - self.origin) * self.scale + self.skipped_s

    def idle_until(self, wake_s: float) -> None:
        """Nothing to do before ``wake_s``: skip (cpu) or sleep (wall) up to it."""
        delay_s = wake_s - self()
        if delay_s <= 0 or delay_s == float("inf"):
            return
        if self.kind == "cpu":
            self.skipped_s += delay_s
        else:
            time.sleep(min(delay_s, 0.05))


def make_jobs(args: argparse.Namespace, vocab_size: int) -> tuple[list[Job], TraceScaling]:
    trace = read_trace(args.trace)
    window_slice = scale_trace(trace, TraceScaling(start_s=args.start_s, limit=args.requests))
    time_scale = time_scale_for_rate(window_slice, args.rate)
    scaling = TraceScaling(
        time_scale=time_scale,
        token_scale=args.token_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        start_s=args.start_s,
        limit=args.requests,
    )
    scaled: list[TraceRequest] = scale_trace(trace, scaling)
    rng = random.Random(args.seed)
    jobs = [
        Job(i, r.arrival_s, [rng.randrange(vocab_size) for _ in range(r.prompt_tokens)], r.output_tokens)
        for i, r in enumerate(scaled)
    ]
    return jobs, scaling
