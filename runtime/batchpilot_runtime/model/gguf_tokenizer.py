"""The tokenizer a GGUF file describes in its metadata, built with the ``tokenizers`` package.

Only GPT-2-style byte-level BPE (``tokenizer.ggml.model`` "gpt2") is supported: the vocabulary and
merges come from the file; the split before BPE from ``tokenizer.ggml.pre``, as llama.cpp reads it
(only the splits listed in ``PRE_TOKENIZERS``; any other is refused rather than guessed).
Tokens the file marks as control (``<|im_start|>``) become special added tokens and user-defined
ones (``<think>``) plain added tokens, so that both are matched whole in text, as transformers'
GGUF loader and llama.cpp do. The chat template is ``tokenizer.chat_template``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from batchpilot_runtime.model.gguf_checkpoint import metadata_value
from batchpilot_runtime.model.tokenizer import HFTokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader
    from tokenizers.pre_tokenizers import PreTokenizer

# llama.cpp's token types (tokenizer.ggml.token_type)
CONTROL = 3
USER_DEFINED = 4

_DIGIT = r"\p{N}"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex split before the byte-level step; "" is GPT-2's own split alone,
# _DIGIT isolates every digit before it (llama.cpp's smollm/starcoder family), and _LLAMA3 replaces it.
PRE_TOKENIZERS = {
    "default": "",
    "gpt2": "",
    "smollm": _DIGIT,
    "starcoder": _DIGIT,
    "refact": _DIGIT,
    "codeshell": _DIGIT,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
}
# Control tokens that end a turn or a text in the common chat formats (llama.cpp's end-of-generation set).
_END_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>")


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, in which byte-level vocabularies are written."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + shift)
            shift += 1
    return spelling


def _pre_tokenizer(pre: str, path: Path) -> PreTokenizer:
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"checkpoint {path}: tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    split = PRE_TOKENIZERS[pre]
    if not split:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            # after a full split (llama3) the byte-level step must not split again; after the digit split it must
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split == _DIGIT),
        ]
    )


def _string_list(reader: GGUFReader, key: str, path: Path) -> list[str]:
    value = metadata_value(reader, key)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"checkpoint {path}: metadata {key} must be a list of strings")
    return value


def _token_id(reader: GGUFReader, key: str, vocab_size: int, path: Path) -> int | None:
    value = metadata_value(reader, f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"checkpoint {path}: tokenizer.ggml.{key} {value!r} is not a token id below {vocab_size}")
    return value


def tokenizer_from_gguf(reader: GGUFReader, path: Path) -> HFTokenizer:
    """The file's tokenizer; ValueError naming the metadata key that is missing or unsupported."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = metadata_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"checkpoint {path}: tokenizer.ggml.model {kind!r} is not supported; only 'gpt2' (byte-level BPE)"
        )
    tokens = _string_list(reader, "tokenizer.ggml.tokens", path)
    merges = [tuple(merge.split(" ")) for merge in _string_list(reader, "tokenizer.ggml.merges", path)]
    if any(len(merge) != 2 for merge in merges):
        raise ValueError(f"checkpoint {path}: tokenizer.ggml.merges has an entry that is not two tokens")
    types = metadata_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(
            f"checkpoint {path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    alphabet = set(byte_alphabet().values())
    # a token written outside the byte alphabet (a literal space, say) is spelled byte by byte, as transformers does
    vocab = {
        token if set(token) <= alphabet else "".join(byte_alphabet()[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b in merges], ignore_merges=False))
    backend.pre_tokenizer = _pre_tokenizer(str(metadata_value(reader, "tokenizer.ggml.pre") or "default"), path)
    backend.decoder = decoders.ByteLevel()
    # a control token spelled outside the byte alphabet is a mislabel that no text can produce
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL and set(t) <= alphabet]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user_defined = [t for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    ends = [
        _token_id(reader, "eot_token_id", len(tokens), path),
        _token_id(reader, "eom_token_id", len(tokens), path),
        *(vocab[name] for name in _END_NAMES if name in control),
    ]
    template = metadata_value(reader, "tokenizer.chat_template")
    return HFTokenizer(
        backend,
        bos_token_id=_token_id(reader, "bos_token_id", len(tokens), path),
        eos_token_id=_token_id(reader, "eos_token_id", len(tokens), path),
        stop_token_ids=tuple(t for t in ends if t is not None),
        chat_template=template if isinstance(template, str) else None,
    )
