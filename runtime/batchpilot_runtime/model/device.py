"""Where the model runs: CUDA with bf16 when a GPU is present, otherwise CPU with fp32."""

from __future__ import annotations

import torch

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = tuple(_DTYPES)


def pick_device(device: str | None = None, dtype: str | None = None) -> tuple[torch.device, torch.dtype]:
    """Return (device, dtype): CUDA+bf16 when available, else CPU+fp32; explicit arguments override.

    CPU stays fp32 unless asked: bf16 matmuls run faster than fp32 on CPUs with AVX-512 bf16 or
    AMX (2x oneDNN's fp32 at 1039 x 512 x 2816 on an AMD EPYC, one core) and slower on those
    without, and bf16 rounding gives up the fp32 parity with transformers that the tests hold.
    """
    chosen = torch.device(device) if device is not None else None
    if chosen is None:
        chosen = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but no CUDA device is available")
    if dtype is None:
        return chosen, torch.bfloat16 if chosen.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(_DTYPES)}")
    return chosen, _DTYPES[dtype]
