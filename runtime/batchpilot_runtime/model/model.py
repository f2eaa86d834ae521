"""A Llama-architecture decoder in plain torch: RMSNorm, rotary position embeddings, SwiGLU and
grouped-query attention, with the Hugging Face Llama weight naming for loading and saving.

``forward(batch, kv)`` runs one engine step over the paged KV cache: any mix of prefill chunks and
decode tokens, flattened into T rows (batch.py). ``forward_dense`` is the cache-free reference for
one sequence. Both run the same DecoderLayer.forward; only the attention passed in differs.

Batch invariance (``batch_invariant``, an opt-in: kernels.py). With it a request gets exactly the
tokens it would get alone, so no row's arithmetic may depend on the rest of the step. MKL sums a GEMM row
differently for 1, 2-15 and >= 16 rows (and, when threaded, for other row counts too), so linear
layers pad their rows to whole tiles of DEFAULT_ROW_TILE and run one GEMM per tile (one GEMM for all
when single-threaded, where every row count >= 16 sums the same way), and attention is padded as
attention.py describes. The result is bitwise equal logits for a sequence alone, in any batch, and
with its prompt prefilled in any chunks (tests/unit/test_model.py). With the flag off, the fastest
kernels are used (equal up to rounding): the default on every device. On the CPU its linear layers
run in oneDNN over packed weights (packed_linear.py), elsewhere in plain BLAS; attention in SDPA.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from batchpilot_runtime.model import checkpoint, gguf_checkpoint
from batchpilot_runtime.model.attention import Attention, PagedAttention, dense_causal_attention, min_query_len
from batchpilot_runtime.model.batch import ForwardBatch
from batchpilot_runtime.model.config import INIT_STD, LlamaConfig
from batchpilot_runtime.model.kernels import resolve_batch_invariant
from batchpilot_runtime.model.kv_cache import PagedKVCache
from batchpilot_runtime.model.packed_linear import PackedLinear, onednn_linear_available, resolve_cpu_gemm

if TYPE_CHECKING:
    from gguf import GGUFReader

# Rows per BLAS call in batch-invariant mode: one fixed GEMM shape for every step.
DEFAULT_ROW_TILE = 16

# x [T, in], weight [out, in] -> [T, out]
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32 whatever the weights' dtype, as transformers does
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, the half-split layout of transformers' Llama. x: [T, heads, D]; cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    """Attention and SwiGLU MLP; q/k/v and gate/up are stored fused (one GEMM each)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.intermediate_size = config.intermediate_size
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_weight = nn.Parameter(torch.empty(q_size + 2 * kv_size, config.hidden_size), requires_grad=False)
        self.o_weight = nn.Parameter(torch.empty(config.hidden_size, q_size), requires_grad=False)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_weight = nn.Parameter(
            torch.empty(2 * config.intermediate_size, config.hidden_size), requires_grad=False
        )
        self.down_weight = nn.Parameter(torch.empty(config.hidden_size, config.intermediate_size), requires_grad=False)

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        return (self.qkv_weight, self.o_weight, self.gate_up_weight, self.down_weight)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
        linear: Linear = F.linear,
    ) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; cos/sin [T, 1, D] for the rows' positions.

        ``attention`` gets the rotated q [T, H, D] and k, v [T, kvH, D] (the paged one also stores
        k and v in the cache); ``linear`` is every matrix product with a weight.
        """
        num_tokens = hidden.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = linear(self.input_norm(hidden), self.qkv_weight)
        q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
        q = rotate(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = rotate(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        hidden = hidden + linear(attention(q, k, v), self.o_weight)
        gate_up = linear(self.post_norm(hidden), self.gate_up_weight)
        gate, up = torch.split(gate_up, self.intermediate_size, dim=-1)
        # in place: the product reuses silu's fresh output instead of allocating a third T x I tensor
        return hidden + linear(F.silu(gate).mul_(up), self.down_weight)


class LlamaModel(nn.Module):
    """The decoder. ``forward(batch, kv)`` writes the step's K/V into the cache and returns
    fp32 logits for the rows in ``batch.logits_indices``.

    ``batch_invariant`` makes each request's arithmetic independent of the rest of the batch
    (None: kernels.resolve_batch_invariant, off unless BATCHPILOT_BATCH_INVARIANT is set);
    ``row_tile`` is the fixed row count per BLAS call in that mode.
    """

    def __init__(
        self, config: LlamaConfig, batch_invariant: bool | None = None, row_tile: int = DEFAULT_ROW_TILE
    ) -> None:
        super().__init__()
        if row_tile < 1:
            raise ValueError(f"row_tile: must be >= 1, got {row_tile}")
        self.config = config
        self.batch_invariant = resolve_batch_invariant(batch_invariant)
        self.row_tile = row_tile
        # the fast kernels' linear layers (no module state: not in state_dict, not moved by .to)
        self.fast_linear: Linear = (
            PackedLinear() if resolve_cpu_gemm() == "onednn" and onednn_linear_available() else F.linear
        )
        self.attention_scale = config.head_dim**-0.5
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Parameter | None = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        )
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim)
        )
        angles = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    # --- construction -------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @classmethod
    def random(
        cls,
        config: LlamaConfig,
        seed: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool | None = None,
    ) -> LlamaModel:
        """Weights drawn N(0, 0.02) on the CPU from ``seed`` (same weights on any device), norms at 1."""
        resolved = torch.device(device)
        model = cls(config, batch_invariant)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        with torch.no_grad():
            for name, tensor in hf_state_dict(model).items():
                if not name.endswith("norm.weight"):
                    tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * INIT_STD)
        return model.to(device=resolved, dtype=dtype).eval().prepared()

    @classmethod
    def from_safetensors(
        cls,
        directory: Path | str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool | None = None,
    ) -> LlamaModel:
        """Load config.json plus model.safetensors (or a sharded model.safetensors.index.json)."""
        root = Path(directory)
        config = checkpoint.read_config(root)
        shards = checkpoint.shard_paths(root)
        resolved = torch.device(device)
        model = cls(config, batch_invariant)
        checkpoint.load_tensors(shards, hf_state_dict(model), config.tie_word_embeddings)
        return model.to(device=resolved, dtype=dtype).eval().prepared()

    @classmethod
    def from_gguf(
        cls,
        path: Path | str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool | None = None,
        reader: GGUFReader | None = None,
    ) -> LlamaModel:
        """Load a Llama-architecture GGUF file, every tensor dequantized once to float32 (then ``dtype``).

        ``reader``: the file's open reader, when the caller also builds the tokenizer from it."""
        file = Path(path)
        reader = reader if reader is not None else gguf_checkpoint.open_reader(file)
        config = gguf_checkpoint.read_config(reader, file)
        resolved = torch.device(device)
        model = cls(config, batch_invariant)
        gguf_checkpoint.load_tensors(reader, file, config, hf_state_dict(model))
        return model.to(device=resolved, dtype=dtype).eval().prepared()

    def prepared(self) -> LlamaModel:
        """This model with its fast kernels' packed weights made now: each constructor ends here, so
        that packing (0.3 s for SmolLM2) is load time, not the first request's. Batch-invariant
        models pack nothing (they run MKL); a weight changed later is packed again on use."""
        if not self.batch_invariant and isinstance(self.fast_linear, PackedLinear):
            weights = [w for layer in self.layers if isinstance(layer, DecoderLayer) for w in layer.linear_weights()]
            self.fast_linear.prepare([*weights, self.embed if self.lm_head is None else self.lm_head])
        return self

    def save_safetensors(self, directory: Path | str) -> None:
        """Write config.json and model.safetensors in transformers' Llama layout."""
        hf_config = self.config.to_hf_dict()
        hf_config["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        checkpoint.save(Path(directory), hf_config, hf_state_dict(self))

    # --- compute ------------------------------------------------------------------------------

    @property
    def min_query_len(self) -> int:
        """Query rows per sequence below which attention GEMMs would change kernel class (attention.py)."""
        return min_query_len(self.config.num_heads, self.config.num_kv_heads)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return self.fast_linear(x, weight)
        if x.shape[0] == 0:
            return F.linear(x, weight)
        tile = self.row_tile
        rows = x.shape[0]
        padded_rows = -(-rows // tile) * tile
        if padded_rows != rows:
            x = torch.cat((x, x.new_zeros(padded_rows - rows, x.shape[1])))
        if padded_rows == tile or (x.device.type == "cpu" and torch.get_num_threads() == 1):
            # single-threaded MKL sums every row the same way from `tile` rows up; threaded MKL does not
            return F.linear(x, weight)[:rows]
        return torch.cat([F.linear(chunk, weight) for chunk in torch.split(x, tile)])[:rows]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for ``positions`` [T]."""
        return self.rope_cos[positions].to(dtype).unsqueeze(1), self.rope_sin[positions].to(dtype).unsqueeze(1)

    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Run one step; returns logits [S, vocab] in fp32 for ``batch.logits_indices``."""
        attention = PagedAttention(batch, kv, self.attention_scale, self.batch_invariant, self.min_query_len)
        input_ids, positions = batch.input_ids, batch.positions
        if self.batch_invariant:
            # pad the step to whole row tiles once, instead of in every linear layer; padding rows
            # never reach the cache or the logits, and no real row's arithmetic depends on them
            padding = -batch.num_tokens % self.row_tile
            input_ids, positions = F.pad(input_ids, (0, padding)), F.pad(positions, (0, padding))
        hidden = self.embed[input_ids]
        cos, sin = self._rope(positions, hidden.dtype)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, attention.layer(index), self._linear)
        # only the sampling rows go through the final norm and the LM head
        last = self.norm(hidden[batch.logits_indices])
        head = self.embed if self.lm_head is None else self.lm_head
        return self._linear(last, head).float()

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference without a cache: logits [L, vocab] fp32 for every position of one sequence."""
        positions = torch.arange(int(input_ids.shape[0]), device=input_ids.device)
        hidden = self.embed[input_ids]
        cos, sin = self._rope(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, dense_causal_attention, F.linear)
        head = self.embed if self.lm_head is None else self.lm_head
        return F.linear(self.norm(hidden), head).float()


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The model's tensors under transformers' Llama names (views into the fused weights)."""
    config = model.config
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed.data}
    for index, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        prefix = f"model.layers.{index}."
        q, k, v = torch.split(layer.qkv_weight.data, [q_size, kv_size, kv_size])
        gate, up = torch.split(layer.gate_up_weight.data, config.intermediate_size)
        tensors.update(
            {
                prefix + "input_layernorm.weight": layer.input_norm.weight.data,
                prefix + "self_attn.q_proj.weight": q,
                prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v,
                prefix + "self_attn.o_proj.weight": layer.o_weight.data,
                prefix + "post_attention_layernorm.weight": layer.post_norm.weight.data,
                prefix + "mlp.gate_proj.weight": gate,
                prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": layer.down_weight.data,
            }
        )
    tensors["model.norm.weight"] = model.norm.weight.data
    if model.lm_head is not None:
        tensors["lm_head.weight"] = model.lm_head.data
    return tensors
