"""``batchpilot-gate`` in front of a real engine nobody here wrote: llama.cpp's ``llama-server``, built
from source by ``make llama-server``, serving the SmolLM2-135M-Instruct GGUF on one thread.

- Through the gate, with the official ``openai`` client, ``/v1/completions`` and
  ``/v1/chat/completions``, streamed and whole: greedy text equal to the same request sent direct.
- The cap holds: a burst of four times the gate's cap; llama-server's own ``requests_processing``,
  scraped during the burst, never above the cap; every request ends in text or an explicit 429. Sent
  direct, the same burst past llama-server's own slots is deferred (``requests_deferred``), not refused.
- Restart mode's effect: llama-server restarted with another ``--parallel`` (and ``--ctx-size``
  scaled with it) answers ``/props`` with the new ``total_slots`` and the same context per slot.
- Hang-ups: clients that leave mid-answer (streamed and whole) never take ``requests_processing`` above
  the gate's cap while others wait; llama-server cancels the abandoned streams (its log says so).
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from batchpilot_operator.io.exposition import parse_exposition
from batchpilot_runtime.contract.window import Window
from tests.integration.gate_process import GateThread, gate_thread
from tests.integration.llama_server_process import (
    LlamaServer,
    MetricsSampler,
    llama_server,
    llama_server_args,
    llamacpp_metrics,
)
from tests.integration.raw_http import connect, post_head
from tests.integration.runtime_process import wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("llama_server_built")]

SLOTS = 4  # llama-server's own --parallel: room for more than the gate's cap
SLOT_CTX = 1024
GATE_CAP = 2
MODEL = "smollm2"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    args = llama_server_args(parallel=SLOTS, ctx_size=SLOTS * SLOT_CTX)
    with llama_server(tmp_path_factory.mktemp("llama-server"), args) as server:
        yield server


@pytest.fixture(scope="module")
def gated(engine: LlamaServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateThread]:
    window = Window(target_batch_size=1, hard_cap=GATE_CAP, max_wait_ms=0)
    workdir = tmp_path_factory.mktemp("gate")
    with gate_thread(workdir, engine.url, window, max_hard_cap=SLOTS, max_queue=4, model_name=MODEL) as gate:
        yield gate


@pytest.fixture
def idle(engine: LlamaServer) -> LlamaServer:
    """The engine with nothing in flight, as each test starts."""
    wait_until(lambda: llamacpp_metrics(engine.url)["requests_processing"] == 0, 60, "llama-server idle", 0.05)
    return engine


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


def _answer(client: openai.OpenAI, route: str, stream: bool, max_tokens: int, prompt: str) -> str:
    """The greedy answer's text, streamed chunks joined."""
    if route == "completions":
        if stream:
            chunks = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
            return "".join(c.choices[0].text for c in chunks if c.choices)
        return (
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text
        )
    messages: Any = [{"role": "user", "content": prompt}]
    if stream:
        events = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content or ""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_greedy_output_through_the_gate_equals_direct(
    idle: LlamaServer, gated: GateThread, route: str, stream: bool
) -> None:
    prompt = "Name three colours of the rainbow."
    direct = _answer(_client(idle.url), route, stream, 24, prompt)
    through = _answer(_client(gated.serve_url), route, stream, 24, prompt)
    assert direct.strip()
    assert through == direct


def _one(url: str, index: int) -> tuple[str, str]:
    """("ok", text) or ("refused", the error's message): a request's end, whatever it is."""
    route = "completions" if index % 2 == 0 else "chat"
    try:
        return "ok", _answer(_client(url), route, index % 3 == 0, 16, f"Count to {index + 3}.")
    except openai.RateLimitError as refused:
        return "refused", str(refused)


def test_the_gates_cap_holds_on_llama_servers_own_count(idle: LlamaServer, gated: GateThread) -> None:
    burst = 4 * GATE_CAP
    with MetricsSampler(idle.url) as sampler, concurrent.futures.ThreadPoolExecutor(burst) as pool:
        ends = list(pool.map(lambda i: _one(gated.serve_url, i), range(burst)))
    answered = [text for end, text in ends if end == "ok"]
    refused = [message for end, message in ends if end == "refused"]
    assert len(answered) + len(refused) == burst  # nothing else: no 5xx, no broken stream
    assert answered and all(text.strip() for text in answered)
    assert all("queue is full" in message for message in refused)
    assert max(sampler.processing) == GATE_CAP  # reached, never passed


