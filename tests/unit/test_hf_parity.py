"""Our logits against transformers' LlamaForCausalLM with the same weights (fp32, max abs diff <= 1e-4).

Loading through from_pretrained on a directory written by save_safetensors also proves the
checkpoint layout; loading it back proves from_safetensors.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from batchpilot_runtime.model.batch import ForwardBatch
from batchpilot_runtime.model.config import PRESETS, LlamaConfig
from batchpilot_runtime.model.kv_cache import PagedKVCache
from batchpilot_runtime.model.model import LlamaModel
from tests.support.torch_fixtures import Seq, one_thread  # noqa: F401  (autouse fixture)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # importing and instantiating transformers takes several seconds

BLOCK = 16
TOLERANCE = 1e-4
CONFIGS = {
    "tiny-gqa": PRESETS["tiny"],
    "mha-tied": LlamaConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_layers=2,
        num_heads=3,
        num_kv_heads=3,
        rope_theta=500000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def hf_logits(directory: Path, token_ids: list[int]) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_and_paged_decode_match_transformers(tmp_path: Path, name: str) -> None:
    model = LlamaModel.random(CONFIGS[name], seed=11)
    model.save_safetensors(tmp_path)
    rng = random.Random(5)
    prompt = [rng.randrange(259) for _ in range(21)]
    continuation = [rng.randrange(259) for _ in range(12)]
    reference = hf_logits(tmp_path, prompt + continuation)  # [L, V]

    torch.testing.assert_close(model.forward_dense(torch.tensor(prompt)), reference[:21], rtol=0, atol=TOLERANCE)
    kv = PagedKVCache(model.config, 8, BLOCK, "cpu", torch.float32)
    table = (6, 1, 4)
    with torch.no_grad():
        prefill = model(ForwardBatch.build([Seq(tuple(prompt), 0, table)], BLOCK, "cpu"), kv)
        torch.testing.assert_close(prefill[0], reference[20], rtol=0, atol=TOLERANCE)
        for offset, token in enumerate(continuation):
            position = len(prompt) + offset
            step = model(ForwardBatch.build([Seq((token,), position, table)], BLOCK, "cpu"), kv)
            torch.testing.assert_close(step[0], reference[position], rtol=0, atol=TOLERANCE)


def test_checkpoint_round_trip_is_exact(tmp_path: Path) -> None:
    model = LlamaModel.random(PRESETS["tiny"], seed=2)
    model.save_safetensors(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_key_value_heads"] == PRESETS["tiny"].num_kv_heads
    loaded = LlamaModel.from_safetensors(tmp_path)
    assert loaded.config == model.config
    for original, reloaded in zip(model.parameters(), loaded.parameters(), strict=True):
        assert torch.equal(original, reloaded)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = LlamaModel.random(PRESETS["tiny"], seed=4)
    model.save_safetensors(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = LlamaModel.from_safetensors(tmp_path)
    assert torch.equal(loaded.embed, model.embed)
    assert torch.equal(loaded.layers[3].down_weight, model.layers[3].down_weight)


def test_bad_checkpoints_are_refused_with_the_reason(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match=r"config\.json"):
        LlamaModel.from_safetensors(tmp_path)
    LlamaModel.random(PRESETS["tiny"], seed=1).save_safetensors(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LlamaModel.from_safetensors(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaModel.from_safetensors(tmp_path)
