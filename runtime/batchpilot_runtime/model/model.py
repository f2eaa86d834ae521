"""A Llama-architecture decoder in plain torch, run over a paged KV cache.

RMSNorm, rotary position embeddings, SwiGLU and grouped-query attention, with the
Hugging Face Llama weight naming for loading and saving. One forward call runs one
engine step: any mix of prefill chunks and decode tokens, flattened into T rows.

Batch invariance (``batch_invariant``, on by default on CPU). A request must get
exactly the tokens it would get alone, so no row's arithmetic may depend on the rest
of the step. MKL sums a GEMM row differently for 1, 2-15 and >= 16 rows (and, when
threaded, for other row counts too), so:
- linear layers pad their rows to whole tiles of DEFAULT_ROW_TILE and run one GEMM
  per tile (one GEMM for all when single-threaded, where every row count >= 16 sums
  the same way);
- attention runs per group of sequences padded to a common chunk length, with at
  least MIN_GEMM_ROWS query rows per GEMM; keys are padded to whole KEY_CHUNKs and
  the value sum is done per chunk, then over chunks in order, so masked padding adds
  exact zeros instead of changing the summation order.
The result is bitwise equal logits for a sequence alone, in any batch, and with its
prompt prefilled in any chunks (tests/unit/test_model.py). With the flag off, plain
BLAS and SDPA are used (faster, equal up to rounding): the default on CUDA.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from batchpilot_runtime.model.kv_cache import PagedKVCache

INIT_STD = 0.02
# Rows per BLAS call in batch-invariant mode: one fixed GEMM shape for every step.
DEFAULT_ROW_TILE = 16
# Keys are padded, and values summed, in chunks of this many positions: a fixed GEMM depth, so that
# padding a context with masked keys adds exact zeros instead of changing the summation order.
KEY_CHUNK = 32
# Query rows per sequence that ForwardBatch.build pads attention groups to; the model pads further
# when that leaves an attention GEMM under MIN_GEMM_ROWS rows (query rows x GQA group size).
DEFAULT_MIN_QUERY_LEN = 2
MIN_GEMM_ROWS = 4


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama decoder. ``head_dim`` 0 means hidden_size // num_heads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads} (grouped-query attention)"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim: must be an even integer >= 2 for rotary embeddings, got {self.head_dim}")
        if self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings: must be >= 1, got {self.max_position_embeddings}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps}")

    @property
    def num_parameters(self) -> int:
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attention + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in the shape transformers' LlamaConfig reads (old and new rope keys both written)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": INIT_STD,
            "bos_token_id": 256,
            "eos_token_id": 257,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> LlamaConfig:
        model_type = raw.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"config.json model_type: only 'llama' is supported, got {model_type!r}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act: only 'silu' is supported, got {raw.get('hidden_act')!r}")
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag, False):
                raise ValueError(f"config.json {flag}: biases are not supported")
        rope_parameters = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or {}
        for source, rope in (("rope_parameters", rope_parameters), ("rope_scaling", rope_scaling)):
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"config.json {source}: only the default rope is supported, got {rope_type!r}")
        rope_theta = raw.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        try:
            num_heads = int(raw["num_attention_heads"])
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                rope_theta=float(rope_theta),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                head_dim=int(raw.get("head_dim") or 0),
            )
        except KeyError as error:
            raise ValueError(f"config.json: missing field {error.args[0]!r}") from error


PRESETS: dict[str, LlamaConfig] = {
    # ~0.23 M parameters: fast enough for token-exactness tests with dozens of requests.
    "tiny": LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=176, num_layers=4, num_heads=4, num_kv_heads=2
    ),
    # ~24 M parameters: the CPU benchmark model.
    "small": LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=4
    ),
    # ~76 M parameters: for GPU checks, where small is too light to load the device.
    "medium": LlamaConfig(
        vocab_size=512, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=4
    ),
}


def config_from_name(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"preset: {name!r} is not one of {sorted(PRESETS)}")
    return PRESETS[name]


class SeqLike(Protocol):
    """What ForwardBatch.build needs of a scheduled sequence (scheduler.ScheduledSeq fits)."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def start_pos(self) -> int: ...
    @property
    def block_table(self) -> Sequence[int]: ...
    @property
    def sample(self) -> bool: ...


