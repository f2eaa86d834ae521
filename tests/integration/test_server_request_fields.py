"""One rule for a request's fields on both OpenAI routes (``openai_schema.screen_fields``): a field
the runtime does not know is ignored and logged, as vLLM does; a sampling setting it knows but does
not implement is refused by name on both, unless it asks for nothing. The probe that found two
rules: ``/v1/chat/completions`` refused ``typical_p`` by name while ``/v1/completions`` served it
and sampled as if it had not been sent."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.runtime_process import ThreadRuntime, runtime_thread

ROUTES = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
}
# What the probe sent: llama.cpp's and text-generation servers' samplers and vLLM's prompt truncation.
PROBED = {
    "typical_p": 0.5,
    "mirostat": 2,
    "tfs": 0.9,
    "top_a": 0.1,
    "dry_multiplier": 0.8,
    "xtc_probability": 0.5,
    "truncate_prompt_tokens": 10,
}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    with runtime_thread(tmp_path_factory.mktemp("fields"), max_model_len=256) as started:
        yield started


@pytest.fixture
def client(runtime: ThreadRuntime) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime.serve_url, timeout=60.0) as http:
        yield http


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize(("field", "value"), sorted(PROBED.items()))
def test_an_unimplemented_sampler_is_refused_by_name_on_both_routes(
    client: httpx.Client, route: str, field: str, value: Any
) -> None:
    response = client.post(route, json={**ROUTES[route], field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: not supported by this runtime (leave it out or send ")


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("neutral", [{"typical_p": 1}, {"mirostat": 0}, {"top_a": 0}, {"truncate_prompt_tokens": None}])
def test_a_sampler_set_to_off_is_served_on_both_routes(
    client: httpx.Client, route: str, neutral: dict[str, Any]
) -> None:
    assert client.post(route, json={**ROUTES[route], **neutral}).status_code == 200


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_an_unknown_field_is_ignored_and_logged_on_both_routes(
    client: httpx.Client, route: str, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM's clients send their own extensions; vLLM serves them and says so in its log.
    extensions = {"chat_template_kwargs": {"enable_thinking": False}, "x_trace_id": "abc"}
    with caplog.at_level(logging.INFO, logger="batchpilot.server"):
        response = client.post(route, json={**ROUTES[route], **extensions})
    assert response.status_code == 200, response.text
    logged = [r for r in caplog.records if r.getMessage() == "request fields ignored"]
    assert [(r.__dict__["path"], r.__dict__["ignored_fields"]) for r in logged] == [
        (route, ["chat_template_kwargs", "x_trace_id"])
    ]


def test_a_chat_message_member_is_still_known_or_refused(client: httpx.Client) -> None:
    # Inside a message an unknown member changes what the conversation says: refused, not ignored.
    message = {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    response = client.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 2})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("messages.0.tool_calls: ")
