"""The shape of a Llama decoder: its config, the named presets, and the Hugging Face config.json mapping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# Standard deviation of random weights (LlamaModel.random), also written as config.json's initializer_range.
INIT_STD = 0.02


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama decoder. ``head_dim`` 0 means hidden_size // num_heads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads} (grouped-query attention)"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim: must be an even integer >= 2 for rotary embeddings, got {self.head_dim}")
        if self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings: must be >= 1, got {self.max_position_embeddings}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps}")

    @property
    def num_parameters(self) -> int:
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attention + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in the shape transformers' LlamaConfig reads (old and new rope keys both written)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": INIT_STD,
            "bos_token_id": 256,
            "eos_token_id": 257,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> LlamaConfig:
        model_type = raw.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"config.json model_type: only 'llama' is supported, got {model_type!r}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act: only 'silu' is supported, got {raw.get('hidden_act')!r}")
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag, False):
                raise ValueError(f"config.json {flag}: biases are not supported")
        rope_parameters = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or {}
        for source, rope in (("rope_parameters", rope_parameters), ("rope_scaling", rope_scaling)):
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"config.json {source}: only the default rope is supported, got {rope_type!r}")
        rope_theta = raw.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        try:
            num_heads = int(raw["num_attention_heads"])
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                rope_theta=float(rope_theta),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                head_dim=int(raw.get("head_dim") or 0),
            )
        except KeyError as error:
            raise ValueError(f"config.json: missing field {error.args[0]!r}") from error


PRESETS: dict[str, LlamaConfig] = {
    # ~0.23 M parameters: fast enough for token-exactness tests with dozens of requests.
    "tiny": LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=176, num_layers=4, num_heads=4, num_kv_heads=2
    ),
    # ~24 M parameters: the CPU benchmark model.
    "small": LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=4
    ),
    # ~76 M parameters: for GPU checks, where small is too light to load the device.
    "medium": LlamaConfig(
        vocab_size=512, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=4
    ),
}


def config_from_name(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"preset: {name!r} is not one of {sorted(PRESETS)}")
    return PRESETS[name]


def describe(config: LlamaConfig) -> dict[str, Any]:
    """Plain-dict view of a config, for benchmark JSON."""
    out = {f.name: getattr(config, f.name) for f in fields(config)}
    out["num_parameters"] = config.num_parameters
    return out
