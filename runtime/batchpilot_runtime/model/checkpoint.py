"""Hugging Face Llama checkpoints on disk: config.json plus model.safetensors (or index-listed shards).

Only file I/O and checks live here; which model tensor has which name is LlamaModel's business
(model.hf_state_dict). Loading validates every name and shape before it copies, and names any
missing tensor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from batchpilot_runtime.model.config import LlamaConfig


def read_config(root: Path) -> LlamaConfig:
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ValueError(f"checkpoint: {root} has no config.json")
    return LlamaConfig.from_hf_dict(json.loads(config_path.read_text(encoding="utf-8")))


def shard_paths(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the one model.safetensors."""
    index_path = root / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    raise ValueError(f"checkpoint: {root} has neither model.safetensors nor model.safetensors.index.json")


def load_tensors(shards: list[Path], expected: Mapping[str, torch.Tensor], tie_word_embeddings: bool) -> None:
    """Copy every tensor of ``shards`` into the tensor of the same name in ``expected`` (converted to fp32
    first); raise on an unknown name, a wrong shape or a tensor of ``expected`` that no shard holds."""
    from safetensors.torch import load_file

    seen: set[str] = set()
    with torch.no_grad():
        for shard in shards:
            for name, tensor in load_file(str(shard), device="cpu").items():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and tie_word_embeddings:
                    continue
                if name not in expected:
                    raise ValueError(f"checkpoint: unexpected tensor {name!r}")
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise ValueError(
                        f"checkpoint: {name!r} has shape {tuple(tensor.shape)}, "
                        f"config.json implies {tuple(expected[name].shape)}"
                    )
                expected[name].copy_(tensor.float())
                seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"checkpoint: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def save(root: Path, hf_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """Write config.json and model.safetensors in transformers' Llama layout."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    save_file(contiguous, str(root / "model.safetensors"), metadata={"format": "pt"})
