"""Llama-architecture GGUF files (llama.cpp's format): the config from the metadata, and the weights
dequantized once, at load, to float32 in transformers' Llama naming.

The file is read with the ``gguf`` package (the ``model`` extra). Invariants of the conversion, as
llama.cpp's ``convert_hf_to_gguf.py`` writes it and transformers' GGUF loader undoes it:
- GGUF lists a tensor's dimensions innermost first, so a [out, in] matrix is stored as (in, out);
- the Q and K projections are stored with each head's rows interleaved for llama.cpp's rotary
  layout (pairs of adjacent dimensions) and are permuted back here to the half-split layout that
  ``model.rotate`` uses; V, O and the MLP are stored as they are;
- a file without ``output.weight`` ties the LM head to the token embeddings.
Only the default rotary embedding is supported: a file with rope scaling (metadata or a
``rope_freqs`` tensor) is refused rather than served with wrong positions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchpilot_runtime.model.config import LlamaConfig

if TYPE_CHECKING:
    from gguf import GGUFReader

# GGUF tensor name (per block: without the "blk.N." prefix) -> transformers' Llama name.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
# Tensor types this loader dequantizes (all that llama.cpp's common Llama files use for these sizes).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def open_reader(path: Path) -> GGUFReader:
    """The file's reader (memory-mapped); ValueError when it is not a readable GGUF file."""
    try:
        from gguf import GGUFReader
    except ImportError as error:
        raise ValueError(
            f"checkpoint {path}: reading GGUF files needs the 'gguf' package "
            "(pip install 'batchpilot[model]', included in the development install)"
        ) from error
    if not path.is_file():
        raise ValueError(f"checkpoint: {path} is not a file")
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as error:
        raise ValueError(f"checkpoint {path}: not a readable GGUF file: {error}") from error


def metadata_value(reader: GGUFReader, key: str) -> Any:
    """The value of metadata ``key`` (str, number, bool or list), or None when the file has none."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_config(reader: GGUFReader, path: Path) -> LlamaConfig:
    """The decoder's shape from the ``llama.*`` metadata; ValueError naming the key that is wrong."""
    architecture = metadata_value(reader, "general.architecture")
    if architecture != "llama":
        raise ValueError(f"checkpoint {path}: general.architecture is {architecture!r}; only 'llama' is supported")

    def number(key: str, default: float | None = None) -> float:
        value = metadata_value(reader, f"llama.{key}")
        if value is None:
            if default is None:
                raise ValueError(f"checkpoint {path}: metadata llama.{key} is missing")
            return default
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"checkpoint {path}: metadata llama.{key} must be a number, got {value!r}")
        return value

    rope_scaling = metadata_value(reader, "llama.rope.scaling.type")
    if rope_scaling not in (None, "none"):
        raise ValueError(
            f"checkpoint {path}: llama.rope.scaling.type {rope_scaling!r}; only the default rope is supported"
        )
    names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"checkpoint {path}: has rope_freqs.weight (scaled rope); only the default rope is supported")
    tokens = metadata_value(reader, "tokenizer.ggml.tokens")
    vocab_default = float(len(tokens)) if isinstance(tokens, list) else None
    num_heads = int(number("attention.head_count"))
    # attention.key_length is written when a head is not hidden_size / heads wide; 0 lets the config derive it
    head_dim = int(number("attention.key_length", 0))
    rotary_dims = number("rope.dimension_count", 0)
    if rotary_dims and rotary_dims != (head_dim or number("embedding_length") / max(num_heads, 1)):
        raise ValueError(
            f"checkpoint {path}: llama.rope.dimension_count {rotary_dims} is not the head size; partial rotary embeddings are not supported"
        )
    shape = {
        "vocab_size": int(number("vocab_size", vocab_default)),
        "hidden_size": int(number("embedding_length")),
        "intermediate_size": int(number("feed_forward_length")),
        "num_layers": int(number("block_count")),
        "num_heads": num_heads,
        "num_kv_heads": int(number("attention.head_count_kv", num_heads)),
        "max_position_embeddings": int(number("context_length")),
        "head_dim": head_dim,
    }
    rope_theta = float(number("rope.freq_base", 10000.0))
    rms_norm_eps = float(number("attention.layer_norm_rms_epsilon"))
    try:
        return LlamaConfig(
            **shape, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, tie_word_embeddings="output.weight" not in names
        )
    except ValueError as error:  # the config's own checks: heads that do not divide, and the like
        raise ValueError(f"checkpoint {path}: {error}") from None


def hf_name(gguf_name: str) -> str | None:
    """transformers' name for a GGUF tensor name, or None for a name this loader does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, rows (0, D/2, 1, D/2+1, ...) back to (0, 1, ..., D-1).

    weight [heads * D, in]; the inverse of convert_hf_to_gguf's ``permute`` (as transformers'
    ``_reverse_permute_weights``)."""
    rows, columns = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, columns).transpose(1, 2).reshape(rows, columns)


def load_tensors(reader: GGUFReader, path: Path, config: LlamaConfig, expected: Mapping[str, torch.Tensor]) -> None:
    """Dequantize every tensor of the file into the tensor of the same transformers name in
    ``expected``; raise naming an unknown tensor, an unsupported type, a wrong shape, or a
    tensor of ``expected`` the file lacks."""
    from gguf import dequantize

    seen: set[str] = set()
    with torch.no_grad():
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            if name is None or name not in expected:
                raise ValueError(f"checkpoint {path}: unexpected tensor {tensor.name!r}")
            type_name = tensor.tensor_type.name
            if type_name not in SUPPORTED_TYPES:
                raise ValueError(
                    f"checkpoint {path}: tensor {tensor.name!r} is {type_name}; supported types: {', '.join(SUPPORTED_TYPES)}"
                )
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
            target = expected[name]
            if shape != tuple(target.shape):
                raise ValueError(
                    f"checkpoint {path}: {tensor.name!r} has shape {shape}, the metadata implies {tuple(target.shape)}"
                )
            values = dequantize(tensor.data, tensor.tensor_type)
            if not values.flags.writeable:  # F32 tensors come back as views of the read-only mapping
                values = values.copy()
            weight = torch.from_numpy(values).reshape(shape)
            if tensor.name.endswith(".attn_q.weight"):
                weight = unpermute_rotary(weight, config.num_heads)
            elif tensor.name.endswith(".attn_k.weight"):
                weight = unpermute_rotary(weight, config.num_kv_heads)
            target.copy_(weight)
            seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"checkpoint {path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
