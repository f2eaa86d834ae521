"""The pure half of ``bench_live``: the SLO rule, judging one live probe, and the capacity searches.

Nothing here starts a server or reads a clock: a probe is judged from the loadgen's per-request
results, and the searches take the probe as a function, so that the tests run them on stand-ins.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from batchpilot_operator.sim.metrics import exact_quantile
from batchpilot_operator.sim.slo import DualSLO, bisect_capacity
from batchpilot_runtime.replay.trace import TraceRequest

# The SLO of an engine, from its own latencies measured alone on this host (``slo_for``).
TTFT_OVER_LIGHT = 8.0
ITL_OVER_LIGHT = 4.0
ITL_OVER_PREFILL = 2.0


@dataclass(frozen=True)
class LightRun:
    """An engine's latencies with one request at a time: a median-length prompt, then its decode."""

    ttft_p50_s: float
    itl_p50_s: float


def slo_for(light: LightRun, live_budget: bool = True) -> tuple[DualSLO, str]:
    """The dual SLO for an engine on this host, and why. The first-token target is ``TTFT_OVER_LIGHT``
    times the first token of a median prompt served alone. The inter-token target is ``ITL_OVER_LIGHT``
    times a decode step served alone when the window's prompt budget is live (chunked prefill bounds
    what a step adds to a gap); without one (llama-server behind the gate: ``--batch-size`` is a start-up
    flag) a running stream's gap holds each arriving prompt's whole prefill, and a target below one would
    be met at no load but the lightest, so it is at least ``ITL_OVER_PREFILL`` times that first token.
    Both leave room for batching and a queue; past capacity neither is met."""
    if not (light.ttft_p50_s > 0 and light.itl_p50_s > 0):
        raise ValueError(f"light-load latencies must be > 0, got {light}")
    decode_bound = ITL_OVER_LIGHT * light.itl_p50_s
    prefill_bound = 0.0 if live_budget else ITL_OVER_PREFILL * light.ttft_p50_s
    slo = DualSLO(round(TTFT_OVER_LIGHT * light.ttft_p50_s, 3), round(max(decode_bound, prefill_bound), 4))
    first = (
        f"first token P99 {slo.ttft_p99_s * 1000:.0f} ms = {TTFT_OVER_LIGHT:g} x the first token of a median "
        f"prompt served alone ({light.ttft_p50_s * 1000:.1f} ms)"
    )
    if prefill_bound > decode_bound:
        gap = (
            f"inter-token P99 {slo.itl_p99_s * 1000:.1f} ms = {ITL_OVER_PREFILL:g} x that first token: no live "
            f"prompt budget, so a gap holds a whole prompt's prefill ({ITL_OVER_LIGHT:g} x a decode step served "
            f"alone, {light.itl_p50_s * 1000:.1f} ms, would be {decode_bound * 1000:.1f} ms)"
        )
    else:
        gap = (
            f"inter-token P99 {slo.itl_p99_s * 1000:.1f} ms = {ITL_OVER_LIGHT:g} x a decode step served alone "
            f"({light.itl_p50_s * 1000:.1f} ms)"
        )
    return slo, f"{first}; {gap}"


def allowed_misses(count: int) -> int:
    """How many of ``count`` values may miss a P99 target (nearest rank), as ``sim.slo`` counts them."""
    return count - math.ceil(0.99 * count) if count else 0


@dataclass
class ProbeTally:
    """A probe's results as they arrive, and whether it can still meet the SLO (``lost``)."""

    slo: DualSLO
    planned: int
    planned_gaps: int
    ttfts: list[float] = field(default_factory=list)  # completed requests only
    gaps: list[float] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)  # outcome -> count, every one not completed
    ttft_misses: int = 0
    gap_misses: int = 0

    def add(self, outcome: str, ttft_s: float | None, gaps_s: Sequence[float]) -> None:
        if outcome != "completed" or ttft_s is None:
            self.failed[outcome] = self.failed.get(outcome, 0) + 1
            self.ttft_misses += 1
            return
        self.ttfts.append(ttft_s)
        self.gaps.extend(gaps_s)
        self.ttft_misses += ttft_s > self.slo.ttft_p99_s
        self.gap_misses += sum(1 for g in gaps_s if g > self.slo.itl_p99_s)

    @property
    def lost(self) -> bool:
        """More misses than P99 allows over the whole probe: no later result can bring it back."""
        return self.ttft_misses > allowed_misses(self.planned) or self.gap_misses > allowed_misses(self.planned_gaps)


@dataclass(frozen=True)
class ProbeResult:
    """One live probe, judged as ``sim.slo.judge`` judges a replay: every planned request counts, one
    not completed (refused, failed, or cut off when the probe was stopped) as an infinite first token."""

    multiplier: float
    requests: int
    completed: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    stopped_early: bool  # ended as soon as it could no longer meet the SLO
    failed: dict[str, int]
    meets: bool
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)  # what the server or the operator said

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in self.__dict__.items()}


def judge_probe(
    tally: ProbeTally, multiplier: float, stopped_early: bool, wall_s: float, extra: dict[str, Any] | None = None
) -> ProbeResult:
    unfinished = tally.planned - len(tally.ttfts)
    ttfts = sorted(tally.ttfts) + [math.inf] * unfinished
    gaps = sorted(tally.gaps)
    ttft_p99 = exact_quantile(ttfts, 0.99) if ttfts else math.nan
    itl_p99 = exact_quantile(gaps, 0.99) if gaps else 0.0
    meets = (
        not stopped_early and unfinished == 0 and ttft_p99 <= tally.slo.ttft_p99_s and itl_p99 <= tally.slo.itl_p99_s
    )
    return ProbeResult(
        multiplier=multiplier,
        requests=tally.planned,
        completed=len(tally.ttfts),
        ttft_p50_s=exact_quantile(ttfts, 0.5) if ttfts else math.nan,
        ttft_p99_s=ttft_p99,
        itl_p50_s=exact_quantile(gaps, 0.5) if gaps else 0.0,
        itl_p99_s=itl_p99,
        stopped_early=stopped_early,
        failed=dict(tally.failed),
        meets=meets,
        wall_s=wall_s,
        extra=dict(extra or {}),
    )


