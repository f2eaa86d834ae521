"""Attention for DecoderLayer.forward: over one step's paged KV cache, or dense and causal over one sequence.

Both take the layer's rotated q [T, H, D] and k, v [T, kvH, D] and return [T, H * D]; the layer's
other arithmetic does not depend on which one it is given.

The fast kernels (PagedAttention without ``batch_invariant``, the default) run SDPA over the step's
exact plan (batch.py): a whole prompt over its own K/V with ``is_causal`` (nothing read back from the
cache), a later prompt chunk over its cached blocks, and decode rows per bucket of similar context
length. The cache is gathered whole blocks at a time (block_size * head_dim values per index).

Batch invariance (PagedAttention with ``batch_invariant``): attention runs per group of sequences
padded to a common chunk length, with at least MIN_GEMM_ROWS query rows per GEMM; keys are padded to
whole KEY_CHUNKs and the value sum is done per chunk, then over chunks in order, so masked padding
adds exact zeros instead of changing the summation order.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from batchpilot_runtime.model.batch import KEY_CHUNK, AttentionGroup, ForwardBatch
from batchpilot_runtime.model.kv_cache import PagedKVCache

# q [T, H, D], k [T, kvH, D], v [T, kvH, D] -> attended [T, H * D]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# MKL picks its kernel by row count (1, 2 and >= 3 rows sum differently): the fewest rows an attention
# GEMM gets in batch-invariant mode.
MIN_GEMM_ROWS = 4


def min_query_len(num_heads: int, num_kv_heads: int) -> int:
    """Query rows per sequence that give every attention GEMM MIN_GEMM_ROWS rows: the GQA group times this."""
    group = num_heads // num_kv_heads
    return -(-MIN_GEMM_ROWS // group)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One whole sequence, no cache: row i attends to rows 0..i."""
    length = int(q.shape[0])
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )  # [H, L, D]
    return attended.transpose(0, 1).reshape(length, -1)


def pad_group(group: AttentionGroup, query_len: int) -> AttentionGroup:
    """Pad a group's queries to ``query_len`` rows (only for batches built with a smaller minimum)."""
    missing = query_len - group.query_len
    if missing <= 0:
        return group
    num_tokens = int(group.query_rows.max()) if group.query_rows.numel() else 0
    filler = torch.full(
        (group.query_rows.shape[0], missing), num_tokens, dtype=torch.long, device=group.query_rows.device
    )
    last_mask = group.mask[:, :, -1:, :].expand(-1, -1, missing, -1)
    return AttentionGroup(
        query_rows=torch.cat((group.query_rows, filler), dim=1),
        key_slots=group.key_slots,
        mask=torch.cat((group.mask, last_mask), dim=2),
        output_rows=(group.output_rows // group.query_len) * query_len + group.output_rows % group.query_len,
        token_rows=group.token_rows,
    )


class PagedAttention:
    """One step's attention over the paged KV cache: set up once per forward, ``layer(i)`` for each layer.

    The attention of layer i first writes the step's K/V (its first ``batch.num_tokens`` rows; rows past
    them are tile padding) into the cache at ``batch.slot_mapping``, then attends each sequence's
    queries over its whole context.
    """

    def __init__(
        self,
        batch: ForwardBatch,
        kv: PagedKVCache,
        scale: float,
        batch_invariant: bool,
        min_query_len: int,
    ) -> None:
        self.kv = kv
        self.scale = scale
        self.batch_invariant = batch_invariant
        self.slot_mapping = batch.slot_mapping
        self.logical_tokens = batch.num_tokens
        device = batch.slot_mapping.device
        if not batch_invariant:
            self.plan = batch.exact
            # a layer's cache viewed as [kvH * num_blocks, block_size * D]: row h * num_blocks + b is
            # block b of head h, so a gather lays a sequence's keys out as SDPA reads them
            head_offsets = torch.arange(kv.num_kv_heads, device=device)[None, :, None] * kv.num_blocks
            self.chunk_index = [(head_offsets + c.blocks[:, None, :]).view(-1) for c in self.plan.chunks]
            self.decode_index = [(head_offsets + b.blocks[:, None, :]).view(-1) for b in self.plan.decodes]
            return
        self.groups = [pad_group(group, min_query_len) for group in batch.groups]
        # rows of a layer's cache viewed as [kvH * slots, D], per group: one dim-0 gather per layer
        head_offsets = torch.arange(kv.num_kv_heads, device=device)[:, None] * kv.num_slots
        self.head_slot_index = [(head_offsets + group.key_slots.view(1, -1)).view(-1) for group in self.groups]

    def layer(self, index: int) -> Attention:
        return partial(self._attend if self.batch_invariant else self._attend_exact, index)

    def _store(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's K/V into layer ``index``'s cache; return that layer's K and V caches."""
        k_cache, v_cache = self.kv.k[index], self.kv.v[index]
        k_cache.index_copy_(1, self.slot_mapping, k[: self.logical_tokens].transpose(0, 1))
        v_cache.index_copy_(1, self.slot_mapping, v[: self.logical_tokens].transpose(0, 1))
        return k_cache, v_cache

    def _attend_exact(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D] -> [T, H * D] over the exact plan (the fast kernels; no tile padding)."""
        k_cache, v_cache = self._store(index, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = self.kv.num_kv_heads
        k_blocks = k_cache.view(num_kv_heads * self.kv.num_blocks, -1)
        v_blocks = v_cache.view(num_kv_heads * self.kv.num_blocks, -1)
        # every row is written below: each sequence is one prompt, chunk or bucket member (ExactPlan)
        out = q.new_empty(num_tokens, num_heads * head_dim)
        for start, end in self.plan.prompts:
            # 4-D: with 3-D inputs CPU SDPA takes its unfused math path
            attended = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1).unsqueeze(0),
                k[start:end].transpose(0, 1).unsqueeze(0),
                v[start:end].transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=self.scale,
                enable_gqa=True,
            )  # [1, H, L, D]
            out[start:end] = attended[0].transpose(0, 1).reshape(end - start, -1)
        for chunk, block_index in zip(self.plan.chunks, self.chunk_index, strict=True):
            key_len = chunk.mask.shape[-1]
            attended = F.scaled_dot_product_attention(
                q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0),
                k_blocks.index_select(0, block_index).view(1, num_kv_heads, key_len, head_dim),
                v_blocks.index_select(0, block_index).view(1, num_kv_heads, key_len, head_dim),
                attn_mask=chunk.mask,
                scale=self.scale,
                enable_gqa=True,
            )  # [1, H, Lq, D]
            out[chunk.start : chunk.end] = attended[0].transpose(0, 1).reshape(chunk.end - chunk.start, -1)
        for bucket, block_index in zip(self.plan.decodes, self.decode_index, strict=True):
            num_seqs, key_len = bucket.rows.shape[0], bucket.mask.shape[-1]
            attended = F.scaled_dot_product_attention(
                q.index_select(0, bucket.rows).unsqueeze(2),
                k_blocks.index_select(0, block_index).view(num_seqs, num_kv_heads, key_len, head_dim),
                v_blocks.index_select(0, block_index).view(num_seqs, num_kv_heads, key_len, head_dim),
                attn_mask=bucket.mask,
                scale=self.scale,
                enable_gqa=True,
            )  # [G, H, 1, D]
            out.index_copy_(0, bucket.rows, attended.view(num_seqs, -1))
        return out

    def _attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T', H, D] -> [T', H * D]: each sequence's queries over its paged context, in padded groups.

        T' >= T = ``logical_tokens``: rows past T are tile padding; their output stays zero.
        """
        k_cache, v_cache = self._store(index, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = self.kv.num_kv_heads
        # query_rows use row T for padding: a row of tile padding when there is one, else a zero row
        padded_q = q if num_tokens > self.logical_tokens else torch.cat((q, q.new_zeros(1, num_heads, head_dim)))
        out = q.new_zeros(num_tokens, num_heads * head_dim)
        for group, head_slots in zip(self.groups, self.head_slot_index, strict=True):
            num_seqs = group.query_rows.shape[0]
            key_len = group.key_slots.shape[1]
            # index_select on flat indices: several times faster than advanced indexing on CPU
            queries = padded_q.index_select(0, group.query_rows.view(-1))
            keys = (
                k_cache.view(-1, head_dim).index_select(0, head_slots).view(num_kv_heads, num_seqs, key_len, head_dim)
            )
            values = v_cache.view(-1, head_dim).index_select(0, head_slots)
            values = values.view(num_kv_heads, num_seqs, key_len, head_dim)
            flat = self._invariant(queries, keys, values, group.mask)
            out.index_copy_(0, group.token_rows, flat[group.output_rows])
        return out

    def _invariant(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Batch-invariant attention of one group: queries [G * Lq, H, D], keys/values [kvH, G, Lk, D],
        mask [G, 1, Lq, Lk] -> [G * Lq, H * D]."""
        num_kv_heads, num_seqs, key_len, head_dim = keys.shape
        num_heads = queries.shape[1]
        query_len = queries.shape[0] // num_seqs
        per_kv = num_heads // num_kv_heads
        # [kvH, G, per_kv * Lq, D]: a query head's rows sit with the KV head they share
        grouped_q = (
            queries.view(num_seqs, query_len, num_kv_heads, per_kv, head_dim)
            .permute(2, 0, 3, 1, 4)
            .reshape(num_kv_heads, num_seqs, per_kv * query_len, head_dim)
        )
        scores = torch.matmul(grouped_q, keys.transpose(-1, -2)) * self.scale
        scores = scores.view(num_kv_heads, num_seqs, per_kv, query_len, key_len)
        scores = scores.masked_fill(~mask.view(1, num_seqs, 1, query_len, key_len), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
        chunks = key_len // KEY_CHUNK
        # values summed per KEY_CHUNK, then over chunks in order: masked chunks add exact zeros
        probs = probs.view(num_kv_heads, num_seqs, per_kv * query_len, chunks, KEY_CHUNK).transpose(2, 3)
        chunked_v = values.view(num_kv_heads, num_seqs, chunks, KEY_CHUNK, head_dim)
        attended = torch.matmul(probs, chunked_v).sum(2)  # [kvH, G, per_kv * Lq, D]
        return (
            attended.view(num_kv_heads, num_seqs, per_kv, query_len, head_dim)
            .permute(1, 3, 0, 2, 4)
            .reshape(num_seqs * query_len, num_heads * head_dim)
        )