def test_past_its_own_slots_llama_server_defers_rather_than_refuses(idle: LlamaServer) -> None:
    burst = SLOTS + 2
    with MetricsSampler(idle.url) as sampler, concurrent.futures.ThreadPoolExecutor(burst) as pool:
        ends = list(pool.map(lambda i: _one(idle.url, i), range(burst)))
    assert [end for end, _ in ends] == ["ok"] * burst
    assert max(sampler.processing) == SLOTS
    assert max(sampler.deferred) >= 1


def test_a_restart_with_another_parallel_answers_props_with_the_new_slot_count(tmp_path: Path) -> None:
    counts = []
    for parallel in (2, 3):
        args = llama_server_args(parallel=parallel, ctx_size=parallel * SLOT_CTX)
        with llama_server(tmp_path / str(parallel), args) as server:
            props = httpx.get(server.url + "/props", timeout=30.0).json()
        counts.append((props["total_slots"], props["default_generation_settings"]["n_ctx"]))
    assert counts == [(2, SLOT_CTX), (3, SLOT_CTX)]


def _raw_post(url: str, body: dict[str, Any]) -> socket.socket:
    sock = connect(url)
    payload = json.dumps(body).encode()
    sock.sendall(post_head("/v1/completions", len(payload)) + payload)
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> None:
    received = b""
    while marker not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before {marker!r}"
        received += chunk


def test_clients_that_hang_up_never_take_llama_server_past_the_gates_cap(idle: LlamaServer, gated: GateThread) -> None:
    long_answer = {
        "model": MODEL,
        "prompt": "Write a long story about a lighthouse.",
        "max_tokens": 400,
        "ignore_eos": True,
    }
    follower = {"model": MODEL, "prompt": "Say yes.", "max_tokens": 8}
    cancels_before = idle.log_text().count("cancel task")
    followers: list[concurrent.futures.Future[httpx.Response]] = []
    with MetricsSampler(idle.url) as sampler, concurrent.futures.ThreadPoolExecutor(2 * GATE_CAP) as pool:
        for stream in (True, False):
            leaving = [_raw_post(gated.serve_url, {**long_answer, "stream": stream}) for _ in range(GATE_CAP)]
            if stream:
                for sock in leaving:
                    _read_until(sock, b"data:")  # mid-answer
            else:
                wait_until(
                    lambda: llamacpp_metrics(idle.url)["requests_processing"] == GATE_CAP,
                    60,
                    "the whole answers under way",
                )
            for _ in range(GATE_CAP):
                followers.append(
                    pool.submit(httpx.post, gated.serve_url + "/v1/completions", json=follower, timeout=120)
                )
            wait_until(lambda: gated.gate.admission.num_waiting == GATE_CAP, 30, "followers waiting")
            for sock in leaving:
                sock.close()
            wait_until(lambda: all(f.done() for f in followers), 120, "the followers answered")
    assert [f.result().status_code for f in followers] == [200] * (2 * GATE_CAP)
    assert max(sampler.processing) == GATE_CAP
    # llama-server stopped the abandoned streams (it logs each cancel) instead of finishing them. A whole
    # answer's hang-up it checks only after a second with no result for any request (the wait restarts
    # on every result, a scrape's included), so under this load those two ran to their end: the gate
    # held their slots meanwhile.
    assert idle.log_text().count("cancel task") - cancels_before >= GATE_CAP


def test_the_gate_passes_on_llama_servers_metrics_labelled_with_the_model(idle: LlamaServer, tmp_path: Path) -> None:
    # --engine-metrics: one scrape of the gate reads its own series and llama-server's, which carry no
    # labels of their own; Prometheus and the operator can then tell each model's apart.
    window = Window(target_batch_size=1, hard_cap=GATE_CAP, max_wait_ms=0)
    with (
        gate_thread(
            tmp_path, idle.url, window, max_hard_cap=SLOTS, model_name=MODEL, engine_metrics_path="/metrics"
        ) as gate,
        httpx.Client(base_url=gate.serve_url, timeout=120.0) as http,
    ):
        answered = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert answered.status_code == 200, answered.text
        series = parse_exposition(http.get("/metrics").text)
    model = (("model", MODEL),)
    assert series[("llamacpp:requests_processing", model)] == 0.0
    assert series[("llamacpp:tokens_predicted_total", model)] >= 4.0
    assert series[("batchpilot_requests_total", (*model, ("outcome", "completed")))] == 1.0
    assert not [name for name, labels in series if name.startswith("llamacpp:") and dict(labels) != dict(model)]
