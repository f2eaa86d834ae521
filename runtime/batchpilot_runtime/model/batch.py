"""One engine step's input: scheduled sequences flattened into T token rows, plus its attention plan.

Index math runs on the CPU, then each tensor is copied once to the device. The attention plan is built
once per step, on first use, and used by every layer (attention.py computes over it). There are two:

- ``exact`` (the fast kernels): every sequence at its own lengths. A whole prompt attends causally
  over its own rows, with nothing read from the cache; a later prompt chunk over its cached blocks;
  decode rows in buckets of similar context length, each padded only to its longest member's blocks.
- ``groups`` (batch-invariant kernels): sequences padded to shared shapes that do not depend on the
  rest of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F

# Keys are padded, and values summed, in chunks of this many positions: a fixed GEMM depth, so that
# padding a context with masked keys adds exact zeros instead of changing the summation order.
KEY_CHUNK = 32
# Query rows per sequence that ForwardBatch.build pads attention groups to; the model pads further
# when that leaves an attention GEMM under attention.MIN_GEMM_ROWS rows (query rows x GQA group size).
DEFAULT_MIN_QUERY_LEN = 2
# Decode rows whose contexts are at most this long share one bucket of the exact plan: under it, one
# more attention call per layer costs about what the padding it saves does (one CPU core: 10 decodes
# over 64 keys, 102 us with their gathers; 5 over 32 plus 5 over 64, 82 us).
DECODE_BUCKET_MIN_KEYS = 64


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

    def to(self, device: torch.device) -> AttentionGroup:
        """The same group with every tensor copied to ``device`` (without waiting for the copies)."""
        return AttentionGroup(
            query_rows=self.query_rows.to(device, non_blocking=True),
            key_slots=self.key_slots.to(device, non_blocking=True),
            mask=self.mask.to(device, non_blocking=True),
            output_rows=self.output_rows.to(device, non_blocking=True),
            token_rows=self.token_rows.to(device, non_blocking=True),
        )


@dataclass(frozen=True)
class DecodeBucket:
    """Decoding sequences (one query row each) whose contexts fall in one power-of-two range."""

    rows: torch.Tensor  # [G] long: each sequence's row in T
    blocks: torch.Tensor  # [G, nb] long: its cache blocks, block 0 past its table (masked)
    mask: torch.Tensor  # [G, 1, 1, nb * block_size] bool: key within the sequence's context

    def to(self, device: torch.device) -> DecodeBucket:
        return DecodeBucket(*(t.to(device, non_blocking=True) for t in (self.rows, self.blocks, self.mask)))


@dataclass(frozen=True)
class PromptChunk:
    """A prompt chunk after earlier chunks of the same prompt: rows ``start:end`` of T attend to the
    cached context and causally to each other."""

    start: int
    end: int
    blocks: torch.Tensor  # [1, nb] long: the sequence's cache blocks up to this chunk's end
    mask: torch.Tensor  # [1, 1, end - start, nb * block_size] bool

    def to(self, device: torch.device) -> PromptChunk:
        return PromptChunk(
            self.start, self.end, self.blocks.to(device, non_blocking=True), self.mask.to(device, non_blocking=True)
        )


@dataclass(frozen=True)
class ExactPlan:
    """The fast kernels' attention plan: every row attends to exactly its own context.

    Every row of the step belongs to exactly one prompt, chunk or bucket, so together they fill the
    whole attention output.
    """

    prompts: tuple[tuple[int, int], ...]  # whole prompts: rows start:end of T, causal over themselves
    chunks: tuple[PromptChunk, ...]
    decodes: tuple[DecodeBucket, ...]

    def to(self, device: torch.device) -> ExactPlan:
        return ExactPlan(
            self.prompts, tuple(c.to(device) for c in self.chunks), tuple(b.to(device) for b in self.decodes)
        )


@dataclass(frozen=True)
class StepLayout:
    """Where each sequence of a step sits, kept on the CPU: what the attention plans are built from."""

    query_starts: tuple[int, ...]  # B+1 offsets into T
    context_lens: tuple[int, ...]  # B: tokens in the cache after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, on the CPU
    block_size: int
    min_query_len: int


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
    layout: StepLayout

    @cached_property
    def groups(self) -> list[AttentionGroup]:
        """The batch-invariant kernels' plan (built on first use)."""
        layout = self.layout
        groups = _build_groups(
            layout.query_starts, layout.context_lens, layout.block_tables, layout.block_size, layout.min_query_len
        )
        return [group.to(self.input_ids.device) for group in groups]

    @cached_property
    def exact(self) -> ExactPlan:
        """The fast kernels' plan (built on first use)."""
        return build_exact_plan(self.layout).to(self.input_ids.device)

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

        return cls(
            input_ids=move(torch.tensor(input_ids, dtype=torch.long)),
            positions=move(torch.tensor(positions, dtype=torch.long)),
            slot_mapping=move(torch.tensor(slots, dtype=torch.long)),
            block_tables=move(block_tables),
            context_lens=move(torch.tensor(context_lens, dtype=torch.long)),
            query_starts=move(torch.tensor(query_starts, dtype=torch.long)),
            logits_indices=move(torch.tensor(logits_indices, dtype=torch.long)),
            layout=StepLayout(tuple(query_starts), tuple(context_lens), block_tables, block_size, min_query_len),
        )


