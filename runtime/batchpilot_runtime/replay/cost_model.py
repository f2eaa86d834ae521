"""Step-time model of the engine: what one scheduler step costs, from its composition.

``step_s = fixed_s + per_prefill_token_s * prefill_tokens + per_decode_seq_s * decode_seqs
+ per_kv_token_s * kv_tokens``, where ``kv_tokens`` is the KV-cache context every sequence
of the step attends to (its tokens in cache after the step, summed over the batch).

The four terms are the ones that matter for batching: the fixed cost of reading the
weights once per step (what batching amortises), the compute-bound cost of prompt tokens,
the small marginal cost of one more decoding sequence, and the memory-bound cost of
reading the KV cache (what makes huge batches of long sequences slow down).

Pure Python (numpy only for fitting): the simulator, the calibration command and the
benchmarks share it. Coefficients come either from a named profile below or from a fit
to measured ``(composition, seconds)`` samples (:func:`fit_cost_model`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol


class CostModelError(ValueError):
    """A cost model that cannot be loaded; the message names the field or the file."""


class _SeqLike(Protocol):
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def start_pos(self) -> int: ...
    @property
    def is_prefill(self) -> bool: ...


@dataclass(frozen=True)
class StepComposition:
    """What one step computes, in the units the cost model charges for."""

    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int

    @classmethod
    def from_seqs(cls, seqs: Iterable[_SeqLike]) -> StepComposition:
        """Composition of a scheduler plan's sequences (``ScheduledSeq``-like objects)."""
        prefill_tokens = decode_seqs = kv_tokens = 0
        for seq in seqs:
            fed = len(seq.token_ids)
            if seq.is_prefill:
                prefill_tokens += fed
            else:
                decode_seqs += 1
            kv_tokens += seq.start_pos + fed
        return cls(prefill_tokens, decode_seqs, kv_tokens)

    def features(self) -> tuple[float, float, float, float]:
        """The regressors of the linear model, intercept first."""
        return (1.0, float(self.prefill_tokens), float(self.decode_seqs), float(self.kv_tokens))


_COEFFICIENTS = ("fixed_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s")


@dataclass(frozen=True)
class CostModel:
    """Linear step-time model; every coefficient is in seconds and >= 0.

    ``kv_capacity_tokens`` is the KV-cache size the profile's device holds (the simulator
    sizes its block pool from it unless told otherwise); ``source`` says where the numbers
    come from.
    """

    name: str
    fixed_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_s: float
    kv_capacity_tokens: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for field in _COEFFICIENTS:
            value = getattr(self, field)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise CostModelError(f"{field} must be a finite number >= 0, got {value!r}")
        if self.fixed_s + self.per_prefill_token_s + self.per_decode_seq_s <= 0:
            raise CostModelError("fixed_s, per_prefill_token_s and per_decode_seq_s cannot all be 0")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise CostModelError(f"kv_capacity_tokens must be >= 1, got {self.kv_capacity_tokens}")

    def step_seconds(self, composition: StepComposition) -> float:
        return (
            self.fixed_s
            + self.per_prefill_token_s * composition.prefill_tokens
            + self.per_decode_seq_s * composition.decode_seqs
            + self.per_kv_token_s * composition.kv_tokens
        )

    def decode_tokens_per_s(self, batch_size: int, context_tokens: int) -> float:
        """Decode throughput of a batch of ``batch_size`` sequences of ``context_tokens`` each."""
        step_s = self.step_seconds(StepComposition(0, batch_size, batch_size * context_tokens))
        return batch_size / step_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], default_name: str = "custom") -> CostModel:
        unknown = sorted(set(data) - {*_COEFFICIENTS, "name", "kv_capacity_tokens", "source"})
        if unknown:
            raise CostModelError(f"unknown cost model field(s): {', '.join(unknown)}")
        missing = [f for f in _COEFFICIENTS if f not in data]
        if missing:
            raise CostModelError(f"cost model is missing field(s): {', '.join(missing)}")
        values: dict[str, float] = {}
        for field in _COEFFICIENTS:
            raw = data[field]
            if isinstance(raw, bool) or not isinstance(raw, int | float):
                raise CostModelError(f"{field} must be a number, got {raw!r}")
            values[field] = float(raw)
        capacity = data.get("kv_capacity_tokens")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)):
            raise CostModelError(f"kv_capacity_tokens must be an integer, got {capacity!r}")
        return cls(
            name=str(data.get("name", default_name)),
            kv_capacity_tokens=capacity,
            source=str(data.get("source", "")),
            **values,
        )


