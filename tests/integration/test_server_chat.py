"""``/v1/chat/completions`` as OpenAI clients see it, on the random-weight tiny preset (bytes, no
chat template, so ChatML): the official client whole and streamed, stop strings, token limits,
lanes, and refusals that name the field; plus how a request's stops are chosen."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, cast

import httpx
import openai
import pytest

from batchpilot_runtime.contract.admin_api import LANE_HEADER, LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.model.tokenizer import ByteTokenizer
from batchpilot_runtime.server.chat import _prepare, parse_chat_request
from batchpilot_runtime.server.chat_template import ChatTemplate
from batchpilot_runtime.server.context import LoadedModel
from tests.integration.runtime_process import ThreadRuntime, parse_sse, runtime_thread

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a colour."},
]
# Random weights end a reply at EOS by chance; ignore_eos makes every length exact.
FIXED_LENGTH = {"ignore_eos": True}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    critical = LaneWindow(
        name="critical", window=Window(target_batch_size=1, hard_cap=2, max_wait_ms=0), reserved_slots=1
    )
    with runtime_thread(tmp_path_factory.mktemp("chat"), lanes=(critical,), max_model_len=512) as started:
        yield started


@pytest.fixture(scope="module")
def api(runtime: ThreadRuntime) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{runtime.serve_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def client(runtime: ThreadRuntime) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime.serve_url, timeout=60.0) as http:
        yield http


def _chatml_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    return len(ByteTokenizer().encode(ChatTemplate(None).render(messages)))


def test_official_client_gets_a_chat_completion(api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(
        model="tiny-test", messages=MESSAGES, max_completion_tokens=7, temperature=0, extra_body=FIXED_LENGTH
    )
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.model == "tiny-test"
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == _chatml_prompt_tokens(MESSAGES)
    assert reply.usage.completion_tokens == 7
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 7


def test_official_client_streams_role_deltas_finish_and_usage(api: openai.OpenAI) -> None:
    request: dict[str, Any] = {"model": "tiny-test", "messages": MESSAGES, "temperature": 0, "max_tokens": 9}
    whole = api.chat.completions.create(**request, extra_body=FIXED_LENGTH)
    chunks = list(
        api.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}, extra_body=FIXED_LENGTH
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in with_choices[1:])
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * 8 + ["length"]  # one chunk per token
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == _chatml_prompt_tokens(MESSAGES)


def test_stream_ends_with_done(client: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_completion_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = parse_sse(list(response.iter_lines()))
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_text_parts_are_joined_as_one_message(api: openai.OpenAI) -> None:
    parts: list[Any] = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]
    as_parts = [MESSAGES[0], {"role": "user", "content": parts}]
    joined = [MESSAGES[0], {"role": "user", "content": "Name a\ncolour."}]
    replies = [
        api.chat.completions.create(model="tiny-test", messages=m, max_tokens=6, temperature=0, extra_body=FIXED_LENGTH)
        for m in (as_parts, joined)
    ]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].usage == replies[1].usage


def test_stop_string_ends_the_reply_and_is_not_returned(api: openai.OpenAI, client: httpx.Client) -> None:
    request: dict[str, Any] = {"model": "tiny-test", "messages": MESSAGES, "temperature": 0, "max_tokens": 40}
    full = api.chat.completions.create(**request, extra_body=FIXED_LENGTH).choices[0].message.content or ""
    # A stop string taken from the greedy reply itself, so the model is certain to produce it.
    clean = [i for i, ch in enumerate(full) if ch != "\ufffd" and i > 0]
    assert clean, f"greedy reply has no plain character to stop on: {full!r}"
    stop = full[clean[len(clean) // 2]]
    expected = full[: full.index(stop)]
    stopped = api.chat.completions.create(**request, stop=[stop, "never-in-output-xyz"], extra_body=FIXED_LENGTH)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == expected
    body = {**request, "stop": stop, "stream": True, **FIXED_LENGTH}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        payloads = parse_sse(list(response.iter_lines()))
    chunks = [p for p in payloads if isinstance(p, dict) and p.get("choices")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "limit", [{"max_tokens": 4}, {"max_completion_tokens": 4}, {"max_tokens": 4, "max_completion_tokens": 4}]
)
def test_either_token_limit_name_is_honoured(client: httpx.Client, limit: dict[str, int]) -> None:
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **limit, **FIXED_LENGTH})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_without_a_limit_the_reply_may_fill_the_context(client: httpx.Client) -> None:
    # The default is the rest of max_model_len (512): a prompt that leaves 3 tokens gets 3.
    filler = "x" * (512 - 3 - _chatml_prompt_tokens([{"role": "user", "content": ""}]))
    response = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": filler}], **FIXED_LENGTH}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_seeded_sampling_is_reproducible(client: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 99, **FIXED_LENGTH}
    first = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == first


def test_lane_by_header_and_body_and_unknown_lane(client: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body, headers={LANE_HEADER: "critical"}).status_code == 200
    assert client.post("/v1/chat/completions", json={**body, "lane": "critical"}).status_code == 200
    refused = client.post("/v1/chat/completions", json={**body, "lane": "platinum"})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "lane"
    assert "platinum" in refused.json()["error"]["message"]


def test_official_client_is_refused_two_choices(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="tiny-test", messages=MESSAGES, n=2, max_tokens=2)
    assert cast(dict[str, Any], refused.value.body)["param"] == "n"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"presence_penalty": False}, "presence_penalty"),
        ({"top_k": 40}, "top_k"),
        ({"store": True}, "store"),
    ],
)
def test_a_field_the_runtime_does_not_implement_is_refused_by_name(
    api: openai.OpenAI, extra: dict[str, Any], field: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="tiny-test", messages=MESSAGES, max_tokens=2, extra_body=extra)
    error = cast(dict[str, Any], refused.value.body)
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: ")
    assert "leave it out" in error["message"]


@pytest.mark.parametrize(
    "neutral",
    [
        {"presence_penalty": 0},
        {"frequency_penalty": 0.0},
        {"logprobs": False},
        {"tools": None},
        {"response_format": {"type": "text"}},
        {"top_k": -1},
    ],
)
def test_a_value_that_asks_for_nothing_is_served(client: httpx.Client, neutral: dict[str, Any]) -> None:
    assert (
        client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **neutral}).status_code == 200
    )


@pytest.mark.parametrize(
    ("body", "message_start"),
    [
        ({}, "messages: field required"),
        ({"messages": []}, "messages: "),
        ({"messages": "hello"}, "messages: "),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role: "),
        ({"messages": [{"role": "developer", "content": "x"}]}, "messages.0.role: "),
        ({"messages": [{"content": "x"}]}, "messages.0.role: "),
        ({"messages": [MESSAGES[1], {"role": "user"}]}, "messages.1.content: "),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content: "),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
            "messages.0.content.0",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text: "),
        ({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls: "),
        ({"messages": [{"role": "user", "content": "\\ud800"}]}, "messages.0.content"),
    ],
)
def test_bad_messages_are_refused_by_name(client: httpx.Client, body: dict[str, Any], message_start: str) -> None:
    raw = httpx.Request("POST", "/", json=body).content.replace(b"\\\\ud800", b"\\ud800")
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert error["message"].startswith(message_start), error["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_completion_tokens": 10**9}, "max_completion_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "some-other-model"}, "model"),
        ({"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
    ],
)
def test_bad_fields_are_named(client: httpx.Client, body: dict[str, Any], field: str) -> None:
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: "), error["message"]


def test_openapi_schema_lists_the_chat_route(client: httpx.Client) -> None:
    schema = client.get("/openapi.json").json()
    operation = schema["paths"]["/v1/chat/completions"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert {"messages", "max_completion_tokens", "max_tokens", "stop", "stream", "seed"} <= set(body["properties"])
    # Unknown fields are ignored (the one rule of both routes), so the schema does not close the object.
    assert "additionalProperties" not in body
    assert "400" in operation["responses"]


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    """One running sequence and two queued: a burst overflows it."""
    with runtime_thread(
        tmp_path_factory.mktemp("chat-narrow"), max_queue=2, target_batch_size=1, hard_cap=1, max_wait_ms=0
    ) as started:
        yield started


async def test_a_full_queue_is_a_429_with_retry_after(narrow: ThreadRuntime) -> None:
    # Each reply takes 64 decode steps, so the burst arrives long before the first one ends.
    body = {"messages": MESSAGES, "max_tokens": 64, "temperature": 0, **FIXED_LENGTH}
    async with httpx.AsyncClient(base_url=narrow.serve_url, timeout=120.0) as http:
        responses = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(8)))
    refused = [r for r in responses if r.status_code == 429]
    assert refused, [r.status_code for r in responses]
    assert {r.status_code for r in responses} == {200, 429}
    for response in refused:
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["type"] == "rate_limit_exceeded"
    for response in responses:
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == 64


# -- which stops a request gets -----------------------------------------------------------------


class MarkerCodec(ByteTokenizer):
    """Bytes, but ``<|im_end|>`` is one special token (id 300) and EOS and 301 end a reply."""

    stop_token_ids = (ByteTokenizer.eos_token_id, 301)
    chat_template: str | None = None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        pieces = text.split("<|im_end|>")
        ids = list(pieces[0].encode())
        for piece in pieces[1:]:
            ids += [300, *piece.encode()]
        return ids


def _prepared(tokenizer: Any, **fields: Any) -> Any:
    loaded = LoadedModel(engine=cast(Any, None), tokenizer=tokenizer, max_model_len=512)
    body = parse_chat_request(httpx.Request("POST", "/", json={"messages": MESSAGES, **fields}).content)
    return _prepare(loaded, body, None)


def test_end_of_turn_marker_stops_as_a_token_when_it_is_one() -> None:
    prepared = _prepared(MarkerCodec(), stop="###")
    assert prepared.request.stop_token_ids == (ByteTokenizer.eos_token_id, 301, 300)
    assert prepared.stop_strings == ("###",)
    assert prepared.request.prompt_token_ids.count(300) == 2  # each message's end, written by the template


def test_end_of_turn_marker_stops_as_text_when_it_is_spelled_in_bytes() -> None:
    tokenizer = ByteTokenizer()
    prepared = _prepared(tokenizer, stop=["###"])
    assert prepared.request.stop_token_ids == tuple(tokenizer.stop_token_ids)
    assert prepared.stop_strings == ("###", "<|im_end|>")


def test_ignore_eos_keeps_only_the_clients_stop_strings() -> None:
    prepared = _prepared(MarkerCodec(), stop="###", ignore_eos=True)
    assert prepared.request.stop_token_ids == ()
    assert prepared.stop_strings == ("###",)
