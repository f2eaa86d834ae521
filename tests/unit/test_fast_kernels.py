"""The fast kernels against the unpaged reference: the exact attention plan (whole prompts, later
prompt chunks, decode buckets) and oneDNN's packed linear layers (fp32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpilot_runtime.model.batch import DECODE_BUCKET_MIN_KEYS, ForwardBatch, build_exact_plan
from batchpilot_runtime.model.config import PRESETS
from batchpilot_runtime.model.kv_cache import PagedKVCache
from batchpilot_runtime.model.model import LlamaModel
from batchpilot_runtime.model.packed_linear import (
    CPU_GEMM_ENV,
    PackedLinear,
    onednn_linear_available,
    resolve_cpu_gemm,
)
from tests.support.torch_fixtures import Seq, one_thread  # noqa: F401  (autouse fixture)

BLOCK = 16
needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear ops")


@pytest.fixture(scope="module")
def fast() -> LlamaModel:
    return LlamaModel.random(PRESETS["tiny"], seed=7, batch_invariant=False)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(259) for _ in range(length)]


def blocks_for(index: int, tokens: int) -> tuple[int, ...]:
    """Sequence ``index``'s blocks, interleaved with the others' so that no table is contiguous."""
    return tuple(index + 8 * b for b in range(-(-tokens // BLOCK)))


def step_against_dense(model: LlamaModel, sequences: list[tuple[int, int]]) -> None:
    """Each (cached, new) sequence holds ``cached`` tokens already and runs ``new`` more in one shared
    step; each one's logits must be the dense reference's for its whole context."""
    kv = PagedKVCache(model.config, 8 * 40, BLOCK, "cpu", torch.float32)
    prompts = [prompt(cached + new, seed=index) for index, (cached, new) in enumerate(sequences)]
    tables = [blocks_for(index, len(tokens)) for index, tokens in enumerate(prompts)]
    with torch.no_grad():
        for index, (cached, _) in enumerate(sequences):
            if cached:
                model(ForwardBatch.build([Seq(tuple(prompts[index][:cached]), 0, tables[index])], BLOCK, "cpu"), kv)
        step = [
            Seq(tuple(prompts[index][cached:]), cached, tables[index]) for index, (cached, _) in enumerate(sequences)
        ]
        logits = model(ForwardBatch.build(step, BLOCK, "cpu"), kv)
        for index, tokens in enumerate(prompts):
            dense = model.forward_dense(torch.tensor(tokens))[-1]
            torch.testing.assert_close(logits[index], dense, rtol=0, atol=2e-5, msg=f"sequence {index}")


def test_a_mixed_step_matches_the_reference_row_by_row(fast: LlamaModel) -> None:
    # decode rows in three buckets (contexts 5, 40, 70, 130, 200), a later chunk, two whole prompts
    step_against_dense(fast, [(4, 1), (39, 1), (69, 1), (129, 1), (199, 1), (33, 20), (0, 45), (0, 3)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 150), st.integers(1, 40)), min_size=1, max_size=6))
def test_any_step_matches_the_reference(fast: LlamaModel, sequences: list[tuple[int, int]]) -> None:
    step_against_dense(fast, sequences)


def test_the_plan_puts_every_row_in_exactly_one_place() -> None:
    seqs = [
        Seq((1,), 4, (0,)),  # decode, context 5
        Seq((1,), 200, tuple(range(1, 14))),  # decode, context 201
        Seq((1,), 63, (14, 15, 16, 17)),  # decode, context 64: the first bucket still
        Seq((1, 2, 3), 0, (20,)),  # a whole prompt
        Seq((1, 2), 30, (21, 22)),  # a later chunk
    ]
    plan = build_exact_plan(ForwardBatch.build(seqs, BLOCK, "cpu").layout)
    assert plan.prompts == ((3, 6),)
    assert [(c.start, c.end) for c in plan.chunks] == [(6, 8)]
    assert plan.chunks[0].blocks.tolist() == [[21, 22]]
    # the chunk's rows see the 30 cached tokens and, causally, each other
    assert plan.chunks[0].mask[0, 0].sum(-1).tolist() == [31, 32]
    assert [b.rows.tolist() for b in plan.decodes] == [[0, 2], [1]]
    small, large = plan.decodes
    assert small.blocks.shape == (2, 4) and large.blocks.shape == (1, 13)
    assert small.mask[:, 0, 0].sum(-1).tolist() == [5, DECODE_BUCKET_MIN_KEYS]
    rows = [r for start, end in plan.prompts for r in range(start, end)]
    rows += [r for c in plan.chunks for r in range(c.start, c.end)]
    rows += [r for b in plan.decodes for r in b.rows.tolist()]
    assert sorted(rows) == list(range(8))


@needs_onednn
def test_packed_linear_equals_blas_up_to_rounding() -> None:
    linear = PackedLinear()
    weight = torch.randn(96, 64)
    for rows in (0, 1, 7, 300):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=0, atol=2e-5)
    # a non-contiguous input (a split of a fused output) and bfloat16
    wide = torch.randn(5, 128)
    torch.testing.assert_close(linear(wide[:, :64], weight), F.linear(wide[:, :64], weight), rtol=0, atol=2e-5)
    x16, w16 = torch.randn(4, 64, dtype=torch.bfloat16), weight.bfloat16()
    torch.testing.assert_close(linear(x16, w16), F.linear(x16, w16), rtol=1e-2, atol=1e-2)


@needs_onednn
def test_a_changed_weight_is_packed_again() -> None:
    linear = PackedLinear()
    weight = torch.randn(8, 4)
    x = torch.randn(3, 4)
    first = linear.packed(weight)
    assert linear.packed(weight) is first
    with torch.no_grad():
        weight.mul_(2)  # in place: the version counter moves
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=0, atol=1e-5)
    assert linear.packed(weight) is not first
    model = LlamaModel.random(PRESETS["tiny"], seed=1, batch_invariant=False)
    layer = model.layers[0]
    x = torch.randn(2, model.config.hidden_size)
    before = model._linear(x, layer.o_weight)
    model.to(torch.float64).to(torch.float32)  # moved by Module.to: new storage, same values
    torch.testing.assert_close(model._linear(x, layer.o_weight), before, rtol=0, atol=0)


def test_other_dtypes_and_devices_fall_back_to_blas() -> None:
    linear = PackedLinear()
    x, weight = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert not linear._packed


def test_the_cpu_gemm_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_cpu_gemm({}) == "onednn"
    assert resolve_cpu_gemm({CPU_GEMM_ENV: " BLAS "}) == "blas"
    with pytest.raises(ValueError, match=CPU_GEMM_ENV):
        resolve_cpu_gemm({CPU_GEMM_ENV: "mkl"})
    monkeypatch.setenv(CPU_GEMM_ENV, "blas")
    model = LlamaModel.random(PRESETS["tiny"], seed=1, batch_invariant=False)
    assert model.fast_linear is F.linear
    x = torch.randn(3, model.config.hidden_size)
    weight = model.layers[0].o_weight
    assert torch.equal(model._linear(x, weight), F.linear(x, weight))


@needs_onednn
def test_weights_are_packed_at_load_time_not_in_the_first_step() -> None:
    fast = LlamaModel.random(PRESETS["tiny"], seed=1, batch_invariant=False)
    assert isinstance(fast.fast_linear, PackedLinear)
    # every layer's four weights and the LM head (the tied embedding)
    assert len(fast.fast_linear._packed) == 4 * fast.config.num_layers + 1
    invariant = LlamaModel.random(PRESETS["tiny"], seed=1, batch_invariant=True)
    assert isinstance(invariant.fast_linear, PackedLinear) and not invariant.fast_linear._packed
