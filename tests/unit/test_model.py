"""The paged model against an unpaged reference, and batch invariance (fp32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from batchpilot_runtime.model.batch import ForwardBatch
from batchpilot_runtime.model.config import PRESETS, LlamaConfig, config_from_name
from batchpilot_runtime.model.kv_cache import PagedKVCache, bytes_per_token
from batchpilot_runtime.model.model import LlamaModel
from tests.support.torch_fixtures import Seq, one_thread  # noqa: F401  (autouse fixture)

BLOCK = 16


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    """Batch-invariant (asked for: the default is the fast kernels), for the bitwise tests."""
    return LlamaModel.random(PRESETS["tiny"], seed=7, batch_invariant=True)


def make_kv(model: LlamaModel, num_blocks: int = 64) -> PagedKVCache:
    return PagedKVCache(model.config, num_blocks, BLOCK, "cpu", torch.float32)


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(259) for _ in range(length)]


def run(model: LlamaModel, kv: PagedKVCache, seqs: list[Seq], min_query_len: int | None = None) -> torch.Tensor:
    extra = {} if min_query_len is None else {"min_query_len": min_query_len}
    batch = ForwardBatch.build(seqs, BLOCK, "cpu", **extra)
    with torch.no_grad():
        return model(batch, kv)


def test_presets_have_the_promised_sizes() -> None:
    tiny, small = config_from_name("tiny"), config_from_name("small")
    assert 100_000 <= tiny.num_parameters <= 1_000_000
    assert 20_000_000 <= small.num_parameters <= 120_000_000
    assert tiny.vocab_size >= 259
    assert tiny.num_kv_heads < tiny.num_heads
    model = LlamaModel.random(tiny, seed=0)
    assert sum(p.numel() for p in model.parameters()) == tiny.num_parameters


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="preset"):
        config_from_name("huge")


def test_random_weights_depend_only_on_the_seed() -> None:
    first = LlamaModel.random(PRESETS["tiny"], seed=3)
    again = LlamaModel.random(PRESETS["tiny"], seed=3)
    other = LlamaModel.random(PRESETS["tiny"], seed=4)
    assert torch.equal(first.embed, again.embed)
    assert not torch.equal(first.embed, other.embed)


def test_paged_prefill_over_scattered_blocks_matches_dense(tiny: LlamaModel) -> None:
    prompt = make_prompt(45, seed=1)
    logits = run(tiny, make_kv(tiny), [Seq(tuple(prompt), 0, (9, 2, 30))])
    dense = tiny.forward_dense(torch.tensor(prompt))
    torch.testing.assert_close(logits[0], dense[-1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunks", [(20, 25), (7, 30, 8)])
def test_chunked_prefill_gives_the_one_shot_logits_bitwise(tiny: LlamaModel, chunks: tuple[int, ...]) -> None:
    prompt = make_prompt(sum(chunks), seed=2)
    table = (5, 11, 3, 40)
    one_shot = run(tiny, make_kv(tiny), [Seq(tuple(prompt), 0, table)])
    kv = make_kv(tiny)
    start = 0
    for size in chunks:
        last = start + size == len(prompt)
        logits = run(tiny, kv, [Seq(tuple(prompt[start : start + size]), start, table, sample=last)])
        start += size
    assert torch.equal(logits, one_shot)


def test_mixed_batch_matches_each_sequence_alone_bitwise(tiny: LlamaModel) -> None:
    """Decode rows, a prefill chunk and a whole prompt in one step: each row equals its solo run."""
    prompts = [make_prompt(n, seed=10 + n) for n in (30, 12, 70, 5)]
    tables = [(0, 7), (12, 3), (20, 21, 22, 23, 24), (30,)]
    # prefix state: seqs 0 and 1 already hold their prompts, seq 2 holds its first 40 tokens
    prefixes = [prompts[0], prompts[1], prompts[2][:40], []]
    step = [
        Seq((17,), 30, tables[0]),
        Seq((250,), 12, tables[1]),
        Seq(tuple(prompts[2][40:]), 40, tables[2]),
        Seq(tuple(prompts[3]), 0, tables[3]),
    ]

    def fill_prefix(kv: PagedKVCache, index: int) -> None:
        if prefixes[index]:
            run(tiny, kv, [Seq(tuple(prefixes[index]), 0, tables[index])])

    kv = make_kv(tiny)
    for index in range(4):
        fill_prefix(kv, index)
    batched = run(tiny, kv, step)
    for index in range(4):
        solo_kv = make_kv(tiny)
        fill_prefix(solo_kv, index)
        alone = run(tiny, solo_kv, [step[index]])
        assert torch.equal(batched[index], alone[0]), f"sequence {index}"
        # and the paged result is the unpaged one, up to rounding
        full = prefixes[index] + list(step[index].token_ids)
        torch.testing.assert_close(alone[0], tiny.forward_dense(torch.tensor(full))[-1], rtol=0, atol=1e-5)


def test_fast_mode_matches_invariant_mode_up_to_rounding(tiny: LlamaModel) -> None:
    fast = LlamaModel.random(PRESETS["tiny"], seed=7, batch_invariant=False)
    seqs = [Seq(tuple(make_prompt(n, seed=n)), 0, (n,)) for n in (3, 9, 16)]
    torch.testing.assert_close(run(fast, make_kv(fast), seqs), run(tiny, make_kv(tiny), seqs), rtol=0, atol=1e-5)


def test_batches_built_with_fewer_query_rows_are_padded_by_the_model(tiny: LlamaModel) -> None:
    seqs = [Seq((4,), 10, (1,)), Seq((9,), 3, (2,))]
    kv = make_kv(tiny)
    run(tiny, kv, [Seq(tuple(make_prompt(10, 5)), 0, (1,)), Seq(tuple(make_prompt(3, 6)), 0, (2,))])
    assert tiny.min_query_len == 2
    assert torch.equal(run(tiny, kv, seqs, min_query_len=1), run(tiny, kv, seqs))


def greedy_alone(model: LlamaModel, prompt: list[int], new_tokens: int, table: tuple[int, ...]) -> list[int]:
    kv = make_kv(model)
    feed, start, out = prompt, 0, []
    while len(out) < new_tokens:
        token = int(run(model, kv, [Seq(tuple(feed), start, table)])[0].argmax())
        start += len(feed)
        feed = [token]
        out.append(token)
    return out


def test_continuous_greedy_decoding_equals_each_request_alone(tiny: LlamaModel) -> None:
    """Requests join, chunk their prompts at random sizes and leave; tokens equal the solo runs."""
    rng = random.Random(0)
    requests = [(make_prompt(rng.randint(1, 50), seed=100 + i), rng.randint(1, 12)) for i in range(12)]
    blocks = list(range(64))
    rng.shuffle(blocks)
    tables = [tuple(blocks[i * 4 : i * 4 + 4]) for i in range(12)]
    expected = [greedy_alone(tiny, p, n, tables[i]) for i, (p, n) in enumerate(requests)]

    kv = make_kv(tiny)
    waiting = list(range(12))
    running: dict[int, tuple[int, list[int]]] = {}  # request -> (tokens in KV, tokens still to feed)
    got: dict[int, list[int]] = {i: [] for i in range(12)}
    while waiting or running:
        while waiting and len(running) < 5:
            request = waiting.pop(0)
            running[request] = (0, requests[request][0])
        step: list[tuple[int, int, Seq]] = []
        for request, (start, feed) in running.items():
            size = rng.randint(1, len(feed))
            step.append((request, size, Seq(tuple(feed[:size]), start, tables[request], sample=size == len(feed))))
        logits = run(tiny, kv, [seq for _, _, seq in step])
        row = 0
        for request, size, seq in step:
            start, feed = running[request]
            running[request] = (start + size, feed[size:])
            if seq.sample:
                token = int(logits[row].argmax())
                row += 1
                got[request].append(token)
                running[request] = (start + size, [token])
                if len(got[request]) == requests[request][1]:
                    del running[request]
    assert [got[i] for i in range(12)] == expected


def test_build_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="block_table"):
        ForwardBatch.build([Seq((1, 2, 3), 15, (0,))], BLOCK, "cpu")
    with pytest.raises(ValueError, match="token_ids"):
        ForwardBatch.build([Seq((), 0, (0,))], BLOCK, "cpu")
    with pytest.raises(ValueError, match="seqs"):
        ForwardBatch.build([], BLOCK, "cpu")


def test_build_flattens_the_step() -> None:
    batch = ForwardBatch.build(
        [Seq((5,), 17, (3, 8)), Seq((1, 2, 3), 0, (4,), sample=False), Seq((9, 9), 2, (6,))], BLOCK, "cpu"
    )
    assert batch.input_ids.tolist() == [5, 1, 2, 3, 9, 9]
    assert batch.positions.tolist() == [17, 0, 1, 2, 2, 3]
    assert batch.slot_mapping.tolist() == [8 * 16 + 1, 64, 65, 66, 98, 99]
    assert batch.query_starts.tolist() == [0, 1, 4, 6]
    assert batch.context_lens.tolist() == [18, 3, 4]
    assert batch.logits_indices.tolist() == [0, 5]
    assert batch.block_tables.tolist() == [[3, 8], [4, 0], [6, 0]]
    assert batch.block_tables.dtype == torch.int32


def test_kv_cache_sizing() -> None:
    config = PRESETS["tiny"]
    assert PagedKVCache.blocks_for_token_budget(100, 16) == 7
    kv = PagedKVCache(config, 7, 16, "cpu", torch.float32)
    assert kv.capacity_tokens == 112
    assert kv.k.shape == (config.num_layers, config.num_kv_heads, 112, config.head_dim)
    assert kv.nbytes == 112 * bytes_per_token(config, torch.float32)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        PagedKVCache.blocks_for_token_budget(0, 16)
    with pytest.raises(ValueError, match="device"):
        PagedKVCache.blocks_for_memory_fraction(config, 16, 0.5, "cpu", torch.float32)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_step_without_sampling_rows_returns_no_logits(tiny: LlamaModel, threads: int) -> None:
    torch.set_num_threads(threads)
    logits = run(tiny, make_kv(tiny), [Seq((1, 2, 3), 0, (0,), sample=False)])
    assert logits.shape == (0, tiny.config.vocab_size)
