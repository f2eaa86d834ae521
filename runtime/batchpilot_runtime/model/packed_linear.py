"""The fast kernels' linear layers on the CPU: oneDNN GEMMs over weights packed once.

torch's ``F.linear`` runs fp32 CPU GEMMs in MKL, and MKL takes its AVX2 code path on CPUs that are
not Intel's: on the AMD EPYC hosts this project is measured on (AVX-512), a prefill's GEMMs run at
about 90 GFLOP/s per core there and at about 210 in oneDNN, which picks its kernels by instruction
set, over weights reordered once into its blocked layout (the same IEEE fp32 arithmetic, summed in
another order: equal up to rounding). Decode-sized GEMMs (tens of rows) gain as much, and bfloat16
ones a little. Batch-invariant mode keeps MKL (model.py): its invariance rests on how MKL sums.

``BATCHPILOT_CPU_GEMM=blas`` keeps ``F.linear`` (for comparing, or a torch build whose oneDNN
misbehaves); the default, ``onednn``, falls back to ``F.linear`` by itself where torch was built
without oneDNN, on other devices, and for other dtypes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F

CPU_GEMM_ENV = "BATCHPILOT_CPU_GEMM"
CPU_GEMM_CHOICES = ("onednn", "blas")
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def resolve_cpu_gemm(environ: Mapping[str, str] | None = None) -> str:
    """``onednn`` (the default) or ``blas``, from BATCHPILOT_CPU_GEMM; anything else is a ValueError naming it."""
    raw = (os.environ if environ is None else environ).get(CPU_GEMM_ENV, "")
    choice = raw.strip().lower() or "onednn"
    if choice not in CPU_GEMM_CHOICES:
        raise ValueError(f"{CPU_GEMM_ENV}: must be one of {list(CPU_GEMM_CHOICES)}, got {raw!r}")
    return choice


def onednn_linear_available() -> bool:
    """Whether this torch build has the oneDNN linear ops (torch's own inductor uses them on the CPU)."""
    ops = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear:
    """``F.linear(x, weight)`` (no bias) through oneDNN for CPU weights in fp32 or bf16.

    Each weight is packed on first use and packed again when it has changed since (written in
    place, or moved by ``Module.to``): the packed copy is keyed by the weight itself and checked
    against its version counter and storage. The copies double the weights' memory on the CPU.
    """

    def __init__(self) -> None:
        self._packed: dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] = {}

    @staticmethod
    def handles(weight: torch.Tensor) -> bool:
        """Whether products with ``weight`` go through oneDNN (else F.linear)."""
        return weight.device.type == "cpu" and weight.dtype in _PACKED_DTYPES

    def prepare(self, weights: Iterable[torch.Tensor]) -> None:
        """Pack ``weights`` now (at load time) rather than in the first step that uses them."""
        for weight in weights:
            if self.handles(weight):
                self.packed(weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.handles(weight) or x.dtype != weight.dtype:
            return F.linear(x, weight)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed(weight), None, "none", [], "")
        return out

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(id(weight))
        # the entry holds the weight itself, so its id is not reused while the entry exists
        if entry is None or entry[1] != weight._version or entry[2] != weight.data_ptr():
            with torch.inference_mode(False), torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            entry = (weight, weight._version, weight.data_ptr(), packed)
            self._packed[id(weight)] = entry
        return entry[3]
