"""Greedy, temperature and top-p sampling with per-request seeded generators."""

from __future__ import annotations

import pytest
import torch

from batchpilot_runtime.model.sampling import SamplingParams, make_generator, sample, top_p_filter


def make_logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def draw(logits: torch.Tensor, params: SamplingParams, steps: int) -> list[int]:
    generator = make_generator(params)
    return [sample(logits, [params], [generator])[0] for _ in range(steps)]


def test_greedy_is_argmax_with_ties_to_the_lowest_id() -> None:
    logits = make_logits(4)
    logits[3] = 0.0
    logits[3, [7, 9]] = 5.0
    greedy = SamplingParams()
    assert sample(logits, [greedy] * 4, [None] * 4) == [*logits[:3].argmax(-1).tolist(), 7]
    assert make_generator(greedy) is None


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    logits = make_logits(1)
    first = draw(logits, SamplingParams(temperature=1.0, seed=42), 40)
    assert first == draw(logits, SamplingParams(temperature=1.0, seed=42), 40)
    assert first != draw(logits, SamplingParams(temperature=1.0, seed=43), 40)


def test_a_row_does_not_depend_on_its_neighbours() -> None:
    logits = make_logits(3)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in (1, 2, 3)]
    batched_gens = [make_generator(p) for p in params]
    alone_gen = make_generator(params[1])
    for _ in range(20):
        together = sample(logits, params, batched_gens)
        alone = sample(logits[1:2], [params[1]], [alone_gen])
        assert together[1] == alone[0]


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-12])
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(top_p: float) -> None:
    # 5e-324 rounds to 0 in float32: the nucleus was empty, and sampling raised on NaN probabilities.
    probs = torch.tensor([0.1, 0.6, 0.3])
    assert torch.equal(top_p_filter(probs, top_p), torch.tensor([0.0, 1.0, 0.0]))


def test_top_p_keeps_only_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert top_p_filter(probs, 0.7).tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert top_p_filter(probs, 0.2).tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])
    logits = torch.log(probs).unsqueeze(0)
    seen = set(draw(logits, SamplingParams(temperature=1.0, top_p=0.7, seed=0), 200))
    assert seen == {0, 1}


def test_temperature_sharpens_towards_argmax() -> None:
    logits = make_logits(1, vocab=10, seed=3)
    cold = draw(logits, SamplingParams(temperature=0.01, seed=1), 50)
    assert set(cold) == {int(logits.argmax())}
    hot = draw(logits, SamplingParams(temperature=5.0, seed=1), 200)
    assert len(set(hot)) > 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"seed": -3}, "seed")],
)
def test_invalid_parameters_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_row_counts_must_match() -> None:
    with pytest.raises(ValueError, match="params"):
        sample(make_logits(2), [SamplingParams()], [None, None])


@pytest.mark.parametrize("temperature", [1e-300, 2.0128607718558824e-286, 1e-30])
def test_tiny_temperature_behaves_like_greedy_not_nan(temperature: float) -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    params = [SamplingParams(temperature=temperature, top_p=1.0, seed=7)]
    assert sample(logits, params, [make_generator(params[0])]) == [1]
