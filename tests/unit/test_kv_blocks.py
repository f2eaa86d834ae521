"""KV block accounting: the free list, per-request tables, "does not fit" answered with None."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot_runtime.scheduling.kv_blocks import BlockPool, KVBlockManager, blocks_for_tokens


@pytest.mark.parametrize(
    ("tokens", "block_size", "blocks"),
    [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (5, 1, 5)],
)
def test_blocks_for_tokens_is_ceiling_division(tokens: int, block_size: int, blocks: int) -> None:
    assert blocks_for_tokens(tokens, block_size) == blocks


@pytest.mark.parametrize(("num_blocks", "block_size", "field"), [(0, 16, "num_blocks"), (4, 0, "block_size")])
def test_pool_rejects_bad_sizes_naming_the_field(num_blocks: int, block_size: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BlockPool(num_blocks, block_size)


def test_pool_take_and_give_back() -> None:
    pool = BlockPool(4, 16)
    taken = pool.take(3)
    assert taken == (0, 1, 2)
    assert pool.num_free == 1
    assert pool.usage_ratio == 0.75
    assert pool.take(2) is None
    assert pool.num_free == 1  # a refused take takes nothing
    pool.give_back(taken)
    assert pool.num_free == 4
    assert pool.take(1) == (0,)  # the most recently freed block comes back first


def test_manager_grows_a_table_block_by_block() -> None:
    kv = KVBlockManager(num_blocks=8, block_size=4)
    assert kv.capacity_tokens == 32
    assert kv.blocks_needed("a", 5) == 2
    assert kv.allocate("a", 5) == (0, 1)
    assert kv.blocks_needed("a", 8) == 0
    assert kv.allocate("a", 8) == (0, 1)  # still fits: same table
    assert kv.allocate("a", 9) == (0, 1, 2)
    assert kv.allocate("a", 3) == (0, 1, 2)  # never shrinks
    assert kv.block_table("a") == (0, 1, 2)
    assert kv.num_free_blocks == 5
    assert kv.usage_ratio == 3 / 8


def test_manager_allocate_answers_none_and_changes_nothing_when_it_does_not_fit() -> None:
    kv = KVBlockManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 12) == (0, 1, 2)
    assert kv.allocate("b", 8) is None
    assert kv.block_table("b") == ()
    assert not kv.holds("b")
    assert kv.allocate("a", 20) is None
    assert kv.block_table("a") == (0, 1, 2)
    assert kv.num_free_blocks == 1


def test_manager_free_returns_blocks_and_forgets_the_request() -> None:
    kv = KVBlockManager(num_blocks=4, block_size=4)
    kv.allocate("a", 8)
    kv.allocate("b", 8)
    assert kv.free("a") == 2
    assert kv.free("a") == 0
    assert kv.block_table("a") == ()
    assert kv.num_free_blocks == 2
    assert kv.allocate("c", 8) == (0, 1)  # a's blocks, reused in their old order


def test_manager_allocate_of_zero_tokens_registers_an_empty_table() -> None:
    kv = KVBlockManager(num_blocks=2, block_size=4)
    assert kv.allocate("a", 0) == ()
    assert kv.holds("a")


def test_manager_rejects_negative_tokens() -> None:
    kv = KVBlockManager(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="total_tokens"):
        kv.allocate("a", -1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(0, 40)),
        max_size=60,
    )
)
def test_every_block_is_free_or_in_exactly_one_table(ops: list[tuple[str, int, int]]) -> None:
    kv = KVBlockManager(num_blocks=10, block_size=4)
    for op, request, tokens in ops:
        request_id = f"r{request}"
        before = kv.block_table(request_id)
        if op == "alloc":
            table = kv.allocate(request_id, tokens)
            if table is None:
                assert kv.block_table(request_id) == before
            else:
                assert len(table) * 4 >= tokens
                assert table[: len(before)] == before
        else:
            kv.free(request_id)
        held = [block for r in range(6) for block in kv.block_table(f"r{r}")]
        assert len(held) == len(set(held))
        assert len(held) + kv.num_free_blocks == 10
