"""Traffic shapes for the no-regret suite (issue 31), built from the traces the project ships.

Each shape is a list of :class:`TraceRequest` at its own nominal rate (the suite's capacity search
multiplies it), labelled with what it stands for:

- ``azure``: the shared Azure conversation hour, as ``bench_slo`` replays it;
- ``code_completion``: long prompts and short answers: the Azure hour's arrivals, lengths drawn from
  the ServeGen client windows (both models) whose prompt P50 lies in 1-6k tokens and answer P50
  under 64;
- ``long_context_bursts``: contexts of several thousand tokens with answers of a few hundred
  (client windows with prompt P50 in 3-8k and answer P50 in 100-600), arriving in bursts of tens
  within one second;
- ``low_rate``: the Azure hour's lengths at a few requests a minute, with a burst of 20-40
  simultaneous arrivals every few minutes;
- ``rate_doubling``: the Azure hour whose rate doubles over three minutes a third of the way in;
- ``servegen_drift`` / ``servegen_steady``: the m-large days whose prompt lengths drift most and
  least (``bench_slo.servegen_day``).

Lengths are clipped so that prompt + answer fit the simulated engine's context (8192 tokens): a
request that cannot fit is an error, not load. Deterministic for a seed.
"""

from __future__ import annotations

import functools
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchpilot_runtime.replay.servegen_data import ServeGenData
from batchpilot_runtime.replay.trace import TraceRequest, read_trace

MAX_CONTEXT_TOKENS = 8192
AZURE_RATE_PER_S = 5.5  # the shared hour's mean rate (traces/README.md)


@dataclass(frozen=True)
class Shape:
    name: str
    label: str
    requests: tuple[TraceRequest, ...]

    def describe(self) -> dict[str, float | int | str]:
        prompts = sorted(r.prompt_tokens for r in self.requests)
        outputs = sorted(r.output_tokens for r in self.requests)
        span_s = max(1e-9, self.requests[-1].arrival_s) if self.requests else 1.0
        return {
            "label": self.label,
            "requests": len(self.requests),
            "mean_rate_per_min": 60.0 * len(self.requests) / span_s,
            "prompt_p50": int(statistics.median(prompts)),
            "prompt_p90": prompts[int(0.9 * (len(prompts) - 1))],
            "output_p50": int(statistics.median(outputs)),
            "output_p90": outputs[int(0.9 * (len(outputs) - 1))],
            "largest_1s_burst": largest_burst(self.requests, 1.0),
        }


def largest_burst(requests: tuple[TraceRequest, ...] | list[TraceRequest], span_s: float) -> int:
    """Most arrivals within any ``span_s`` (the requests sorted by arrival)."""
    best, first = 0, 0
    for last, request in enumerate(requests):
        while request.arrival_s - requests[first].arrival_s > span_s:
            first += 1
        best = max(best, last - first + 1)
    return best


def fit_context(prompt: int, output: int) -> tuple[int, int]:
    """Prompt and answer clipped to the engine's context (the answer keeps at most half of it)."""
    output = max(1, min(output, MAX_CONTEXT_TOKENS // 2))
    return max(1, min(prompt, MAX_CONTEXT_TOKENS - output)), output


@functools.cache
def _servegen(model: str) -> ServeGenData:
    from batchpilot_runtime.replay import servegen

    return servegen.load_servegen(model)


LengthSampler = Callable[[np.random.Generator, int], list[tuple[int, int]]]


def servegen_lengths(match: Callable[[int, int], bool]) -> LengthSampler:
    """A sampler of (prompt, answer) from the ServeGen client windows (m-large and m-small) whose
    prompt P50 and answer P50 satisfy ``match``: a window is drawn in proportion to its client's
    rate in it (every window at least a little), then prompt and answer independently from its PMFs."""
    windows = []
    weights = []
    for model in ("m-large", "m-small"):
        data = _servegen(model)
        for client in data.clients:
            for window in client.lengths or ():
                pin, pout = window.input_tokens, window.output_tokens
                if pin is None or pout is None or not match(pin.quantile(0.5), pout.quantile(0.5)):
                    continue
                windows.append((pin, pout))
                weights.append(client.mean_rate(window.start_s, window.start_s + 21_600.0) + 1e-3)
    if not windows:
        raise ValueError("no ServeGen client window matches the shape")
    probabilities = np.asarray(weights) / sum(weights)

    def sample(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
        chosen = rng.choice(len(windows), size=n, p=probabilities)
        out: list[tuple[int, int]] = [(1, 1)] * n
        for index in np.unique(chosen):
            where = np.flatnonzero(chosen == index)
            pin, pout = windows[int(index)]
            prompts, outputs = pin.sample(rng, where.size), pout.sample(rng, where.size)
            for k, position in enumerate(where):
                out[int(position)] = fit_context(int(prompts[k]), int(outputs[k]))
        return out

    return sample


def azure_arrivals(trace: Path, minutes: float, rate_per_s: float) -> list[float]:
    """The shared hour's arrival times stretched to ``rate_per_s`` on average, the first ``minutes``."""
    stretch = AZURE_RATE_PER_S / rate_per_s
    times = [r.arrival_s * stretch for r in read_trace(trace)]
    return [t for t in times if t < minutes * 60.0]


def with_lengths(times: list[float], lengths: list[tuple[int, int]]) -> tuple[TraceRequest, ...]:
    return tuple(TraceRequest(t, p, o) for t, (p, o) in zip(sorted(times), lengths, strict=True))


def bursts(
    rng: random.Random, minutes: float, background_per_min: float, every_s: float, size: tuple[int, int]
) -> list[float]:
    """Poisson arrivals at ``background_per_min`` plus, about every ``every_s`` (exponential gaps),
    a burst of ``size`` (inclusive range) arrivals spread over one second."""
    end_s = minutes * 60.0
    times: list[float] = []
    t = rng.expovariate(background_per_min / 60.0) if background_per_min > 0 else end_s
    while t < end_s:
        times.append(t)
        t += rng.expovariate(background_per_min / 60.0)
    t = rng.uniform(0.0, every_s)
    while t < end_s:
        times.extend(t + rng.random() for _ in range(rng.randint(*size)))
        t += rng.expovariate(1.0 / every_s)
    return sorted(x for x in times if x < end_s)


def doubling(times: list[float], at_s: float, ramp_s: float) -> list[float]:
    """Arrival times whose rate doubles linearly over ``ramp_s`` from ``at_s`` (and stays doubled)."""
    out = []
    for t in times:
        if t <= at_s:
            out.append(t)
        elif t <= at_s + 1.5 * ramp_s:
            # rate factor 1 + (t' - at)/ramp: integrate the inverse of the warp over the ramp.
            out.append(at_s + _ramp_time(t - at_s, ramp_s))
        else:
            out.append(at_s + _ramp_time(ramp_s * 1.5, ramp_s) + (t - at_s - ramp_s * 1.5) / 2.0)
    return out


def _ramp_time(original_s: float, ramp_s: float) -> float:
    """Warped time after ``original_s`` of trace time into a ramp whose rate factor grows from 1 to 2
    over ``ramp_s`` of warped time: solve original = u + u^2 / (2 ramp) for u."""
    return float(ramp_s * (-1.0 + (1.0 + 2.0 * original_s / ramp_s) ** 0.5))


def build_shapes(trace: Path, minutes: float, seed: int = 0) -> list[Shape]:
    """Every shape of the suite that the shipped data can build, for ``minutes`` each."""
    from tests.bench.bench_slo import servegen_day

    azure = [r for r in read_trace(trace) if r.arrival_s < minutes * 60.0]
    azure_lengths = [(r.prompt_tokens, r.output_tokens) for r in read_trace(trace)]
    rng = np.random.default_rng(seed)
    shapes = [Shape("azure", "the shared Azure conversation hour", tuple(azure))]
    code = servegen_lengths(lambda p50, o50: 1800 <= p50 <= 7000 and o50 < 64)
    code_times = azure_arrivals(trace, minutes, 1.0)
    shapes.append(
        Shape(
            "code_completion",
            "long prompts, short answers (ServeGen code-like client windows; Azure arrivals at 1 req/s)",
            with_lengths(code_times, code(rng, len(code_times))),
        )
    )
    long_context = servegen_lengths(lambda p50, o50: 3000 <= p50 <= 8000 and 100 <= o50 <= 600)
    burst_times = bursts(random.Random(seed), minutes, 6.0, 20.0, (10, 30))
    shapes.append(
        Shape(
            "long_context_bursts",
            "contexts of several thousand tokens, answers of a few hundred, bursts of 10-30 in one second",
            with_lengths(burst_times, long_context(rng, len(burst_times))),
        )
    )
    low_times = bursts(random.Random(seed + 1), minutes, 3.0, 180.0, (20, 40))
    picks = random.Random(seed + 2).sample(azure_lengths, len(low_times))
    shapes.append(
        Shape(
            "low_rate",
            "a few requests a minute (Azure lengths), a burst of 20-40 in one second every few minutes",
            with_lengths(low_times, picks),
        )
    )
    span_s = minutes * 60.0
    warped = doubling([r.arrival_s for r in read_trace(trace)], span_s / 3.0, 180.0)
    doubled = [
        TraceRequest(t, r.prompt_tokens, r.output_tokens) for t, r in zip(warped, read_trace(trace), strict=True)
    ]
    shapes.append(
        Shape(
            "rate_doubling",
            "the Azure hour, its rate doubling over 3 minutes",
            tuple(r for r in doubled if r.arrival_s < span_s),
        )
    )
    for name, steady in (("servegen_drift", False), ("servegen_steady", True)):
        try:
            day, _ = servegen_day(minutes, len(azure) / span_s, steady=steady)
        except (FileNotFoundError, ValueError):
            continue
        label = "m-large's day whose prompt lengths drift " + ("least" if steady else "most")
        shapes.append(Shape(name, label, tuple(day)))
    return shapes