def _build_groups(
    query_starts: Sequence[int],
    context_lens: Sequence[int],
    block_tables: torch.Tensor,
    block_size: int,
    min_query_len: int,
) -> list[AttentionGroup]:
    """Decode rows (and chunks as short) in one group; longer chunks grouped by power-of-two length."""
    num_tokens = query_starts[-1]
    buckets: dict[int, list[int]] = {}
    for index in range(len(context_lens)):
        query_len = query_starts[index + 1] - query_starts[index]
        padded = max(min_query_len, 1 << (query_len - 1).bit_length())
        buckets.setdefault(padded if query_len > min_query_len else min_query_len, []).append(index)
    return [
        _build_group(members, padded_len, query_starts, context_lens, block_tables, block_size, num_tokens)
        for padded_len, members in sorted(buckets.items())
    ]


def _build_group(
    members: list[int],
    query_len: int,
    query_starts: Sequence[int],
    context_lens: Sequence[int],
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


def build_exact_plan(layout: StepLayout) -> ExactPlan:
    """Sort the step's sequences into whole prompts, later prompt chunks and decode buckets."""
    block_size = layout.block_size
    prompts: list[tuple[int, int]] = []
    chunks: list[PromptChunk] = []
    buckets: dict[int, list[int]] = {}
    for index, context_len in enumerate(layout.context_lens):
        start, end = layout.query_starts[index], layout.query_starts[index + 1]
        query_len = end - start
        if query_len == 1:
            keys = max(context_len, DECODE_BUCKET_MIN_KEYS)
            buckets.setdefault((keys - 1).bit_length(), []).append(index)
        elif query_len == context_len:
            prompts.append((start, end))
        else:
            num_blocks = -(-context_len // block_size)
            key_pos = torch.arange(num_blocks * block_size)
            query_pos = torch.arange(context_len - query_len, context_len)
            chunks.append(
                PromptChunk(
                    start,
                    end,
                    layout.block_tables[index : index + 1, :num_blocks].long(),
                    (key_pos[None, :] <= query_pos[:, None]).view(1, 1, query_len, -1),
                )
            )
    decodes = []
    for _, members in sorted(buckets.items()):
        contexts = torch.tensor([layout.context_lens[i] for i in members])
        num_blocks = -(-int(contexts.max()) // block_size)
        decodes.append(
            DecodeBucket(
                rows=torch.tensor([layout.query_starts[i] for i in members]),
                # build() checked that every table holds its context, so the padded tables have these columns
                blocks=layout.block_tables[members, :num_blocks].long(),
                mask=(torch.arange(num_blocks * block_size)[None, :] < contexts[:, None]).view(len(members), 1, 1, -1),
            )
        )
    return ExactPlan(tuple(prompts), tuple(chunks), tuple(decodes))