def probe_arrivals(
    requests: Sequence[TraceRequest], base_rate_per_s: float, multiplier: float, duration_s: float, seed: int = 0
) -> list[TraceRequest]:
    """The requests one probe sends: the whole trace compressed into ``duration_s`` seconds and thinned to
    ``multiplier`` x ``base_rate_per_s`` on average. Every probe covers the trace's whole shape (its
    bursts, a day's drift) in the same time; a request kept at one load is kept at every heavier one
    (each has a fixed draw from ``seed``), so that a heavier probe sends a superset of a lighter one's."""
    if not (base_rate_per_s > 0 and multiplier > 0 and duration_s > 0):
        raise ValueError(
            f"rate, multiplier and duration must be > 0, got {base_rate_per_s}, {multiplier}, {duration_s}"
        )
    if len(requests) < 2:
        raise ValueError(f"a trace of {len(requests)} request(s) has no rate to scale")
    first, last = requests[0].arrival_s, requests[-1].arrival_s
    span_s = max(last - first, 1e-9)
    keep = multiplier * base_rate_per_s * duration_s / len(requests)
    if keep > 1:
        raise ValueError(
            f"x{multiplier:g} of {base_rate_per_s:g} requests/s for {duration_s:g} s needs "
            f"{multiplier * base_rate_per_s * duration_s:.0f} requests; the trace has {len(requests)}"
        )
    draws = random.Random(seed)
    chosen = []
    for r in requests:
        if draws.random() < keep:
            chosen.append(TraceRequest((r.arrival_s - first) / span_s * duration_s, r.prompt_tokens, r.output_tokens))
    return chosen


@dataclass(frozen=True)
class Grid:
    """The loads a search may try: multipliers ``lo`` to ``hi`` in steps of ``step``."""

    lo: float
    hi: float
    step: float

    def __post_init__(self) -> None:
        if not (0 < self.lo <= self.hi and self.step > 0):
            raise ValueError(f"a grid needs 0 < lo <= hi and step > 0, got {self}")


def search(meets: Callable[[float], bool], grid: Grid, guess: float | None = None) -> float:
    """The capacity of one window or policy on the grid: ``sim.slo.bisect_capacity``, or with a ``guess``
    (the simulator's answer, or another policy's live one) ``gallop_capacity`` from it."""
    if guess is None:
        return bisect_capacity(meets, grid.lo, grid.hi, grid.step)
    return gallop_capacity(meets, grid, guess)


def gallop_capacity(meets: Callable[[float], bool], grid: Grid, guess: float) -> float:
    """The largest load on the grid at which ``meets`` holds (0 when ``grid.lo`` fails), found from
    ``guess``: probe it, then step away from it by 1, 2, 4, ... grid steps until the answer changes,
    then bisect between the last load that met and the first that did not. The same answer as
    ``bisect_capacity`` for a monotone ``meets``; a live probe costs a minute, and a guess within a
    step of the capacity costs two probes where bisecting the grid costs five or more."""
    low_end, high_end = math.ceil(grid.lo / grid.step - 1e-9), math.floor(grid.hi / grid.step + 1e-9)

    def at(index: int) -> float:
        return round(index * grid.step, 6)

    start = min(high_end, max(low_end, round(guess / grid.step)))
    stride = 1
    if meets(at(start)):
        low = start
        while True:
            if low == high_end:
                return at(low)
            above = min(high_end, low + stride)
            if not meets(at(above)):
                high = above
                break
            low, stride = above, stride * 2
    else:
        high = start
        while True:
            if high == low_end:
                return 0.0
            below = max(low_end, high - stride)
            if meets(at(below)):
                low = below
                break
            high, stride = below, stride * 2
    while high - low > 1:
        mid = (low + high) // 2
        if meets(at(mid)):
            low = mid
        else:
            high = mid
    return at(low)


def best_window_search(
    meets: Callable[[Any, float], bool], windows: Sequence[Any], grid: Grid, guess: float | None = None
) -> tuple[float, Any, dict[str, float | None]]:
    """The best fixed window in hindsight, with fewer probes than one search per window: the first window
    is searched in full (from ``guess`` when given, see ``search``); each next one is first tried one step above the best capacity so far, and searched
    further only when it meets there (a window that cannot beat the best costs one probe). Returns the
    capacity, the window that reached it and each window's capacity by its label (None: not above the best
    so far, where its search stopped). No (window, load) is probed twice."""
    if not windows:
        raise ValueError("no windows to search")
    seen: dict[tuple[str, float], bool] = {}

    def probe(window: Any, multiplier: float) -> bool:
        key = (_label(window), multiplier)
        if key not in seen:
            seen[key] = meets(window, multiplier)
        return seen[key]

    best, best_window = search(lambda m: probe(windows[0], m), grid, guess), windows[0]
    found: dict[str, float | None] = {_label(windows[0]): best}
    for window in windows[1:]:
        above = round(best + grid.step, 6)
        if above > grid.hi + 1e-9 or not probe(window, above):
            found[_label(window)] = None
            continue
        capacity = search(partial(probe, window), Grid(above, grid.hi, grid.step), above)
        found[_label(window)] = capacity
        if capacity > best:
            best, best_window = capacity, window
    return best, best_window, found


def _label(window: Any) -> str:
    return str(getattr(window, "label", window))
