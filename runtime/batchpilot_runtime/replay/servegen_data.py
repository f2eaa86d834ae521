"""Reading the Alibaba ServeGen language-model statistics into dataclasses.

A model's tarball (``servegen_data_language_<model>.tar.gz``, read in place with
:mod:`tarfile`) holds, per client, ``chunk-<client>-trace.csv`` (one row per 600 s window:
rate, cv and the fitted inter-arrival pattern) and ``chunk-<client>-dataset.json`` (per
6-hour window, the PMFs of prompt and output tokens). :func:`load_servegen` reads them into
:class:`ServeGenData`; a client without its own PMFs takes the rate-weighted mix of the
present clients' PMFs of the same 6-hour window. Sampling replays from the data is
:mod:`batchpilot_runtime.replay.servegen`'s job.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

# The shared data, where the project is checked out beside ../shared (as trace.SHARED_TRACE_PATH).
SHARED_SERVEGEN_PATH = Path(__file__).resolve().parents[3] / ".." / "shared" / "traces" / "servegen"
SERVEGEN_ENV = "BATCHPILOT_SERVEGEN"

WINDOW_S = 600.0  # one row of a chunk-*-trace.csv
LENGTH_WINDOW_S = 21600.0  # one key of a chunk-*-dataset.json (6 hours)
DAY_S = 86400.0
PATTERNS = ("Weibull", "Gamma", "")
# generate_replay refuses a replay expected to exceed this many requests unless told otherwise:
# the raw m-large day is about 17 M requests (196 req/s), which wants rate_scale or a target rate.
DEFAULT_MAX_REQUESTS = 5_000_000

_MEMBER = re.compile(r"(?:^|/)chunk-(\d+)-(trace\.csv|dataset\.json)$")

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def default_servegen_dir() -> Path:
    """$BATCHPILOT_SERVEGEN, else ``../shared/traces/servegen`` beside the project root."""
    chosen = os.environ.get(SERVEGEN_ENV)
    return Path(chosen) if chosen else SHARED_SERVEGEN_PATH


def tarball_path(model: str, root: Path | str | None = None) -> Path:
    return Path(root if root is not None else default_servegen_dir()) / f"servegen_data_language_{model}.tar.gz"


def available_models(root: Path | str | None = None) -> list[str]:
    folder = Path(root if root is not None else default_servegen_dir())
    prefix, suffix = "servegen_data_language_", ".tar.gz"
    return sorted(p.name[len(prefix) : -len(suffix)] for p in folder.glob(f"{prefix}*{suffix}"))


@dataclass(frozen=True, slots=True)
class ArrivalWindow:
    """One 600 s window of a client: its rate and fitted inter-arrival distribution."""

    start_s: float
    rate_per_s: float
    cv: float
    pattern: str  # "Weibull", "Gamma", or "" (no fit: idle, or Poisson when rate > 0)
    shape: float
    scale: float


@dataclass(frozen=True, eq=False)
class TokenPMF:
    """A probability mass function over token counts (``tokens`` ascending, ``probs`` sum to 1)."""

    tokens: IntArray
    probs: FloatArray
    cdf: FloatArray = field(repr=False)

    @classmethod
    def from_arrays(cls, tokens: npt.ArrayLike, probs: npt.ArrayLike) -> TokenPMF:
        t = np.asarray(tokens, dtype=np.int64)
        p = np.asarray(probs, dtype=np.float64)
        if t.shape != p.shape or t.ndim != 1 or t.size == 0:
            raise ValueError("a PMF needs as many probabilities as token counts, at least one")
        if np.any(p < 0) or not np.all(np.isfinite(p)) or p.sum() <= 0:
            raise ValueError("PMF probabilities must be finite, >= 0 and not all 0")
        order = np.argsort(t, kind="stable")
        t, p = t[order], p[order]
        if t.size > 1 and np.any(t[1:] == t[:-1]):
            unique, inverse = np.unique(t, return_inverse=True)
            t, p = unique.astype(np.int64), np.bincount(inverse, weights=p).astype(np.float64)
        p = p / p.sum()
        return cls(t, p, np.cumsum(p))

    @classmethod
    def parse(cls, text: str) -> TokenPMF | None:
        """``"{31: 0.004, 32: 0.055}"`` (ServeGen's format; JSON keys quoted or not); None when empty."""
        body = text.strip().removeprefix("{").removesuffix("}").replace('"', "").strip()
        if not body:
            return None
        numbers = np.array(body.replace(":", ",").split(","), dtype=np.float64)
        if numbers.size % 2:
            raise ValueError(f"malformed PMF {text[:60]!r}")
        return cls.from_arrays(np.rint(numbers[0::2]), numbers[1::2])

    def quantile(self, q: float) -> int:
        index = int(np.searchsorted(self.cdf, q * self.cdf[-1], side="left"))
        return int(self.tokens[min(index, self.tokens.size - 1)])

    def mean(self) -> float:
        return float(np.dot(self.tokens, self.probs))

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        index = np.searchsorted(self.cdf, rng.random(n) * self.cdf[-1], side="right")
        drawn: IntArray = self.tokens[np.minimum(index, self.tokens.size - 1)]
        return drawn


@dataclass(frozen=True)
class LengthWindow:
    """A client's token-length PMFs for one 6-hour window (None: no data for that window)."""

    start_s: float
    input_tokens: TokenPMF | None
    output_tokens: TokenPMF | None


@dataclass(frozen=True)
class ServeGenClient:
    """One client: its 600 s arrival windows and, unless its dataset file is absent, its
    6-hour length windows (index ``i`` starts at ``i * 21600`` s)."""

    client_id: int
    windows: tuple[ArrivalWindow, ...]
    lengths: tuple[LengthWindow, ...] | None

    def mean_rate(self, start_s: float, end_s: float) -> float:
        """Mean requests/s of this client over ``[start_s, end_s)``."""
        if end_s <= start_s:
            return 0.0
        total = 0.0
        first = max(0, int(start_s // WINDOW_S))
        last = min(len(self.windows), math.ceil(end_s / WINDOW_S))
        for w in self.windows[first:last]:
            overlap = min(end_s, w.start_s + WINDOW_S) - max(start_s, w.start_s)
            if overlap > 0:
                total += w.rate_per_s * overlap
        return total / (end_s - start_s)

    def length_window(self, start_s: float) -> LengthWindow | None:
        if self.lengths is None:
            return None
        index = int(start_s // LENGTH_WINDOW_S)
        return self.lengths[index] if 0 <= index < len(self.lengths) else None


@dataclass(eq=False)
class ServeGenData:
    """A model's clients as read from its tarball."""

    model: str
    source: Path
    clients: tuple[ServeGenClient, ...]
    days: int
    _mixes: dict[int, LengthWindow] = field(default_factory=dict, repr=False)

    @property
    def absent_clients(self) -> list[int]:
        """Clients whose dataset file (token lengths) is absent from the snapshot."""
        return [c.client_id for c in self.clients if c.lengths is None]

    def mix(self, start_s: float) -> LengthWindow:
        """The rate-weighted mix of the present clients' PMFs in the 6-hour window containing
        ``start_s`` (what a client without its own PMFs gets); PMFs None if no client has any."""
        index = int(start_s // LENGTH_WINDOW_S)
        cached = self._mixes.get(index)
        if cached is None:
            begin = index * LENGTH_WINDOW_S
            pmfs: dict[str, list[tuple[float, TokenPMF]]] = {"input": [], "output": []}
            for client in self.clients:
                lw = client.length_window(begin)
                if lw is None:
                    continue
                weight = client.mean_rate(begin, begin + LENGTH_WINDOW_S)
                if lw.input_tokens is not None:
                    pmfs["input"].append((weight, lw.input_tokens))
                if lw.output_tokens is not None:
                    pmfs["output"].append((weight, lw.output_tokens))
            cached = LengthWindow(begin, _mix_pmfs(pmfs["input"]), _mix_pmfs(pmfs["output"]))
            self._mixes[index] = cached
        return cached

    def pmfs_for(self, client: ServeGenClient, start_s: float) -> tuple[TokenPMF | None, TokenPMF | None]:
        """(input, output) PMFs for a request of ``client`` at ``start_s``: the client's own for
        that 6-hour window, else the mix of the present clients."""
        own = client.length_window(start_s)
        mix: LengthWindow | None = None
        if own is None or own.input_tokens is None or own.output_tokens is None:
            mix = self.mix(start_s)
        pin = own.input_tokens if own is not None and own.input_tokens is not None else None
        pout = own.output_tokens if own is not None and own.output_tokens is not None else None
        if mix is not None:
            pin = pin if pin is not None else mix.input_tokens
            pout = pout if pout is not None else mix.output_tokens
        return pin, pout


def _mix_pmfs(weighted: Sequence[tuple[float, TokenPMF]]) -> TokenPMF | None:
    if not weighted:
        return None
    weights = np.array([w for w, _ in weighted], dtype=np.float64)
    if not weights.sum() > 0:
        weights = np.ones_like(weights)  # nobody sent anything in that window: plain average
    tokens = np.concatenate([p.tokens for _, p in weighted])
    probs = np.concatenate([p.probs * w for w, (_, p) in zip(weights, weighted, strict=True)])
    if not probs.sum() > 0:
        return None
    return TokenPMF.from_arrays(tokens, probs)


def _read_windows(text: str, where: str) -> tuple[ArrivalWindow, ...]:
    rows: dict[int, ArrivalWindow] = {}
    for line_no, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not row or not "".join(row).strip():
            continue
        try:
            if len(row) < 6:
                raise ValueError(f"expected 6 columns (timestamp,rate,cv,pat_name,pat_arg1,pat_arg2), got {len(row)}")
            start, rate = float(row[0]), float(row[1])
            pattern = row[3].strip()
            if pattern not in PATTERNS:
                raise ValueError(f"unknown pattern {pattern!r}; expected Weibull, Gamma or empty")
            cv = float(row[2]) if row[2].strip() else math.nan
            shape = float(row[4]) if row[4].strip() else math.nan
            scale = float(row[5]) if row[5].strip() else math.nan
            if not (math.isfinite(rate) and rate >= 0):
                raise ValueError(f"rate must be >= 0, got {row[1]}")
            if pattern and rate > 0 and not (shape > 0):
                raise ValueError(f"{pattern} shape must be > 0, got {row[4]}")
            index = round(start / WINDOW_S)
            if index < 0 or abs(index * WINDOW_S - start) > 1e-6:
                raise ValueError(f"timestamp {row[0]} is not the start of a 600 s window")
        except ValueError as error:
            raise ValueError(f"{where}:{line_no}: {error}") from None
        rows[index] = ArrivalWindow(index * WINDOW_S, rate, cv, pattern, shape, scale)
    count = max(rows) + 1 if rows else 0
    return tuple(rows.get(i, ArrivalWindow(i * WINDOW_S, 0.0, math.nan, "", math.nan, math.nan)) for i in range(count))


def _read_lengths(raw: bytes, where: str, count: int) -> tuple[LengthWindow, ...]:
    try:
        document = json.loads(raw)
        if not isinstance(document, Mapping):
            raise ValueError("expected an object keyed by 6-hour window start")
        by_index: dict[int, LengthWindow] = {}
        for key, fields in document.items():
            start = float(key)
            index = round(start / LENGTH_WINDOW_S)
            if index < 0 or abs(index * LENGTH_WINDOW_S - start) > 1e-6:
                raise ValueError(f"key {key} is not the start of a 6-hour window")
            pin = TokenPMF.parse(str(fields.get("input_tokens", "{}")))
            pout = TokenPMF.parse(str(fields.get("output_tokens", "{}")))
            by_index[index] = LengthWindow(index * LENGTH_WINDOW_S, pin, pout)
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(f"{where}: {error}") from None
    count = max(count, max(by_index) + 1 if by_index else 0)
    return tuple(by_index.get(i, LengthWindow(i * LENGTH_WINDOW_S, None, None)) for i in range(count))


def load_servegen(model: str = "m-large", root: Path | str | None = None) -> ServeGenData:
    """Read ``servegen_data_language_<model>.tar.gz`` from ``root`` (default
    :func:`default_servegen_dir`) without extracting it."""
    folder = Path(root if root is not None else default_servegen_dir())
    path = tarball_path(model, folder)
    if not path.exists():
        if not folder.is_dir():
            raise ValueError(f"no ServeGen data folder {folder} (set ${SERVEGEN_ENV} or pass the folder)")
        known = ", ".join(available_models(folder)) or "none"
        raise ValueError(f"unknown ServeGen model {model!r}: no {path.name} in {folder} (available: {known})")
    traces: dict[int, str] = {}
    datasets: dict[int, bytes] = {}
    prefix = f"data/language/{model}/"
    with tarfile.open(path, "r:*") as archive:
        for member in archive:
            if not member.isfile():
                continue
            name = member.name.removeprefix("./")
            match = _MEMBER.search(name)
            if match is None or not name.startswith(prefix):
                continue
            handle = archive.extractfile(member)
            if handle is None:
                continue
            data = handle.read()
            if match.group(2) == "trace.csv":
                traces[int(match.group(1))] = data.decode()
            else:
                datasets[int(match.group(1))] = data
    if not traces:
        raise ValueError(f"{path}: no {prefix}chunk-*-trace.csv member")
    clients = []
    n_lengths = 0
    windows_by_client = {
        cid: _read_windows(traces[cid], f"{path.name}:{prefix}chunk-{cid}-trace.csv") for cid in traces
    }
    n_windows = max(len(w) for w in windows_by_client.values())
    n_lengths = math.ceil(n_windows * WINDOW_S / LENGTH_WINDOW_S)
    for cid in sorted(traces):
        windows = windows_by_client[cid]
        if len(windows) < n_windows:
            pad = (
                ArrivalWindow(i * WINDOW_S, 0.0, math.nan, "", math.nan, math.nan)
                for i in range(len(windows), n_windows)
            )
            windows = (*windows, *pad)
        lengths = None
        if cid in datasets:
            lengths = _read_lengths(datasets[cid], f"{path.name}:{prefix}chunk-{cid}-dataset.json", n_lengths)
        clients.append(ServeGenClient(cid, windows, lengths))
    days = int(n_windows * WINDOW_S // DAY_S)
    if days < 1:
        raise ValueError(f"{path}: the traces cover {n_windows * WINDOW_S:g} s, less than a day")
    return ServeGenData(model=model, source=path, clients=tuple(clients), days=days)
