"""Request traces in the Azure LLM inference trace format, and their scaling.

A trace row is ``TIMESTAMP,ContextTokens,GeneratedTokens``. Replays (the load
generator, the simulator, the benchmarks) read traces through this module so
that they scale time and tokens the same way and can say which scaling they
used. Pure Python: no torch, no I/O beyond reading the file.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# The whole hour, where the project is checked out beside ../shared (tests, benchmarks).
SHARED_TRACE_PATH = Path(__file__).resolve().parents[3] / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
# Its first 15 minutes ship with the package, so that replays work from any install.
BUNDLED_TRACE_PATH = Path(__file__).resolve().parents[1] / "data" / "azure_llm_2023_conv_15min.csv"
TRACE_ENV = "BATCHPILOT_TRACE"


def _default_trace_path() -> Path:
    chosen = os.environ.get(TRACE_ENV)
    if chosen:
        return Path(chosen)
    return SHARED_TRACE_PATH if SHARED_TRACE_PATH.exists() else BUNDLED_TRACE_PATH


# What a replay reads when given no trace: $BATCHPILOT_TRACE, else the shared hour, else the excerpt.
DEFAULT_TRACE_PATH = _default_trace_path()
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, line and column."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives (seconds from the trace's start) and its sizes."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TraceScaling:
    """How a trace was scaled for a replay.

    ``time_scale`` divides inter-arrival times (2.0 = twice the arrival rate);
    ``token_scale`` multiplies prompt and output lengths (0.1 = a tenth), each
    clamped to ``[min_tokens, max_*_tokens]``; ``start_s``/``duration_s`` pick a
    slice of the original trace before scaling.
    """

    time_scale: float = 1.0
    token_scale: float = 1.0
    min_tokens: int = 1
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    start_s: float = 0.0
    duration_s: float | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if not self.token_scale > 0:
            raise ValueError(f"token_scale must be > 0, got {self.token_scale}")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")

    def describe(self) -> str:
        parts = [f"time x{self.time_scale:g} (arrival rate)", f"tokens x{self.token_scale:g}"]
        if self.max_prompt_tokens is not None:
            parts.append(f"prompt <= {self.max_prompt_tokens}")
        if self.max_output_tokens is not None:
            parts.append(f"output <= {self.max_output_tokens}")
        if self.start_s or self.duration_s is not None:
            end = "end" if self.duration_s is None else f"{self.start_s + self.duration_s:g}s"
            parts.append(f"slice {self.start_s:g}s..{end} of the original")
        if self.limit is not None:
            parts.append(f"first {self.limit} requests")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "time_scale": self.time_scale,
            "token_scale": self.token_scale,
            "min_tokens": self.min_tokens,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_output_tokens": self.max_output_tokens,
            "start_s": self.start_s,
            "duration_s": self.duration_s,
            "limit": self.limit,
        }


def _parse_timestamp(text: str) -> float:
    """Seconds from a plain number or an ISO timestamp (the Azure trace's has seven
    fractional digits, one more than ``datetime`` takes)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    if "." in text:
        head, frac = text.split(".", 1)
        return datetime.fromisoformat(head).timestamp() + float("0." + frac)
    return datetime.fromisoformat(text).timestamp()


def read_trace(path: Path | str = DEFAULT_TRACE_PATH) -> list[TraceRequest]:
    """Read a trace CSV; arrival times are seconds since its first request, sorted."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    rows: list[tuple[float, int, int]] = []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}; expected {','.join(TRACE_COLUMNS)}")
        for line_no, row in enumerate(reader, start=2):
            try:
                stamp = _parse_timestamp(row["TIMESTAMP"])
                prompt = int(row["ContextTokens"])
                output = int(row["GeneratedTokens"])
            except (TypeError, ValueError) as error:
                raise TraceError(f"{path}:{line_no}: {error}") from None
            if prompt < 0 or output < 0:
                raise TraceError(f"{path}:{line_no}: token counts must be >= 0")
            rows.append((stamp, prompt, output))
    if not rows:
        raise TraceError(f"{path}: the trace has no requests")
    rows.sort(key=lambda r: r[0])
    start = rows[0][0]
    return [TraceRequest(stamp - start, prompt, output) for stamp, prompt, output in rows]


def scale_trace(requests: Sequence[TraceRequest], scaling: TraceScaling) -> list[TraceRequest]:
    """Apply a slice, then time and token scaling; arrivals restart at 0."""
    end = math.inf if scaling.duration_s is None else scaling.start_s + scaling.duration_s
    chosen = [r for r in requests if scaling.start_s <= r.arrival_s < end]
    if scaling.limit is not None:
        chosen = chosen[: scaling.limit]
    if not chosen:
        return []
    origin = chosen[0].arrival_s
    out = []
    for r in chosen:
        out.append(
            TraceRequest(
                arrival_s=(r.arrival_s - origin) / scaling.time_scale,
                prompt_tokens=_scale_tokens(r.prompt_tokens, scaling, scaling.max_prompt_tokens),
                output_tokens=_scale_tokens(r.output_tokens, scaling, scaling.max_output_tokens),
            )
        )
    return out


def _scale_tokens(count: int, scaling: TraceScaling, ceiling: int | None) -> int:
    scaled = max(scaling.min_tokens, round(count * scaling.token_scale))
    return scaled if ceiling is None else min(scaled, ceiling)


def time_scale_for_rate(requests: Sequence[TraceRequest], target_rate_per_s: float) -> float:
    """The time scale that makes the trace's mean arrival rate equal ``target_rate_per_s``."""
    if target_rate_per_s <= 0:
        raise ValueError("target rate must be > 0")
    span = requests[-1].arrival_s - requests[0].arrival_s if len(requests) > 1 else 0.0
    if span <= 0:
        return 1.0
    return target_rate_per_s / (len(requests) / span)


def arrival_rate_series(requests: Iterable[TraceRequest], bin_s: float) -> list[tuple[float, float]]:
    """(bin start, requests per second) for consecutive bins: the load's shape over time."""
    counts: dict[int, int] = {}
    last = 0
    for r in requests:
        index = int(r.arrival_s // bin_s)
        counts[index] = counts.get(index, 0) + 1
        last = max(last, index)
    return [(i * bin_s, counts.get(i, 0) / bin_s) for i in range(last + 1)]


def plan_replay(
    requests: Sequence[TraceRequest],
    *,
    time_scale: float | None = None,
    rate_per_s: float | None = None,
    token_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    start_s: float = 0.0,
    duration_s: float | None = None,
    limit: int | None = None,
) -> tuple[TraceScaling, list[TraceRequest]]:
    """Slice and scale a trace for a replay; ``rate_per_s`` sets the time scale that gives the
    *slice* that mean arrival rate (it wins over ``time_scale``). Raises ValueError when the
    slice selects no request."""
    time_scale = 1.0 if time_scale is None else time_scale
    if rate_per_s is not None:
        sliced = scale_trace(requests, TraceScaling(start_s=start_s, duration_s=duration_s, limit=limit))
        if not sliced:
            raise ValueError("the trace slice (start, duration, limit) selects no request")
        time_scale = time_scale_for_rate(sliced, rate_per_s)
    scaling = TraceScaling(
        time_scale=time_scale,
        token_scale=token_scale,
        max_prompt_tokens=max_prompt_tokens,
        max_output_tokens=max_output_tokens,
        start_s=start_s,
        duration_s=duration_s,
        limit=limit,
    )
    scaled = scale_trace(requests, scaling)
    if not scaled:
        raise ValueError("the trace slice (start, duration, limit) selects no request")
    return scaling, scaled