@dataclass
class AttentionGroup:
    """Sequences whose attention runs as one padded computation (built once per step, used by every layer).

    Decode sequences share one group; prefill chunks are grouped by padded chunk length, so a
    long prompt never pads the decode rows of the same step to its length.
    """

    query_rows: torch.Tensor  # [G, Lq] long: row in T of each query, T (a zero row) for padding
    key_slots: torch.Tensor  # [G, Lk] long: cache slot of each key position (Lk a multiple of KEY_CHUNK)
    mask: torch.Tensor  # [G, 1, Lq, Lk] bool: key visible to query (causal, within the context)
    output_rows: torch.Tensor  # [n] long: flat index into G * Lq of each real query row
    token_rows: torch.Tensor  # [n] long: row in T that output_rows[i] fills

    @property
    def query_len(self) -> int:
        return int(self.query_rows.shape[1])


@dataclass
class ForwardBatch:
    """One step's input, flattened: T token rows from B sequences, S of which sample."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: block * block_size + offset where each row's K/V goes
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    context_lens: torch.Tensor  # [B] long: tokens in the KV cache after this step
    query_starts: torch.Tensor  # [B+1] long: offsets of each sequence's rows in T
    logits_indices: torch.Tensor  # [S] long: the row in T of each sampling sequence's last token
    groups: list[AttentionGroup] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqLike],
        block_size: int,
        device: torch.device | str,
        min_query_len: int = DEFAULT_MIN_QUERY_LEN,
    ) -> ForwardBatch:
        """Flatten scheduled sequences into one batch (index math on the CPU, then one copy each to ``device``).

        ``min_query_len``: queries of every attention group are padded to at least this many rows
        (see LlamaModel.min_query_len for why).
        """
        if not seqs:
            raise ValueError("seqs: a forward batch needs at least one sequence")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_starts = [0]
        context_lens: list[int] = []
        logits_indices: list[int] = []
        for index, seq in enumerate(seqs):
            token_ids = seq.token_ids
            start = seq.start_pos
            table = seq.block_table
            end = start + len(token_ids)
            if not token_ids:
                raise ValueError(f"seqs[{index}].token_ids: empty")
            if start < 0:
                raise ValueError(f"seqs[{index}].start_pos: must be >= 0, got {start}")
            if len(table) * block_size < end:
                raise ValueError(
                    f"seqs[{index}].block_table: {len(table)} blocks of {block_size} cannot hold {end} tokens"
                )
            input_ids.extend(token_ids)
            positions.extend(range(start, end))
            slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in range(start, end))
            query_starts.append(end - start + query_starts[-1])
            context_lens.append(end)
            if seq.sample:
                logits_indices.append(query_starts[-1] - 1)

        max_blocks = max(len(seq.block_table) for seq in seqs)
        block_tables = torch.tensor(
            [list(seq.block_table) + [0] * (max_blocks - len(seq.block_table)) for seq in seqs], dtype=torch.int32
        )
        target = torch.device(device)

        def move(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(target, non_blocking=True)

        # decode rows (and chunks as short) in one group; longer chunks by power-of-two length
        buckets: dict[int, list[int]] = {}
        for index in range(len(seqs)):
            query_len = query_starts[index + 1] - query_starts[index]
            padded = max(min_query_len, 1 << (query_len - 1).bit_length())
            buckets.setdefault(padded if query_len > min_query_len else min_query_len, []).append(index)
        groups = [
            _build_group(members, padded_len, query_starts, context_lens, block_tables, block_size, len(input_ids))
            for padded_len, members in sorted(buckets.items())
        ]
        return cls(
            input_ids=move(torch.tensor(input_ids, dtype=torch.long)),
            positions=move(torch.tensor(positions, dtype=torch.long)),
            slot_mapping=move(torch.tensor(slots, dtype=torch.long)),
            block_tables=move(block_tables),
            context_lens=move(torch.tensor(context_lens, dtype=torch.long)),
            query_starts=move(torch.tensor(query_starts, dtype=torch.long)),
            logits_indices=move(torch.tensor(logits_indices, dtype=torch.long)),
            groups=[
                AttentionGroup(
                    query_rows=move(g.query_rows),
                    key_slots=move(g.key_slots),
                    mask=move(g.mask),
                    output_rows=move(g.output_rows),
                    token_rows=move(g.token_rows),
                )
                for g in groups
            ],
        )


def _build_group(
    members: list[int],
    query_len: int,
    query_starts: list[int],
    context_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    num_tokens: int,
) -> AttentionGroup:
    member_t = torch.tensor(members, dtype=torch.long)
    starts = torch.tensor([query_starts[i] for i in members], dtype=torch.long)
    lens = torch.tensor([query_starts[i + 1] - query_starts[i] for i in members], dtype=torch.long)
    contexts = torch.tensor([context_lens[i] for i in members], dtype=torch.long)
    # keys: padded to whole KEY_CHUNKs; positions past a table read block 0 and are masked
    key_len = -(-max(context_lens[i] for i in members) // KEY_CHUNK) * KEY_CHUNK
    table_blocks = -(-key_len // block_size)
    tables = block_tables[member_t].long()
    if tables.shape[1] < table_blocks:
        tables = F.pad(tables, (0, table_blocks - tables.shape[1]))
    offsets = torch.arange(block_size, dtype=torch.long)
    key_slots = (tables[:, :table_blocks, None] * block_size + offsets).view(len(members), -1)[:, :key_len]
    # queries: padded rows copy the last real query's view, so no row is fully masked
    query_index = torch.arange(query_len, dtype=torch.long)
    valid = query_index[None, :] < lens[:, None]
    query_rows = torch.where(valid, starts[:, None] + query_index[None, :], num_tokens)
    query_pos = torch.minimum(contexts[:, None] - lens[:, None] + query_index[None, :], contexts[:, None] - 1)
    mask = torch.arange(key_len, dtype=torch.long)[None, None, :] <= query_pos[:, :, None]
    flat_valid = valid.reshape(-1)
    return AttentionGroup(
        query_rows=query_rows,
        key_slots=key_slots,
        mask=mask.unsqueeze(1),
        output_rows=torch.nonzero(flat_valid).view(-1),
        token_rows=query_rows.reshape(-1)[flat_valid],
    )


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


class LlamaModel(nn.Module):
    """The decoder. ``forward(batch, kv)`` writes the step's K/V into the cache and returns
    fp32 logits for the rows in ``batch.logits_indices``.

    ``batch_invariant`` (default: on for CPU) makes each request's arithmetic independent of
    the rest of the batch; ``row_tile`` is the fixed row count per BLAS call in that mode.
    """

    def __init__(self, config: LlamaConfig, batch_invariant: bool = True, row_tile: int = DEFAULT_ROW_TILE) -> None:
        super().__init__()
        if row_tile < 1:
            raise ValueError(f"row_tile: must be >= 1, got {row_tile}")
        self.config = config
        self.batch_invariant = batch_invariant
        self.row_tile = row_tile
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
        model = cls(config, batch_invariant=_default_invariance(resolved, batch_invariant))
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        with torch.no_grad():
            for name, tensor in hf_state_dict(model).items():
                if not name.endswith("norm.weight"):
                    tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * INIT_STD)
        return model.to(device=resolved, dtype=dtype).eval()

    @classmethod
    def from_safetensors(
        cls,
        directory: Path | str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool | None = None,
    ) -> LlamaModel:
        """Load config.json plus model.safetensors (or a sharded model.safetensors.index.json)."""
        from safetensors.torch import load_file

        root = Path(directory)
        config_path = root / "config.json"
        if not config_path.is_file():
            raise ValueError(f"checkpoint: {root} has no config.json")
        config = LlamaConfig.from_hf_dict(json.loads(config_path.read_text(encoding="utf-8")))
        index_path = root / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map: dict[str, str] = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shard_names = sorted(set(weight_map.values()))
        elif (root / "model.safetensors").is_file():
            shard_names = ["model.safetensors"]
        else:
            raise ValueError(f"checkpoint: {root} has neither model.safetensors nor model.safetensors.index.json")
        resolved = torch.device(device)
        model = cls(config, batch_invariant=_default_invariance(resolved, batch_invariant))
        expected = hf_state_dict(model)
        seen: set[str] = set()
        with torch.no_grad():
            for shard in shard_names:
                for name, tensor in load_file(str(root / shard), device="cpu").items():
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    if name not in expected:
                        raise ValueError(f"checkpoint: unexpected tensor {name!r}")
                    if tuple(tensor.shape) != tuple(expected[name].shape):
                        raise ValueError(
                            f"checkpoint: {name!r} has shape {tuple(tensor.shape)}, "
                            f"config.json implies {tuple(expected[name].shape)}"
                        )
                    expected[name].copy_(tensor.float())
                    seen.add(name)
        missing = sorted(set(expected) - seen)
        if missing:
            raise ValueError(f"checkpoint: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        return model.to(device=resolved, dtype=dtype).eval()

    def save_safetensors(self, directory: Path | str) -> None:
        """Write config.json and model.safetensors in transformers' Llama layout."""
        from safetensors.torch import save_file

        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        hf_config = self.config.to_hf_dict()
        hf_config["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        (root / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        tensors = {name: t.detach().contiguous().cpu() for name, t in hf_state_dict(self).items()}
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})

    # --- compute ------------------------------------------------------------------------------

    @property
    def min_query_len(self) -> int:
        """Query rows per sequence below which attention GEMMs would change kernel class.

        MKL picks its kernel by row count (1, 2 and >= 3 rows sum differently), so every
        attention GEMM gets at least MIN_GEMM_ROWS rows: the GQA group times this.
        """
        group = self.config.num_heads // self.config.num_kv_heads
        return -(-MIN_GEMM_ROWS // group)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant or x.shape[0] == 0:
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

    def _pad_group(self, group: AttentionGroup) -> AttentionGroup:
        """Pad a group's queries to min_query_len rows (only for batches built with a smaller minimum)."""
        missing = self.min_query_len - group.query_len
        if not self.batch_invariant or missing <= 0:
            return group
        num_tokens = int(group.query_rows.max()) if group.query_rows.numel() else 0
        filler = torch.full((group.query_rows.shape[0], missing), num_tokens, dtype=torch.long, device=self.device)
        last_mask = group.mask[:, :, -1:, :].expand(-1, -1, missing, -1)
        return AttentionGroup(
            query_rows=torch.cat((group.query_rows, filler), dim=1),
            key_slots=group.key_slots,
            mask=torch.cat((group.mask, last_mask), dim=2),
            output_rows=(group.output_rows // group.query_len) * self.min_query_len
            + group.output_rows % group.query_len,
            token_rows=group.token_rows,
        )

    def _attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        groups: Sequence[AttentionGroup],
        head_slot_index: Sequence[torch.Tensor],
        logical_tokens: int,
    ) -> torch.Tensor:
        """q: [T', H, D] -> [T', H * D]: each sequence's queries over its paged context.

        T' >= T = ``logical_tokens``: rows past T are tile padding; their output stays zero.
        """
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = self.config.num_kv_heads
        per_kv = num_heads // num_kv_heads
        # query_rows use row T for padding: a row of tile padding when there is one, else a zero row
        padded_q = q if num_tokens > logical_tokens else torch.cat((q, q.new_zeros(1, num_heads, head_dim)))
        out = q.new_zeros(num_tokens, num_heads * head_dim)
        for group_index, group in enumerate(groups):
            num_seqs, query_len = group.query_rows.shape
            key_len = group.key_slots.shape[1]
            # index_select on flat indices: several times faster than advanced indexing on CPU
            queries = padded_q.index_select(0, group.query_rows.view(-1))
            head_slots = head_slot_index[group_index]
            keys = (
                k_cache.view(-1, head_dim).index_select(0, head_slots).view(num_kv_heads, num_seqs, key_len, head_dim)
            )
            values = v_cache.view(-1, head_dim).index_select(0, head_slots)
            values = values.view(num_kv_heads, num_seqs, key_len, head_dim)
            if self.batch_invariant:
                # [kvH, G, per_kv * Lq, D]: a query head's rows sit with the KV head they share
                grouped_q = (
                    queries.view(num_seqs, query_len, num_kv_heads, per_kv, head_dim)
                    .permute(2, 0, 3, 1, 4)
                    .reshape(num_kv_heads, num_seqs, per_kv * query_len, head_dim)
                )
                scores = torch.matmul(grouped_q, keys.transpose(-1, -2)) * self.attention_scale
                scores = scores.view(num_kv_heads, num_seqs, per_kv, query_len, key_len)
                scores = scores.masked_fill(~group.mask.view(1, num_seqs, 1, query_len, key_len), float("-inf"))
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                chunks = key_len // KEY_CHUNK
                # values summed per KEY_CHUNK, then over chunks in order: masked chunks add exact zeros
                probs = probs.view(num_kv_heads, num_seqs, per_kv * query_len, chunks, KEY_CHUNK).transpose(2, 3)
                chunked_v = values.view(num_kv_heads, num_seqs, chunks, KEY_CHUNK, head_dim)
                attended = torch.matmul(probs, chunked_v).sum(2)  # [kvH, G, per_kv * Lq, D]
                flat = (
                    attended.view(num_kv_heads, num_seqs, per_kv, query_len, head_dim)
                    .permute(1, 3, 0, 2, 4)
                    .reshape(num_seqs * query_len, num_heads * head_dim)
                )
            else:
                attended = F.scaled_dot_product_attention(
                    queries.view(num_seqs, query_len, num_heads, head_dim).transpose(1, 2),
                    keys.transpose(0, 1),
                    values.transpose(0, 1),
                    attn_mask=group.mask,
                    enable_gqa=True,
                )  # [G, H, Lq, D]
                flat = attended.transpose(1, 2).reshape(num_seqs * query_len, num_heads * head_dim)
            out.index_copy_(0, group.token_rows, flat[group.output_rows])
        return out

    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Run one step; returns logits [S, vocab] in fp32 for ``batch.logits_indices``."""
        config = self.config
        groups = [self._pad_group(group) for group in batch.groups]
        # rows of a layer's cache viewed as [kvH * slots, D], per group: one dim-0 gather per layer
        head_offsets = torch.arange(config.num_kv_heads, device=self.device)[:, None] * kv.num_slots
        head_slot_index = [(head_offsets + group.key_slots.view(1, -1)).view(-1) for group in groups]
        input_ids, positions = batch.input_ids, batch.positions
        logical_tokens = batch.num_tokens
        if self.batch_invariant:
            # pad the step to whole row tiles once, instead of in every linear layer; padding rows
            # never reach the cache or the logits, and no real row's arithmetic depends on them
            padding = -logical_tokens % self.row_tile
            input_ids, positions = F.pad(input_ids, (0, padding)), F.pad(positions, (0, padding))
        hidden = self.embed[input_ids]
        cos = self.rope_cos[positions].to(hidden.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(hidden.dtype).unsqueeze(1)
        num_tokens = hidden.shape[0]
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        for index, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            qkv = self._linear(layer.input_norm(hidden), layer.qkv_weight)
            q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
            q = rotate(q.view(num_tokens, config.num_heads, config.head_dim), cos, sin)
            k = rotate(k.view(num_tokens, config.num_kv_heads, config.head_dim), cos, sin)
            v = v.reshape(num_tokens, config.num_kv_heads, config.head_dim)
            kv.k[index].index_copy_(1, batch.slot_mapping, k[:logical_tokens].transpose(0, 1))
            kv.v[index].index_copy_(1, batch.slot_mapping, v[:logical_tokens].transpose(0, 1))
            attended = self._attention(q, kv.k[index], kv.v[index], groups, head_slot_index, logical_tokens)
            hidden = hidden + self._linear(attended, layer.o_weight)
            gate_up = self._linear(layer.post_norm(hidden), layer.gate_up_weight)
            gate, up = torch.split(gate_up, config.intermediate_size, dim=-1)
            hidden = hidden + self._linear(F.silu(gate) * up, layer.down_weight)
        # only the sampling rows go through the final norm and the LM head
        last = self.norm(hidden[batch.logits_indices])
        head = self.embed if self.lm_head is None else self.lm_head
        return self._linear(last, head).float()

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference without a cache: logits [L, vocab] fp32 for every position of one sequence."""
        config = self.config
        length = int(input_ids.shape[0])
        positions = torch.arange(length, device=input_ids.device)
        hidden = self.embed[input_ids]
        cos = self.rope_cos[positions].to(hidden.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(hidden.dtype).unsqueeze(1)
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            qkv = F.linear(layer.input_norm(hidden), layer.qkv_weight)
            q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
            q = rotate(q.view(length, config.num_heads, config.head_dim), cos, sin).transpose(0, 1)
            k = rotate(k.view(length, config.num_kv_heads, config.head_dim), cos, sin).transpose(0, 1)
            v = v.view(length, config.num_kv_heads, config.head_dim).transpose(0, 1)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            hidden = hidden + F.linear(attended.transpose(0, 1).reshape(length, q_size), layer.o_weight)
            gate_up = F.linear(layer.post_norm(hidden), layer.gate_up_weight)
            gate, up = torch.split(gate_up, config.intermediate_size, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down_weight)
        head = self.embed if self.lm_head is None else self.lm_head
        return F.linear(self.norm(hidden), head).float()


def _default_invariance(device: torch.device, requested: bool | None) -> bool:
    return requested if requested is not None else device.type == "cpu"


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


def describe(config: LlamaConfig) -> dict[str, Any]:
    """Plain-dict view of a config, for benchmark JSON."""
    out = {f.name: getattr(config, f.name) for f in fields(config)}
    out["num_parameters"] = config.num_parameters
    return out
