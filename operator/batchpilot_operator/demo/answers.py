"""The demo's real answers: the chat model, SmolLM2-135M-Instruct, answers a few questions over
``/v1/chat/completions`` before the replay starts.

The replay phases run the ``tiny`` preset (random weights, so its replies are noise): on a 2-core
machine a real model serves far too few requests per second for the operator to get the 20 samples
per interval it acts on, and two of them would not fit beside each other. So the real model runs
first, alone with every core, answers at temperature 0 (the same words on every run), and is
stopped before the phases start; its answers go to the console and the report.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx

from batchpilot_operator.demo.results import ChatAnswer

CHAT_CHECKPOINT = "smollm2-135m-instruct"
QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "What does a CPU do, in one sentence?",
    "Write a haiku about the sea.",
)
MAX_TOKENS = 40
# Prompts and answers here are a few hundred tokens; the CPU default (65,536) would take 3 GB.
KV_CACHE_TOKENS = 2048
ANSWER_TIMEOUT_S = 120.0


async def ask(client: httpx.AsyncClient, serve_url: str, question: str) -> ChatAnswer:
    """One chat completion, greedy; a refusal or a malformed body is a ValueError naming the question."""
    body = {
        "model": CHAT_CHECKPOINT,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    started = time.monotonic()
    response = await client.post(f"{serve_url}/v1/chat/completions", json=body, timeout=ANSWER_TIMEOUT_S)
    seconds = time.monotonic() - started
    if response.status_code != 200:
        raise ValueError(f"the chat model refused {question!r}: HTTP {response.status_code}: {response.text[:300]}")
    try:
        choice = response.json()["choices"][0]
        return ChatAnswer(
            model=CHAT_CHECKPOINT,
            question=question,
            answer=str(choice["message"]["content"]).strip(),
            completion_tokens=int(response.json()["usage"]["completion_tokens"]),
            finish_reason=str(choice["finish_reason"]),
            seconds=round(seconds, 2),
        )
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise ValueError(
            f"the chat model's answer to {question!r} is malformed ({error}): {response.text[:300]}"
        ) from None


async def ask_all(serve_url: str, questions: Sequence[str] = QUESTIONS) -> list[ChatAnswer]:
    """Each question in turn (one at a time: the time each took is its own)."""
    async with httpx.AsyncClient() as client:
        return [await ask(client, serve_url, question) for question in questions]
