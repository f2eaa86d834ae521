"""Chat templates: the ChatML default, a model's own template (SmolLM2's, which adds a system
message when the conversation has none), the same text as transformers renders, the sandbox, and
special tokens as ids."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from batchpilot_runtime.model.tokenizer import ByteTokenizer
from batchpilot_runtime.server.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError

# SmolLM2-135M-Instruct's template, as its GGUF file carries it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 2's form: BOS and EOS written by the template, alternation enforced with raise_exception.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set system = false %}"
    "{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system %}{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
# Whitespace control and tojson, as tool-era templates use them.
TOJSON_TEMPLATE = """{% for message in messages %}
    {{ message['role'] }}: {{ message['content'] | tojson }}
{% endfor %}
{% if add_generation_prompt %}assistant:{% endif %}"""

USER_ONLY = [{"role": "user", "content": "Hi"}]
WITH_SYSTEM = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3? <b>é</b>"},
]


def test_default_is_chatml_with_the_generation_prompt() -> None:
    template = ChatTemplate(None)
    assert template.is_default
    assert template.source == CHATML_TEMPLATE
    assert template.render(WITH_SYSTEM[:2]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.end_of_turn_markers == ("<|im_end|>",)


def test_smollm2_template_adds_its_system_message_only_when_none_is_given() -> None:
    template = ChatTemplate(SMOLLM2_TEMPLATE)
    assert not template.is_default
    assert template.render(USER_ONLY) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    given = template.render(WITH_SYSTEM[:2])
    assert given.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "SmolLM" not in given


@pytest.mark.parametrize("source", [CHATML_TEMPLATE, SMOLLM2_TEMPLATE, LLAMA2_TEMPLATE, TOJSON_TEMPLATE])
@pytest.mark.parametrize("messages", [USER_ONLY, WITH_SYSTEM], ids=["user-only", "with-system"])
def test_renders_what_transformers_renders(source: str, messages: list[dict[str, str]]) -> None:
    ours = ChatTemplate(source).render(messages, bos_token="<s>", eos_token="</s>")
    (theirs,), _ = render_jinja_template(
        conversations=[messages], chat_template=source, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
    )
    assert ours == theirs


def test_a_template_refusing_the_messages_says_why() -> None:
    template = ChatTemplate(LLAMA2_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # reaching Python's internals
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages | length }}",  # mutating
        "{{ messages[0].no_such_member.deeper }}",  # a missing member used
    ],
    ids=["internals", "mutation", "undefined"],
)
def test_sandbox_refuses_what_a_template_must_not_do(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(USER_ONLY)


def test_a_template_that_does_not_compile_is_a_value_error_naming_the_line() -> None:
    with pytest.raises(ValueError, match="line 2"):
        ChatTemplate("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")


@dataclass(frozen=True)
class Codec:
    """Bytes, with BOS and EOS ids of its own, as a fake tokenizer."""

    bos_token_id: int | None = 900
    eos_token_id: int | None = 901

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def test_template_special_tokens_become_the_tokenizer_ids() -> None:
    template = ChatTemplate(LLAMA2_TEMPLATE)
    ids = template.prompt_token_ids(WITH_SYSTEM, Codec())
    assert ids[0] == 900
    assert ids.count(900) == 2  # one per user turn
    assert ids.count(901) == 1  # after the assistant's turn
    text = bytes(i for i in ids if i < 256).decode()
    assert text == template.render(WITH_SYSTEM)
    without = template.prompt_token_ids(WITH_SYSTEM, Codec(bos_token_id=None, eos_token_id=None))
    assert without == [i for i in ids if i < 256]


def test_chatml_prompt_ids_are_the_rendered_text_encoded() -> None:
    tokenizer = ByteTokenizer()
    template = ChatTemplate(None)
    assert template.prompt_token_ids(WITH_SYSTEM, tokenizer) == tokenizer.encode(template.render(WITH_SYSTEM))
