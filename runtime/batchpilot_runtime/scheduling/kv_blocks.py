"""KV-cache block accounting: which fixed-size blocks of the paged cache each request holds.

Pure bookkeeping, no torch: the scheduler decides with it, the engine's ``PagedKVCache`` holds the
tensors the block ids index. Two layers, as in vLLM:

- ``BlockPool``: the free list of block ids ``0 .. num_blocks-1``.
- ``KVBlockManager``: one block table per request on top of a pool. ``allocate`` answers ``None``
  when the blocks do not fit and then changes nothing, so that the caller (the scheduler) chooses
  whom to preempt.

Invariants: a block id is either free or in exactly one table; ``num_free + sum(len(table)) ==
num_blocks``. Block tables are kept as tuples, so handing one to a step plan copies nothing; a table
grows by one block every ``block_size`` tokens, which keeps the re-tupling cost amortised small.
"""

from __future__ import annotations

from collections import deque


def blocks_for_tokens(total_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``total_tokens`` tokens (ceiling division)."""
    return -(-total_tokens // block_size)


class BlockPool:
    """A free list of ``num_blocks`` block ids of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage_ratio(self) -> float:
        return self.num_used / self.num_blocks

    def take(self, count: int) -> tuple[int, ...] | None:
        """``count`` free block ids, or ``None`` (and nothing taken) when fewer are free."""
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        if count > len(self._free):
            return None
        free = self._free
        return tuple(free.popleft() for _ in range(count))

    def give_back(self, block_ids: tuple[int, ...]) -> None:
        """Return blocks to the free list; the most recently freed are reused first (warm in caches)."""
        self._free.extendleft(reversed(block_ids))


class KVBlockManager:
    """Per-request block tables over one ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self._tables: dict[str, tuple[int, ...]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage_ratio(self) -> float:
        return self.pool.usage_ratio

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_for_tokens(self, total_tokens: int) -> int:
        return blocks_for_tokens(total_tokens, self.block_size)

    def blocks_needed(self, request_id: str, total_tokens: int) -> int:
        """Blocks to add to the request's table so that it holds ``total_tokens`` (0 when it already does)."""
        held = len(self._tables.get(request_id, ()))
        return max(0, blocks_for_tokens(total_tokens, self.block_size) - held)

    def allocate(self, request_id: str, total_tokens: int) -> tuple[int, ...] | None:
        """Grow the request's table to hold ``total_tokens``; the whole table, or ``None`` if it does not fit.

        On ``None`` nothing changed. A table never shrinks here: asking for fewer tokens than it
        holds returns it unchanged.
        """
        table = self._tables.get(request_id)
        if table is not None and total_tokens <= len(table) * self.block_size:
            return table  # the per-decode-step fast path: most steps need no new block
        if total_tokens < 0:
            raise ValueError(f"total_tokens must be non-negative, got {total_tokens}")
        if table is None:
            table = ()
        missing = blocks_for_tokens(total_tokens, self.block_size) - len(table)
        if missing <= 0:
            self._tables[request_id] = table
            return table
        new_blocks = self.pool.take(missing)
        if new_blocks is None:
            return None
        table = table + new_blocks
        self._tables[request_id] = table
        return table

    def free(self, request_id: str) -> int:
        """Release every block of the request; the number of blocks freed (0 for an unknown request)."""
        table = self._tables.pop(request_id, ())
        if table:
            self.pool.give_back(table)
        return len(table)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's blocks in position order (empty when it holds none)."""
        return self._tables.get(request_id, ())

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables
