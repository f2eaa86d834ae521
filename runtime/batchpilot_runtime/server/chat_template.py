"""Chat messages to a prompt: the model's own Jinja chat template, rendered in a sandbox.

Pure: no I/O, no engine, no web framework. A template comes with the checkpoint (Hugging Face's
``tokenizer_config.json``, a GGUF file's ``tokenizer.chat_template``) and is untrusted code, so it
is rendered as transformers' ``apply_chat_template`` renders it: an immutable sandboxed Jinja2
environment with ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception`` (which a
template calls to refuse a conversation, e.g. roles that do not alternate), ``strftime_now`` and
a ``tojson`` that does not escape HTML; the template sees ``messages``,
``add_generation_prompt=True``, ``bos_token``, ``eos_token`` and ``tools=None``.

A model without a template (the random-weight presets, a base model) gets ``CHATML_TEMPLATE``,
the ChatML format (``<|im_start|>role\\n...<|im_end|>\\n``) that many instruct models, SmolLM2
among them, use.

Special tokens the template writes (``bos_token``, ``eos_token``) become their ids whatever the
tokenizer knows of their text: the template is rendered with private placeholders in their place,
and the pieces between them are encoded on their own. Special tokens written literally in the
template (``<|im_start|>``) are left to the tokenizer, which maps the ones it defines to their ids.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn, Protocol

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Markers that end an assistant turn in the common templates (ChatML, Llama 3, Gemma, Phi-3, GPT-2
# style); the ones a template writes end a reply as the end-of-sequence token does.
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


class ChatTemplateError(ValueError):
    """The template refused the messages (``raise_exception``, a missing member, a sandbox guard)."""


class SpecialTokenCodec(Protocol):
    """The part of a tokenizer that turns a rendered prompt into ids."""

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


class ChatTemplate:
    """A compiled chat template. ``ValueError`` when ``source`` is not valid Jinja."""

    def __init__(self, source: str | None) -> None:
        self.source = CHATML_TEMPLATE if source is None else source
        self.is_default = source is None
        try:
            self._template = _compile(self.source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"chat template: does not compile (line {error.lineno}: {error.message})") from None
        # The markers this template writes, in the order of END_OF_TURN_MARKERS.
        self.end_of_turn_markers = tuple(m for m in END_OF_TURN_MARKERS if m in self.source)

    def render(self, messages: Sequence[Mapping[str, str]], *, bos_token: str = "", eos_token: str = "") -> str:
        """The prompt text that asks for the assistant's next turn; ``ChatTemplateError`` when the
        template refuses the messages."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=True,
                bos_token=bos_token,
                eos_token=eos_token,
                tools=None,
                documents=None,
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(str(error) or type(error).__name__) from None

    def prompt_token_ids(self, messages: Sequence[Mapping[str, str]], codec: SpecialTokenCodec) -> list[int]:
        """The rendered prompt as token ids, ``bos_token``/``eos_token`` as the codec's ids (or
        nothing where the codec has none). Nothing is added in front: a template that wants BOS
        writes ``bos_token``, as transformers' ``apply_chat_template`` expects."""
        nonce = secrets.token_hex(8)
        bos, eos = f"\x00bos-{nonce}\x00", f"\x00eos-{nonce}\x00"
        text = self.render(messages, bos_token=bos, eos_token=eos)
        ids: list[int] = []
        for index, around_eos in enumerate(text.split(eos)):
            if index and codec.eos_token_id is not None:
                ids.append(codec.eos_token_id)
            for inner, piece in enumerate(around_eos.split(bos)):
                if inner and codec.bos_token_id is not None:
                    ids.append(codec.bos_token_id)
                if piece:
                    ids.extend(codec.encode(piece))
        return ids
