"""Day-long request replays sampled from the Alibaba ServeGen production statistics.

ServeGen (``alibaba/ServeGen``, Apache-2.0; Xiang et al., "ServeGen: Workload
Characterization of Large Language Model Serving in Production", arXiv:2505.09999)
publishes, for two language models (``m-large``, ``m-small``) over 14 days, per client:

- ``chunk-<client>-trace.csv`` (no header): one row per 600 s window, ``timestamp``
  (window start, 0 = 00:00 of day 0), ``rate`` (req/s), ``cv``, ``pat_name``
  (``Weibull``, ``Gamma`` or empty when idle), ``pat_arg1``/``pat_arg2`` (shape and
  scale of the fitted inter-arrival distribution);
- ``chunk-<client>-dataset.json``: per 6-hour window start, the PMFs of
  ``input_tokens`` and ``output_tokens`` (each a string ``{tokens: probability}``).
  Some clients' files are absent from the shared snapshot; their requests take the
  rate-weighted mix of the present clients' PMFs of the same 6-hour window.

:mod:`batchpilot_runtime.replay.servegen_data` reads a model's tarball
(``servegen_data_language_<model>.tar.gz``, read in place with :mod:`tarfile`) into
dataclasses, re-exported here; this module samples :class:`TraceRequest` lists from them:

- arrivals: per client, a renewal process whose gaps follow the client's fitted
  distribution of the window in force (Weibull or Gamma with the fitted shape; the
  scale rescaled so that the mean gap is ``1 / (rate * rate_scale)``; exponential, i.e.
  Poisson, when a window has a rate but no fitted pattern). The process runs in
  "operational time" (the integral of the rate), so it carries over window boundaries
  instead of restarting at every window (a restart adds ``(cv^2 - 1) / 2`` arrivals per
  window, a large bias for bursty clients at low scaled rates), idle windows get no
  arrival, and each window's expected count is its rate times its length;
- lengths: prompt and output tokens drawn *independently* from the client's PMFs of the
  enclosing 6-hour window (ServeGen's own generator uses one uniform number for both,
  which makes them perfectly rank-correlated), clipped to >= 1.

A replay is written as a CSV in the Azure format that :func:`trace.read_trace` reads
(``TIMESTAMP,ContextTokens,GeneratedTokens``, timestamps in plain seconds), so that the
load generator and the benchmarks take it as ``--trace CSV``. Pure Python and numpy; the
command line that writes one is ``batchpilot-runtime servegen`` (:mod:`batchpilot_runtime.cli.servegen`).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchpilot_runtime.replay.servegen_data import (
    DAY_S,
    DEFAULT_MAX_REQUESTS,
    LENGTH_WINDOW_S,
    PATTERNS,
    SERVEGEN_ENV,
    SHARED_SERVEGEN_PATH,
    WINDOW_S,
    ArrivalWindow,
    FloatArray,
    IntArray,
    LengthWindow,
    ServeGenClient,
    ServeGenData,
    TokenPMF,
    available_models,
    default_servegen_dir,
    load_servegen,
    tarball_path,
)
from batchpilot_runtime.replay.trace import TRACE_COLUMNS, TraceRequest

__all__ = [
    "DAY_S",
    "DEFAULT_MAX_REQUESTS",
    "LENGTH_WINDOW_S",
    "PATTERNS",
    "SERVEGEN_ENV",
    "SHARED_SERVEGEN_PATH",
    "WINDOW_S",
    "ArrivalWindow",
    "FloatArray",
    "IntArray",
    "LengthWindow",
    "Replay",
    "ReplaySummary",
    "ServeGenClient",
    "ServeGenData",
    "TokenPMF",
    "WindowStats",
    "available_models",
    "default_servegen_dir",
    "describe",
    "drifting_day",
    "generate_replay",
    "load_servegen",
    "prompt_drift",
    "raw_mean_rate",
    "select_clients",
    "steadiest_day",
    "summarize",
    "tarball_path",
    "write_trace_csv",
]

# Operational time (mean gaps) the arrival process runs before the replay starts, so that the
# first arrivals are not those of a process that just restarted.
_WARMUP_GAPS = 50.0


# --------------------------------------------------------------------------- generation


def _unit_gaps(rng: np.random.Generator, pattern: str, shape: float, n: int) -> FloatArray:
    """``n`` inter-arrival gaps of mean 1 with the pattern's shape (the fitted scale rescaled)."""
    if pattern == "Gamma":
        return rng.gamma(shape, 1.0 / shape, n)
    if pattern == "Weibull":
        return rng.weibull(shape, n) / math.gamma(1.0 + 1.0 / shape)
    return rng.exponential(1.0, n)


