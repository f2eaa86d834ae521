"""Byte tokenizer, tokenizer.json loading, and streaming decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot_runtime.model.tokenizer import ByteTokenizer, IncrementalDecoder, JsonTokenizer, load_tokenizer


def test_bytes_round_trip_with_specials() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("héllo ✓", add_bos=True)
    assert ids[0] == tokenizer.bos_token_id == 256
    assert tokenizer.eos_token_id == 257
    assert tokenizer.vocab_size == 259
    assert max(ids[1:]) < 256
    assert tokenizer.decode([*ids, tokenizer.eos_token_id, 300]) == "héllo ✓"


def test_streaming_never_splits_a_character() -> None:
    tokenizer = ByteTokenizer()
    decoder = IncrementalDecoder(tokenizer)
    chunks = [decoder.push(t) for t in tokenizer.encode("a✓b")]
    assert chunks == ["a", "", "", "✓", "b"]
    assert decoder.flush() == ""


def write_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4, "again": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_tokenizer_json_is_used_when_the_checkpoint_has_one(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, JsonTokenizer)
    assert tokenizer.encode("hello world", add_bos=True) == [0, 3, 4]
    assert tokenizer.decode([3, 4, 1]) == "hello world"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.vocab_size == 6
    decoder = IncrementalDecoder(tokenizer)
    assert "".join(decoder.push(t) for t in [3, 5]) + decoder.flush() == "hello again"


def test_tokenizer_config_names_the_specials(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<s>"}}))
    assert JsonTokenizer(tmp_path / "tokenizer.json").eos_token_id == 0


def test_bytes_by_default(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    with pytest.raises(ValueError, match="checkpoint"):
        load_tokenizer(tmp_path / "missing")