# Llama-2-7B (32 layers, hidden 4096, 32 KV heads) on one A100-80GB, bf16.
# Source: Microsoft Vidur (Agrawal et al., "Vidur: A Large-Scale Simulation Framework for LLM
# Inference", MLSys 2024), measured operator times in
# github.com/microsoft/vidur data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv
# (tensor parallel 1, mean column, ms per layer):
#   sum of the per-layer linear/norm/activation ops = 0.291 ms at 1 token, 0.383 ms at 128
#   tokens, 7.96 ms at 4096 tokens; times 32 layers = 9.3 ms, 12.3 ms, 254.9 ms.
# fixed_s = 9.3 ms (weights read once per step) + 2 ms for sampling and the host loop
#   (the latter our assumption, in line with Vidur's cpu_overheads profile of a few ms);
# per_decode_seq_s = (12.3 - 9.3) ms / 127 = 24 us (decode stays memory-bound up to ~128);
# per_prefill_token_s = (254.9 - 12.3) ms / 3968 = 61 us (compute-bound prompt tokens);
# per_kv_token_s: attention reads 2 (K,V) x 32 layers x 4096 x 2 bytes = 512 KiB per cached
#   token; at the A100-80GB's 2,039 GB/s (NVIDIA datasheet) and 75 % of it achieved, 0.34 us.
# kv_capacity_tokens: 0.9 x 80 GB - 13.5 GB weights - 2 GB activations = 56.5 GB / 512 KiB,
#   rounded down to a multiple of 16: 107,744 tokens (vLLM's default gpu_memory_utilization).
A100_LLAMA2_7B = CostModel(
    name="a100-llama2-7b",
    fixed_s=0.0113,
    per_prefill_token_s=61e-6,
    per_decode_seq_s=24e-6,
    per_kv_token_s=0.34e-6,
    kv_capacity_tokens=107_744,
    source="Vidur (MLSys 2024) A100 Llama-2-7B operator profile + NVIDIA A100 datasheet bandwidth",
)

# Round numbers for hand-checked tests and examples: 10 ms per step, 1 ms per prompt token,
# 1 ms per decoding sequence, nothing per KV token.
UNIT = CostModel(
    name="unit",
    fixed_s=0.010,
    per_prefill_token_s=0.001,
    per_decode_seq_s=0.001,
    per_kv_token_s=0.0,
    kv_capacity_tokens=65_536,
    source="synthetic round numbers for tests",
)

PROFILES: dict[str, CostModel] = {model.name: model for model in (A100_LLAMA2_7B, UNIT)}


def load_cost_model(name_or_path: str | Path) -> CostModel:
    """A named profile (see :data:`PROFILES`) or a JSON file written by ``calibrate``."""
    text = str(name_or_path)
    if text in PROFILES:
        return PROFILES[text]
    path = Path(text)
    if not path.exists():
        raise CostModelError(
            f"cost profile {text!r} is neither a known profile ({', '.join(sorted(PROFILES))}) nor a JSON file"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CostModelError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise CostModelError(f"{path}: a cost model must be a JSON object")
    # calibrate writes {"model": {...}, "fit": {...}}; accept the bare model too.
    model_data = data.get("model", data)
    if not isinstance(model_data, dict):
        raise CostModelError(f"{path}: 'model' must be a JSON object")
    try:
        return CostModel.from_mapping(model_data, default_name=path.stem)
    except CostModelError as error:
        raise CostModelError(f"{path}: {error}") from None


@dataclass(frozen=True)
class FitResult:
    """A fitted model and how well it explains the samples it came from."""

    model: CostModel
    samples: int
    r_squared: float
    mean_abs_rel_error: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.as_dict(),
            "fit": {
                "samples": self.samples,
                "r_squared": self.r_squared,
                "mean_abs_rel_error": self.mean_abs_rel_error,
            },
        }


def fit_cost_model(
    samples: Sequence[tuple[StepComposition, float]],
    name: str = "fitted",
    source: str = "least-squares fit",
    kv_capacity_tokens: int | None = None,
) -> FitResult:
    """Least-squares fit of the four coefficients, constrained to be >= 0.

    Non-negativity by an active set: a coefficient whose unconstrained estimate is negative
    is pinned at 0 and the rest refitted (a negative per-token cost would make the
    simulator reward bigger steps with shorter times). Samples are weighted by 1/seconds
    so that short decode steps count as much as long prefill steps (relative error).
    """
    import numpy as np

    if len(samples) < 4:
        raise CostModelError(f"need at least 4 samples to fit 4 coefficients, got {len(samples)}")
    for index, (_, seconds) in enumerate(samples):
        if not (math.isfinite(seconds) and seconds > 0):
            raise CostModelError(f"samples[{index}]: seconds must be finite and > 0, got {seconds}")
    features = np.array([comp.features() for comp, _ in samples], dtype=np.float64)
    seconds_arr = np.array([s for _, s in samples], dtype=np.float64)
    weights = 1.0 / seconds_arr
    active = [True, True, True, True]
    coefficients = np.zeros(4)
    for _ in range(4):
        columns = [i for i in range(4) if active[i]]
        design = features[:, columns] * weights[:, None]
        solution, *_ = np.linalg.lstsq(design, seconds_arr * weights, rcond=None)
        coefficients = np.zeros(4)
        coefficients[columns] = solution
        negative = [columns[j] for j, value in enumerate(solution) if value < 0]
        if not negative:
            break
        for i in negative:
            active[i] = False
    predicted = features @ coefficients
    residual = float(np.sum((seconds_arr - predicted) ** 2))
    total = float(np.sum((seconds_arr - seconds_arr.mean()) ** 2))
    r_squared = 1.0 - residual / total if total > 0 else 1.0
    rel_error = float(np.mean(np.abs(predicted - seconds_arr) / seconds_arr))
    if coefficients[0] + coefficients[1] + coefficients[2] <= 0:
        raise CostModelError("the samples do not determine a step cost (all fitted coefficients are 0)")
    model = CostModel(
        name=name,
        fixed_s=float(coefficients[0]),
        per_prefill_token_s=float(coefficients[1]),
        per_decode_seq_s=float(coefficients[2]),
        per_kv_token_s=float(coefficients[3]),
        kv_capacity_tokens=kv_capacity_tokens,
        source=source,
    )
    return FitResult(model=model, samples=len(samples), r_squared=r_squared, mean_abs_rel_error=rel_error)