def _client_arrivals(
    client: ServeGenClient, start_s: float, end_s: float, rate_scale: float, rng: np.random.Generator
) -> FloatArray:
    """Absolute arrival times of one client in ``[start_s, end_s)`` (see the module docstring)."""
    first = max(0, int(start_s // WINDOW_S))
    last = min(len(client.windows), math.ceil(end_s / WINDOW_S))
    spans: list[tuple[float, float, float, str, float]] = []  # t0, t1, scaled rate, pattern, shape
    for w in client.windows[first:last]:
        t0, t1 = max(start_s, w.start_s), min(end_s, w.start_s + WINDOW_S)
        if t1 > t0 and w.rate_per_s > 0:
            spans.append((t0, t1, w.rate_per_s * rate_scale, w.pattern, w.shape))
    if not spans:
        return np.empty(0, dtype=np.float64)
    # Warm up from -_WARMUP_GAPS in operational time with the first active window's law.
    _, _, _, pattern, shape = spans[0]
    position = -_WARMUP_GAPS
    while True:
        steps = np.cumsum(_unit_gaps(rng, pattern, shape, 64))
        ahead = np.nonzero(position + steps >= 0.0)[0]
        if ahead.size:
            nxt = float(position + steps[ahead[0]])
            break
        position += float(steps[-1])
    out: list[FloatArray] = []
    lam = 0.0  # operational time at the start of the current span
    for t0, t1, rate, pattern, shape in spans:
        lam_end = lam + rate * (t1 - t0)
        if nxt < lam_end:
            taus = [np.array([nxt])]
            current = nxt
            while True:
                need = max(16, int(1.25 * (lam_end - current)) + 16)
                steps = current + np.cumsum(_unit_gaps(rng, pattern, shape, need))
                beyond = np.nonzero(steps >= lam_end)[0]
                if beyond.size:
                    taus.append(steps[: beyond[0]])
                    nxt = float(steps[beyond[0]])
                    break
                taus.append(steps)
                current = float(steps[-1])
            window_taus = np.concatenate(taus)
            out.append(t0 + (window_taus - lam) / rate)
        lam = lam_end
    return np.concatenate(out) if out else np.empty(0, dtype=np.float64)


def _check_span(data: ServeGenData, day: int, start_s: float, duration_s: float) -> tuple[float, float]:
    if isinstance(day, bool) or not isinstance(day, int) or not 0 <= day < data.days:
        raise ValueError(f"day {day!r} out of range: {data.model} has {data.days} days (0..{data.days - 1})")
    if not (math.isfinite(start_s) and 0 <= start_s < DAY_S):
        raise ValueError(f"start_s must be in [0, 86400) seconds into the day, got {start_s}")
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    begin = day * DAY_S + start_s
    end = begin + duration_s
    if end > data.days * DAY_S + 1e-9:
        raise ValueError(
            f"the replay (day {day}, {start_s:g} s + {duration_s:g} s) runs past the end of the data ({data.days} days)"
        )
    return begin, end


def select_clients(data: ServeGenData, begin_s: float, end_s: float, max_clients: int | None) -> list[ServeGenClient]:
    """The clients with traffic in ``[begin_s, end_s)``, busiest first, at most ``max_clients``."""
    rated = [(c.mean_rate(begin_s, end_s), c) for c in data.clients]
    rated = [(r, c) for r, c in rated if r > 0]
    rated.sort(key=lambda rc: (-rc[0], rc[1].client_id))
    chosen = rated if max_clients is None else rated[:max_clients]
    return [c for _, c in chosen]


def raw_mean_rate(data: ServeGenData, begin_s: float, end_s: float, max_clients: int | None = None) -> float:
    """Mean requests/s of the (selected) clients over ``[begin_s, end_s)`` of the raw data."""
    return sum(c.mean_rate(begin_s, end_s) for c in select_clients(data, begin_s, end_s, max_clients))


@dataclass(frozen=True)
class Replay:
    """What :func:`generate_replay` made and how: the requests and the scaling it used."""

    requests: list[TraceRequest]
    model: str
    day: int
    start_s: float
    duration_s: float
    rate_scale: float
    raw_mean_rate_per_s: float
    clients: int
    seed: int

    @property
    def expected_rate_per_s(self) -> float:
        return self.raw_mean_rate_per_s * self.rate_scale

    def describe(self) -> str:
        return (
            f"ServeGen {self.model} day {self.day} {self.start_s / 3600:g}h..{(self.start_s + self.duration_s) / 3600:g}h, "
            f"{self.clients} clients, rates x{self.rate_scale:.4g} "
            f"(raw {self.raw_mean_rate_per_s:.4g} req/s -> {self.expected_rate_per_s:.4g} req/s), seed {self.seed}"
        )


def _client_lengths(
    data: ServeGenData, client: ServeGenClient, arrivals: FloatArray, rng: np.random.Generator
) -> tuple[IntArray, IntArray]:
    """Prompt and output tokens (each >= 1) of ``client``'s requests arriving at ``arrivals``, drawn
    from the PMFs of each one's 6-hour window."""
    prompt = np.ones(arrivals.size, dtype=np.int64)
    output = np.ones(arrivals.size, dtype=np.int64)
    window_index = (arrivals // LENGTH_WINDOW_S).astype(np.int64)
    for index in np.unique(window_index):
        chosen = window_index == index
        n = int(chosen.sum())
        pin, pout = data.pmfs_for(client, float(index) * LENGTH_WINDOW_S)
        if pin is None or pout is None:
            raise ValueError(
                f"{data.model}: no client has token lengths for the 6-hour window starting at "
                f"{float(index) * LENGTH_WINDOW_S:g} s"
            )
        # Two separate uniform streams: input and output lengths are independent.
        prompt[chosen] = pin.sample(rng, n)
        output[chosen] = pout.sample(rng, n)
    return np.maximum(prompt, 1), np.maximum(output, 1)


def generate_replay(
    data: ServeGenData,
    day: int,
    start_s: float = 0.0,
    duration_s: float = DAY_S,
    rate_scale: float = 1.0,
    seed: int = 0,
    *,
    target_mean_rate_per_s: float | None = None,
    max_clients: int | None = None,
    max_requests: int | None = DEFAULT_MAX_REQUESTS,
) -> Replay:
    """Sample the requests of ``[start_s, start_s + duration_s)`` of ``day`` (0-based), sorted,
    ``arrival_s`` relative to the start of the replay; deterministic for a seed, with the scaling it used.

    ``rate_scale`` multiplies every client's rate; ``target_mean_rate_per_s`` (instead) picks
    the scale that makes the expected mean rate over the span equal the target (the realized
    rate varies around it, more for bursty spans). ``max_clients`` keeps only the busiest
    clients of the span (their raw rates; the target, if any, then applies to them alone).
    ``max_requests`` refuses replays expected to be larger (None: no limit)."""
    begin, end = _check_span(data, day, start_s, duration_s)
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if target_mean_rate_per_s is not None:
        if rate_scale != 1.0:
            raise ValueError("give either rate_scale or target_mean_rate_per_s, not both")
        if not (math.isfinite(target_mean_rate_per_s) and target_mean_rate_per_s > 0):
            raise ValueError(f"target_mean_rate_per_s must be > 0, got {target_mean_rate_per_s}")
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be >= 1, got {max_clients}")
    clients = select_clients(data, begin, end, max_clients)
    raw = sum(c.mean_rate(begin, end) for c in clients)
    if target_mean_rate_per_s is not None:
        if raw <= 0:
            raise ValueError(f"{data.model} day {day} has no traffic in the chosen span: no rate to scale")
        rate_scale = target_mean_rate_per_s / raw
    expected = raw * rate_scale * (end - begin)
    if max_requests is not None and expected > max_requests:
        raise ValueError(
            f"the replay would hold about {expected:,.0f} requests (raw {raw:.4g} req/s x{rate_scale:g} over "
            f"{end - begin:g} s), more than max_requests={max_requests:,}: lower rate_scale, set "
            "target_mean_rate_per_s or shorten the span"
        )
    times: list[FloatArray] = []
    prompts: list[IntArray] = []
    outputs: list[IntArray] = []
    for client in clients:
        arrivals = _client_arrivals(client, begin, end, rate_scale, np.random.default_rng([seed, client.client_id, 0]))
        if arrivals.size == 0:
            continue
        prompt, output = _client_lengths(data, client, arrivals, np.random.default_rng([seed, client.client_id, 1]))
        times.append(arrivals)
        prompts.append(prompt)
        outputs.append(output)
    requests: list[TraceRequest] = []
    if times:
        all_times = np.concatenate(times) - begin
        order = np.argsort(all_times, kind="stable")
        all_prompts = np.concatenate(prompts)[order]
        all_outputs = np.concatenate(outputs)[order]
        requests = [
            TraceRequest(t, p, o)
            for t, p, o in zip(all_times[order].tolist(), all_prompts.tolist(), all_outputs.tolist(), strict=True)
        ]
    return Replay(requests, data.model, day, start_s, duration_s, rate_scale, raw, len(clients), seed)


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class WindowStats:
    """One 6-hour window of a model: total mean rate and the request-weighted length quantiles."""

    day: int
    start_s: float  # seconds into the day
    mean_rate_per_s: float
    prompt_p50: int
    prompt_p99: int
    output_p50: int
    output_p99: int
    token_coverage: float  # share of the rate from clients whose own PMFs are present


def describe(data: ServeGenData, day: int | None = None) -> list[WindowStats]:
    """Per 6-hour window (of ``day``, or of every day): mean rate and prompt/output P50/P99 of
    the rate-weighted mix (absent clients take the present clients' mix, so it is that mix)."""
    days = range(data.days) if day is None else [day]
    if day is not None:
        _check_span(data, day, 0.0, DAY_S)
    per_day = int(DAY_S // LENGTH_WINDOW_S)
    stats = []
    for d in days:
        for k in range(per_day):
            begin = d * DAY_S + k * LENGTH_WINDOW_S
            end = begin + LENGTH_WINDOW_S
            total = covered = 0.0
            for client in data.clients:
                rate = client.mean_rate(begin, end)
                total += rate
                lw = client.length_window(begin)
                if lw is not None and lw.input_tokens is not None and lw.output_tokens is not None:
                    covered += rate
            mix = data.mix(begin)
            pin, pout = mix.input_tokens, mix.output_tokens
            stats.append(
                WindowStats(
                    day=d,
                    start_s=k * LENGTH_WINDOW_S,
                    mean_rate_per_s=total,
                    prompt_p50=pin.quantile(0.5) if pin else 0,
                    prompt_p99=pin.quantile(0.99) if pin else 0,
                    output_p50=pout.quantile(0.5) if pout else 0,
                    output_p99=pout.quantile(0.99) if pout else 0,
                    token_coverage=covered / total if total > 0 else 0.0,
                )
            )
    return stats


def prompt_drift(data: ServeGenData) -> list[float]:
    """Per day: the largest 6-hour prompt P50 over the smallest (1.0 when a day lacks data)."""
    ratios = []
    for d in range(data.days):
        p50s = [s.prompt_p50 for s in describe(data, d) if s.prompt_p50 > 0]
        ratios.append(max(p50s) / min(p50s) if p50s else 1.0)
    return ratios


def drifting_day(data: ServeGenData) -> int:
    """The day whose 6-hour prompt P50s differ most (largest max/min ratio within the day)."""
    ratios = prompt_drift(data)
    return max(range(len(ratios)), key=lambda d: (ratios[d], -d))


def steadiest_day(data: ServeGenData) -> int:
    """The day whose 6-hour prompt P50s differ least, among the days with lengths in every window:
    a day a window could have been tuned on before the lengths drifted."""
    ratios = []
    for d in range(data.days):
        p50s = [s.prompt_p50 for s in describe(data, d)]
        if p50s and min(p50s) > 0:
            ratios.append((max(p50s) / min(p50s), d))
    if not ratios:
        raise ValueError(f"{data.model}: no day has prompt lengths in all of its 6-hour windows")
    return min(ratios)[1]


@dataclass(frozen=True)
class ReplaySummary:
    requests: int
    duration_s: float
    mean_rate_per_s: float
    peak_10min_rate_per_s: float
    prompt_p50: float
    prompt_p99: float
    output_p50: float
    output_p99: float


def summarize(requests: Sequence[TraceRequest], duration_s: float) -> ReplaySummary:
    """Counts, rates and length quantiles of a replay spanning ``duration_s`` seconds."""
    if not requests:
        return ReplaySummary(0, duration_s, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    arrivals = np.array([r.arrival_s for r in requests])
    prompts = np.array([r.prompt_tokens for r in requests])
    outputs = np.array([r.output_tokens for r in requests])
    bins = np.bincount((arrivals // WINDOW_S).astype(np.int64))
    return ReplaySummary(
        requests=len(requests),
        duration_s=duration_s,
        mean_rate_per_s=len(requests) / duration_s,
        peak_10min_rate_per_s=float(bins.max()) / min(WINDOW_S, duration_s),
        prompt_p50=float(np.percentile(prompts, 50)),
        prompt_p99=float(np.percentile(prompts, 99)),
        output_p50=float(np.percentile(outputs, 50)),
        output_p99=float(np.percentile(outputs, 99)),
    )


def write_trace_csv(requests: Sequence[TraceRequest], path: Path | str) -> Path:
    """Write ``TIMESTAMP,ContextTokens,GeneratedTokens`` (TIMESTAMP in plain seconds from the
    replay's start, microsecond resolution), the format :func:`trace.read_trace` reads. Note
    that ``read_trace`` counts time from the first request, not from the replay's start."""
    path = Path(path)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(TRACE_COLUMNS)
        for r in requests:
            writer.writerow((f"{r.arrival_s:.6f}", r.prompt_tokens, r.output_tokens))
    return path
