"""The demo's real answers: the chat request it sends, what it keeps of the reply, the errors that
name the question, the runtime command for a checkpoint, and the report's section."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchpilot_operator.demo.answers import CHAT_CHECKPOINT, MAX_TOKENS, ask
from batchpilot_operator.demo.children import runtime_command
from batchpilot_operator.demo.report import render_html
from batchpilot_operator.demo.results import ChatAnswer
from tests.unit.test_demo_report import make_report

URL = "http://runtime"


def reply(content: str = " Paris. ", tokens: int = 3, finish: str = "stop") -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 20, "completion_tokens": tokens, "total_tokens": 20 + tokens},
    }


async def ask_with(handler: httpx.MockTransport, question: str = "Capital of France?") -> ChatAnswer:
    async with httpx.AsyncClient(transport=handler) as client:
        return await ask(client, URL, question)


async def test_a_greedy_chat_request_and_the_answer_it_keeps() -> None:
    sent: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json=reply())

    answer = await ask_with(httpx.MockTransport(handle))
    assert str(sent[0].url) == f"{URL}/v1/chat/completions"
    assert json.loads(sent[0].content) == {
        "model": CHAT_CHECKPOINT,
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    assert (answer.model, answer.question, answer.answer) == (CHAT_CHECKPOINT, "Capital of France?", "Paris.")
    assert (answer.completion_tokens, answer.finish_reason) == (3, "stop")
    assert answer.seconds >= 0


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (httpx.Response(400, json={"error": {"message": "bad"}}), r"refused 'Q\?': HTTP 400"),
        (httpx.Response(200, json={"choices": []}), r"answer to 'Q\?' is malformed"),
        (httpx.Response(200, text="not json"), r"answer to 'Q\?' is malformed"),
    ],
    ids=["refused", "no-choice", "not-json"],
)
async def test_a_refusal_or_a_malformed_answer_names_the_question(response: httpx.Response, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await ask_with(httpx.MockTransport(lambda _request: response), "Q?")


def test_the_runtime_command_serves_a_checkpoint_instead_of_a_preset(tmp_path: Path) -> None:
    common: dict[str, Any] = {
        "model": "m",
        "window_flags": [],
        "kv_cache_tokens": 2048,
        "token_file": tmp_path / "t",
        "ready_file": tmp_path / "r",
        "seed": 0,
        "threads": 2,
    }
    real = runtime_command(preset=None, checkpoint=CHAT_CHECKPOINT, **common)
    assert real[real.index("--checkpoint") + 1] == CHAT_CHECKPOINT and "--preset" not in real
    preset = runtime_command(preset="tiny", **common)
    assert preset[preset.index("--preset") + 1] == "tiny" and "--checkpoint" not in preset


@pytest.mark.slow  # it draws the report's figures
def test_the_report_shows_the_answers_escaped_and_nothing_without_them() -> None:
    report = make_report()
    assert 'id="answers"' not in render_html(report)
    answer = ChatAnswer(
        model=CHAT_CHECKPOINT,
        question="1 < 2?",
        answer="Yes: <b>1</b>",
        completion_tokens=4,
        finish_reason="stop",
        seconds=0.8,
    )
    page = render_html(report.model_copy(update={"answers": [answer]}))
    assert 'id="answers"' in page and "<h2>Real answers</h2>" in page
    assert "1 &lt; 2?" in page and "Yes: &lt;b&gt;1&lt;/b&gt;" in page and "<b>1</b>" not in page
