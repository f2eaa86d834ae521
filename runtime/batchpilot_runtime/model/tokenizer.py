"""Tokenizers: bytes by default, a local Hugging Face ``tokenizer.json``, or one built from a GGUF
file's metadata (gguf_tokenizer.py).

All expose the same small surface (``encode``, ``decode``, ``bos_token_id``, ``eos_token_id``,
``stop_token_ids``, ``vocab_size``, ``chat_template``) plus ``IncrementalDecoder`` for streaming
text that never splits a UTF-8 character across two chunks.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFBackend

BYTE_VOCAB = 256


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...
    @property
    def chat_template(self) -> str | None: ...
    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then BOS=256, EOS=257, PAD=258 (vocab_size 259).

    Ids a model may emit beyond the tokenizer's vocabulary decode to nothing.
    """

    bos_token_id = BYTE_VOCAB
    eos_token_id = BYTE_VOCAB + 1
    pad_token_id = BYTE_VOCAB + 2
    vocab_size = BYTE_VOCAB + 3
    stop_token_ids: tuple[int, ...] = (BYTE_VOCAB + 1,)
    chat_template: str | None = None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < BYTE_VOCAB).decode("utf-8", errors="replace")


_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|eot_id|>", "<eos>", "<|endoftext|>", "<|im_end|>")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the ids and the chat template its checkpoint names.

    ``stop_token_ids`` are the tokens that end a reply: EOS first, then any other end-of-turn or
    end-of-text tokens the checkpoint declares (a chat model may emit either). ``chat_template`` is
    the checkpoint's Jinja template for chat messages, or None when it has none.
    """

    def __init__(
        self,
        backend: HFBackend,
        bos_token_id: int | None,
        eos_token_id: int | None,
        stop_token_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
    ) -> None:
        self._tokenizer = backend
        self._bos = bos_token_id
        self._eos = eos_token_id
        head = () if eos_token_id is None else (eos_token_id,)
        self.stop_token_ids: tuple[int, ...] = head + tuple(t for t in dict.fromkeys(stop_token_ids) if t not in head)
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    def token_to_id(self, token: str) -> int | None:
        token_id = self._tokenizer.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Special tokens written in ``text`` (as a chat template writes them) become their ids."""
        ids = [int(t) for t in self._tokenizer.encode(text, add_special_tokens=False).ids]
        return [self._bos, *ids] if add_bos and self._bos is not None else ids

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))


class JsonTokenizer(HFTokenizer):
    """A Hugging Face ``tokenizer.json`` read with the ``tokenizers`` package (never downloaded).

    BOS/EOS and the chat template come from a ``tokenizer_config.json`` beside it when present,
    else BOS/EOS from the usual special-token names; either may be None when the file defines neither.
    """

    def __init__(self, path: Path | str) -> None:
        from tokenizers import Tokenizer as HFBackendTokenizer

        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"tokenizer: {self.path} is not a file")
        backend = HFBackendTokenizer.from_file(str(self.path))
        config = _read_tokenizer_config(self.path.parent / "tokenizer_config.json")
        template = config.get("chat_template")
        super().__init__(
            backend,
            _special_id(backend, config.get("bos_token"), _BOS_NAMES),
            _special_id(backend, config.get("eos_token"), _EOS_NAMES),
            chat_template=template if isinstance(template, str) else None,
        )


def _special_id(backend: HFBackend, configured: object, fallbacks: tuple[str, ...]) -> int | None:
    if isinstance(configured, dict):
        configured = configured.get("content")
    names = (configured, *fallbacks) if isinstance(configured, str) else fallbacks
    for name in names:
        token_id = backend.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    return None


def _read_tokenizer_config(path: Path) -> dict[str, object]:
    if not path.is_file():
        return {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"tokenizer_config: cannot read {path}: {error}") from error
    return loaded if isinstance(loaded, dict) else {}


class IncrementalDecoder:
    """Turns a stream of token ids into text chunks without splitting a character.

    For bytes, a UTF-8 incremental decoder; for other tokenizers, decode the whole
    sequence and emit what was added, holding back a trailing replacement character
    (an incomplete multi-byte sequence that the next token may finish).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, token_id: int) -> str:
        if isinstance(self._tokenizer, ByteTokenizer):
            if 0 <= token_id < BYTE_VOCAB:
                return str(self._bytes.decode(bytes([token_id])))
            return ""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        chunk = text[len(self._emitted) :] if text.startswith(self._emitted) else text
        self._emitted = text
        return chunk

    def flush(self) -> str:
        if isinstance(self._tokenizer, ByteTokenizer):
            return str(self._bytes.decode(b"", final=True))
        text = self._tokenizer.decode(self._ids)
        chunk = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
        self._emitted = text
        return chunk


def load_tokenizer(checkpoint_dir: Path | str | None) -> Tokenizer:
    """The checkpoint's ``tokenizer.json`` when it has one, else bytes."""
    if checkpoint_dir is None:
        return ByteTokenizer()
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise ValueError(f"checkpoint: {directory} is not a directory")
    candidate = directory / "tokenizer.json"
    return JsonTokenizer(candidate) if candidate.is_file() else ByteTokenizer()
