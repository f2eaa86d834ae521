"""The paged KV cache: one K and one V tensor per layer, allocated once up front.

Storage is slot-addressed: slot = block * block_size + offset. Which blocks belong
to which sequence is decided by the scheduler's block manager (kv_blocks.py, no torch);
this module only owns the memory. Blocks are zero-filled at allocation so that a
padded gather (block 0 standing in for absent blocks) always reads finite values,
which the attention then masks out.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class KVShape(Protocol):
    """What the cache needs to know of a model: three integers (LlamaConfig fits)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def bytes_per_token(shape: KVShape, dtype: torch.dtype) -> int:
    """Bytes of K plus V that one token occupies over all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * element_size


class PagedKVCache:
    """K/V storage for ``num_blocks`` blocks of ``block_size`` tokens.

    ``k[layer]`` and ``v[layer]`` have shape [num_kv_heads, num_blocks * block_size, head_dim]: heads
    outermost, so that a gather of many sequences' slots is already laid out per head for batched GEMMs.
    """

    def __init__(
        self,
        shape: KVShape,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.num_layers = shape.num_layers
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        size = (self.num_layers, self.num_kv_heads, num_blocks * block_size, self.head_dim)
        self.k = torch.zeros(size, device=self.device, dtype=dtype)
        self.v = torch.zeros(size, device=self.device, dtype=dtype)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def blocks_for_token_budget(tokens: int, block_size: int) -> int:
        """Blocks that hold at least ``tokens`` tokens."""
        if tokens < 1:
            raise ValueError(f"kv_cache_tokens: must be >= 1, got {tokens}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        return math.ceil(tokens / block_size)

    @staticmethod
    def blocks_for_memory_fraction(
        shape: KVShape,
        block_size: int,
        fraction: float,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> int:
        """Blocks that fit in ``fraction`` of the GPU memory that is free now (CUDA only).

        Call after the weights are loaded: what they hold is already gone from the free memory.
        """
        resolved = torch.device(device)
        if resolved.type != "cuda":
            raise ValueError(f"device: a memory fraction needs a CUDA device, got {resolved.type!r}")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction: must be in (0, 1], got {fraction}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        free_bytes, _total_bytes = torch.cuda.mem_get_info(resolved)
        blocks = int(free_bytes * fraction) // (bytes_per_token(shape, dtype) * block_size)
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory_fraction: {fraction} of {free_bytes} free bytes holds no block of {block_size} tokens"
            )
        return blocks
