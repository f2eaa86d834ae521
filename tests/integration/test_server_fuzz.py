"""Fuzzed and malformed completion and chat completion requests: never a 5xx, every 4xx names what
is wrong, and the server stays ready afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from batchpilot_runtime.contract.admin_api import LANE_HEADER
from tests.support.server_fuzzing import (  # noqa: F401  (the runtime and serve fixtures)
    FUZZ_SETTINGS,
    check_named_refusal,
    runtime_fixture,
    serve_fixture,
)
from tests.support.server_fuzzing import json_values as arbitrary_json

FIELDS = (
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "echo",
    "logprobs",
    "best_of",
    "lane",
    "ignore_eos",
    "user",
)


json_values = arbitrary_json(text_size=30, key_size=10, collection_size=5, max_leaves=15)
# Values near each field's domain, so that most bodies get past the first check and probe the next.
field_values: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny-test", "", "other"]) | json_values,
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 400), max_size=40) | json_values,
    "max_tokens": st.integers(-3, 12) | st.integers(500, 2**64) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5) | json_values,
    "seed": st.integers(-10, 2**64) | json_values,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=6) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}) | json_values,
    "n": st.integers(-1, 3) | json_values,
    "echo": st.booleans() | json_values,
    "logprobs": st.none() | st.integers(0, 5),
    "best_of": st.integers(-1, 3) | json_values,
    "lane": st.sampled_from(["default", "critical", ""]) | json_values,
    "ignore_eos": st.booleans() | json_values,
    "user": json_values,
}
# Values inside each field's domain: bodies that should be served, with every option combined.
valid_values: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just("tiny-test"),
    "max_tokens": st.integers(1, 12),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "lane": st.just("default"),
    "ignore_eos": st.booleans(),
}
valid_bodies = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 319), min_size=1, max_size=40)},
    optional=valid_values,
).map(lambda d: json.dumps(d).encode())
bodies = st.one_of(
    valid_bodies,
    st.fixed_dictionaries({}, optional=field_values).map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries(
        {"prompt": st.text(min_size=1, max_size=20)}, optional={k: v for k, v in field_values.items() if k != "prompt"}
    ).map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"",
            b"{",
            b"[1,2",
            b'{"prompt": "x",}',
            b"\xff\xfe",
            b'{"prompt": NaN}',
            b'{"prompt": "x", "max_tokens": 1e400}',
            b"[" * 5000 + b"]" * 5000,
            b'{"prompt": "\\ud800"}',
        ]
    ),
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "content-type": st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
        LANE_HEADER: st.sampled_from(["default", "critical", "x" * 100, ""]),
        "X-Request-Id": st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=200),
    },
)


def _read(response: httpx.Response) -> bytes:
    return response.read()


def _check_result_or_named_error(response: httpx.Response, payload: bytes) -> None:
    assert response.status_code < 500, payload[:500]
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert payload.rstrip().endswith(b"data: [DONE]")
            assert b'"error"' not in payload
        else:
            assert json.loads(payload)["choices"][0]["finish_reason"] in ("length", "stop")
    else:
        check_named_refusal(payload)


@pytest.mark.slow
@settings(FUZZ_SETTINGS, max_examples=150)
@given(body=bodies, extra_headers=headers)
def test_fuzzed_bodies_never_5xx(serve: httpx.Client, body: bytes, extra_headers: dict[str, str]) -> None:
    with serve.stream("POST", "/v1/completions", content=body, headers=extra_headers) as response:
        payload = _read(response)
    event(f"status {response.status_code}")
    _check_result_or_named_error(response, payload)


# Chat messages near their domain: the roles and part types it refuses, members it does not know.
chat_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | json_values,
            "content": st.text(max_size=30)
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "text", "image_url"]), "text": st.text(max_size=10)}
                ),
                max_size=3,
            )
            | json_values,
        },
        optional={"name": st.text(max_size=5) | json_values, "tool_calls": json_values},
    ),
    max_size=4,
)
valid_chat_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant"]),
            "content": st.text(max_size=30)
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=3),
        }
    ),
    min_size=1,
    max_size=4,
)
chat_field_values: dict[str, st.SearchStrategy[Any]] = {
    **{k: v for k, v in field_values.items() if k not in ("prompt", "echo", "best_of", "logprobs")},
    "messages": chat_messages | json_values,
    "max_completion_tokens": field_values["max_tokens"],
    "presence_penalty": st.sampled_from([0, 0.0, 0.5, False]) | json_values,
    "logprobs": st.booleans() | json_values,
    "tools": st.sampled_from([[], None]) | json_values,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | json_values,
}
valid_chat_bodies = st.fixed_dictionaries(
    {"messages": valid_chat_messages, "max_completion_tokens": st.integers(1, 12)},
    optional={
        **{k: v for k, v in valid_values.items() if k != "max_tokens"},
        "presence_penalty": st.just(0),
        "logprobs": st.just(False),
    },
).map(lambda d: json.dumps(d).encode())
chat_bodies = st.one_of(
    valid_chat_bodies,
    st.fixed_dictionaries({}, optional=chat_field_values).map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries(
        {"messages": valid_chat_messages, "max_tokens": st.integers(1, 12)},
        optional={k: v for k, v in chat_field_values.items() if k not in ("messages", "max_tokens")},
    ).map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
)


@pytest.mark.slow
@settings(FUZZ_SETTINGS, max_examples=150)
@given(body=chat_bodies, extra_headers=headers)
def test_fuzzed_chat_bodies_never_5xx(serve: httpx.Client, body: bytes, extra_headers: dict[str, str]) -> None:
    with serve.stream("POST", "/v1/chat/completions", content=body, headers=extra_headers) as response:
        payload = _read(response)
    event(f"status {response.status_code}")
    _check_result_or_named_error(response, payload)


def test_server_is_still_ready_after_fuzzing(serve: httpx.Client) -> None:
    # Runs after the fuzz test in file order; on its own it checks a fresh server, which must also hold.
    assert serve.get("/readyz").json() == {"ready": True}
    response = serve.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 4})
    assert response.status_code == 200
    chat = serve.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_wrong_method_or_path_is_4xx(serve: httpx.Client, method: str) -> None:
    assert 400 <= serve.request(method, "/v1/completions").status_code < 500
    assert 400 <= serve.request(method, "/v1/chat/completions").status_code < 500
    assert serve.request(method, "/v1/nothing-here").status_code == 404
