"""``batchpilot-gate`` over HTTP: in front of a real batchpilot runtime (the same greedy text through
the gate as direct, streamed and whole), and in front of a stand-in upstream that counts requests in
flight (the cap holds across a live window change, a burst loses nothing, a hang-up frees its slot, a
down upstream is a 502), plus the admin API, the metrics and the command itself."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_runtime.contract import metric_names as mn
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.server.listen import bind_socket, url_of
from batchpilot_runtime.server.ready import RuntimeInfo
from tests.integration.gate_process import GateThread, LoopThread, StandIn, gate_thread, upstream_thread
from tests.integration.runtime_process import ThreadRuntime, parse_sse, runtime_thread, wait_until, write_token

pytestmark = pytest.mark.timeout(180)


def _sample(metrics_text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels}")


def _stream_text(response: httpx.Response) -> tuple[str, list[Any]]:
    events = parse_sse(list(response.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e.get("choices")]
    text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "" for c in chunks)
    return text, chunks


# -- in front of a real runtime ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    with runtime_thread(tmp_path_factory.mktemp("gate-runtime"), hard_cap=8, target_batch_size=1) as started:
        yield started


@pytest.fixture(scope="module")
def gated(runtime: ThreadRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateThread]:
    window = Window(target_batch_size=1, hard_cap=4, max_wait_ms=5)
    with gate_thread(tmp_path_factory.mktemp("gate"), runtime.serve_url, window, max_hard_cap=8) as gate:
        yield gate


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/completions", {"prompt": "The gate passes", "max_tokens": 12}, id="completions"),
        pytest.param(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 10},
            id="chat",
        ),
    ],
)
def test_greedy_output_through_the_gate_equals_direct(
    runtime: ThreadRuntime, gated: GateThread, path: str, body: dict[str, Any]
) -> None:
    request = {"model": "tiny-test", "temperature": 0, **body}
    with httpx.Client(timeout=60.0) as http:
        direct = http.post(runtime.serve_url + path, json=request).json()
        through = http.post(gated.serve_url + path, json=request).json()
        with http.stream("POST", runtime.serve_url + path, json={**request, "stream": True}) as response:
            direct_stream, direct_chunks = _stream_text(response)
        with http.stream("POST", gated.serve_url + path, json={**request, "stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            gate_stream, gate_chunks = _stream_text(response)
    choice = "text" if path == "/v1/completions" else "message"
    assert through["choices"][0][choice] == direct["choices"][0][choice]
    assert through["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    assert through["usage"] == direct["usage"]
    assert gate_stream == direct_stream
    assert len(gate_chunks) == len(direct_chunks)  # chunk for chunk, none merged or split
    whole = direct["choices"][0]["text"] if choice == "text" else direct["choices"][0]["message"]["content"]
    assert gate_stream == whole


def test_metrics_are_measured_at_the_gate(runtime: ThreadRuntime, gated: GateThread) -> None:
    request = {"model": "tiny-test", "prompt": "count me", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60.0) as http:
        before = http.get(gated.serve_url + "/metrics").text
        with http.stream("POST", gated.serve_url + "/v1/completions", json=request) as response:
            _stream_text(response)
        # A request is counted just after its last bytes went out: wait for that count.
        ttft_count = f"{mn.TTFT_SECONDS}_count"
        expected = _sample(before, ttft_count, lane="default") + 1
        wait_until(
            lambda: _sample(gated.gate.metrics.exposition().decode(), ttft_count, lane="default") == expected,
            30,
            "the count",
        )
        after = http.get(gated.serve_url + "/metrics").text
        models = http.get(gated.serve_url + "/v1/models")
        health = http.get(gated.serve_url + "/health")
        ready = http.get(gated.serve_url + "/readyz")
    for name in (f"{mn.TTFT_SECONDS}_count", f"{mn.QUEUE_WAIT_SECONDS}_count", f"{mn.REQUEST_LATENCY_SECONDS}_count"):
        assert _sample(after, name, lane="default") == _sample(before, name, lane="default") + 1
    gaps = _sample(after, f"{mn.INTER_TOKEN_SECONDS}_count", lane="default") - _sample(
        before, f"{mn.INTER_TOKEN_SECONDS}_count", lane="default"
    )
    assert 1 <= gaps <= 6  # one gap per chunk after the first, however the upstream's chunks arrived
    assert _sample(after, mn.REQUESTS_TOTAL, outcome="completed") >= 1
    assert _sample(after, mn.WINDOW_HARD_CAP, model="tiny-test") == 4
    assert _sample(after, mn.ADMISSIONS_TOTAL, reason="target") >= 1
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-test"
    assert health.status_code == 200
    assert ready.status_code == 200


# -- in front of the stand-in -------------------------------------------------------------------------


def _put_window(gate: GateThread, window: Window, http: httpx.Client) -> httpx.Response:
    body = {"window": window.model_dump(mode="json", by_alias=True)}
    return http.put(gate.admin_url + "/admin/window", json=body, headers=gate.auth_headers())


def _completed(gate: GateThread) -> float:
    return _sample(gate.gate.metrics.exposition().decode(), mn.REQUESTS_TOTAL, outcome="completed")


def test_a_live_cap_change_holds_on_the_next_admission(tmp_path: Path) -> None:
    stand_in = StandIn(hold=True)
    with (
        upstream_thread(stand_in) as (upstream, upstream_loop),
        gate_thread(tmp_path, upstream, Window(target_batch_size=1, hard_cap=4, max_wait_ms=0)) as gated,
        httpx.Client(timeout=60.0) as http,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):
        request = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}

        def one() -> tuple[int, str]:
            with (
                httpx.Client(timeout=60.0) as client,
                client.stream("POST", gated.serve_url + "/v1/completions", json=request) as response,
            ):
                return response.status_code, _stream_text(response)[0]

        futures = [pool.submit(one) for _ in range(8)]
        # 1. Cap 4: four reach the upstream, four wait at the gate.
        wait_until(lambda: stand_in.in_flight == 4 and gated.gate.admission.num_waiting == 4, 30, "4 in flight")
        # 2. Cap 2, live: one finishing leaves 3 running, above the new cap, so nobody is admitted.
        assert _put_window(gated, Window(target_batch_size=1, hard_cap=2, max_wait_ms=0, generation=1), http).is_success
        arrivals_before = len(stand_in.arrivals)
        for finished in (1, 2):
            stand_in.release(upstream_loop, 1)
            wait_until(lambda finished=finished: _completed(gated) == finished, 30, f"{finished} completed")
            assert gated.gate.admission.num_running == 4 - finished
            assert gated.gate.admission.num_waiting == 4
        # 3. Below the cap now: each release lets exactly one waiting request in.
        stand_in.release(upstream_loop, 8)
        results = [future.result(60) for future in futures]
    assert results == [(200, "t0 t1 t2 ")] * 8
    assert stand_in.arrivals[:arrivals_before] == [1, 2, 3, 4]
    assert max(stand_in.arrivals[arrivals_before:]) <= 2  # never more in flight than the cap in force
    assert stand_in.max_in_flight == 4


def test_a_burst_loses_no_request(tmp_path: Path) -> None:
    stand_in = StandIn(token_delay_s=0.005)
    window = Window(target_batch_size=2, hard_cap=2, max_wait_ms=1)
    with (
        upstream_thread(stand_in) as (upstream, _),
        gate_thread(tmp_path, upstream, window, max_queue=4) as gated,
        concurrent.futures.ThreadPoolExecutor(24) as pool,
    ):

        def one(index: int) -> tuple[int, str | None, str]:
            request = {"model": "m", "prompt": "x", "max_tokens": 4, "stream": index % 2 == 0}
            with httpx.Client(timeout=60.0) as client:
                response = client.post(gated.serve_url + "/v1/completions", json=request)
            if response.status_code != 200:
                return response.status_code, response.headers.get("retry-after"), response.text
            text = _stream_text(response)[0] if request["stream"] else response.json()["choices"][0]["text"]
            return 200, None, text

        results = list(pool.map(one, range(48)))
        ok = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        # A request is counted just after its last bytes went out: wait for the last count.
        wait_until(lambda: _completed(gated) == len(ok), 30, "every answered request counted")
        metrics = gated.gate.metrics.exposition().decode()
    assert len(ok) + len(refused) == 48
    assert len(ok) >= 6  # the cap and the queue were full at least once
    assert all(text in ("t0 t1 t2 t3 ", "xxxx") for _, _, text in ok)
    assert all(retry is not None and int(retry) >= 1 and "queue is full" in body for _, retry, body in refused)
    assert _sample(metrics, mn.REQUESTS_TOTAL, outcome="completed") == len(ok)
    assert _sample(metrics, mn.REQUESTS_TOTAL, outcome="rejected") == len(refused)
    assert stand_in.max_in_flight <= 2


def test_a_long_streamed_answer_is_counted_from_the_usage_object_that_ends_it(tmp_path: Path) -> None:
    # 6000 events of about 110 bytes: the answer passes the 64 KiB the gate keeps of it many times over.
    request = {"model": "m", "prompt": "x", "max_tokens": 6000, "stream": True}
    request["stream_options"] = {"include_usage": True}
    with (
        upstream_thread(StandIn()) as (upstream, _),
        gate_thread(tmp_path, upstream, Window(target_batch_size=1, hard_cap=2, max_wait_ms=0)) as gated,
        httpx.Client(timeout=60.0) as http,
    ):
        with http.stream("POST", gated.serve_url + "/v1/completions", json=request) as response:
            text, _ = _stream_text(response)
        wait_until(lambda: _completed(gated) == 1, 30, "the answer counted")
        metrics = gated.gate.metrics.exposition().decode()
    assert len(text.split()) == 6000
    assert _sample(metrics, mn.PROMPT_TOKENS_TOTAL, model="tiny-test") == 3  # read from the usage object
    assert _sample(metrics, f"{mn.INTER_TOKEN_SECONDS}_count", lane="default") >= 1


def _raw_request(url: str, body: dict[str, Any]) -> socket.socket:
    """A request sent on a bare socket, so that the test decides when the client hangs up (close)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(payload)}\r\n\r\n"
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + payload)
    return sock


def test_a_client_hang_up_frees_its_slot(tmp_path: Path) -> None:
    stand_in = StandIn(hold=True)
    with (
        upstream_thread(stand_in) as (upstream, upstream_loop),
        gate_thread(tmp_path, upstream, Window(target_batch_size=1, hard_cap=1, max_wait_ms=0)) as gated,
    ):
        request = {"model": "m", "prompt": "x", "max_tokens": 2, "stream": True}
        running = _raw_request(gated.serve_url, request)
        wait_until(lambda: stand_in.in_flight == 1, 30, "the first request upstream")
        waiting = _raw_request(gated.serve_url, request)
        wait_until(lambda: gated.gate.admission.num_waiting == 1, 30, "a second request waiting")
        waiting.close()  # hangs up while waiting
        wait_until(lambda: gated.gate.admission.num_waiting == 0, 30, "the waiting one gone")
        assert gated.gate.admission.num_running == 1
        running.close()  # hangs up while upstream: the gate closes the upstream request too
        wait_until(lambda: gated.gate.admission.num_running == 0 and stand_in.disconnected == 1, 30, "slot freed")
        stand_in.release(upstream_loop, 1)
        with httpx.Client(timeout=60.0) as http:
            assert http.post(gated.serve_url + "/v1/completions", json={**request, "stream": False}).status_code == 200
        assert stand_in.arrivals == [1, 1]
        metrics = gated.gate.metrics.exposition().decode()
        assert _sample(metrics, mn.REQUESTS_TOTAL, outcome="cancelled") == 2


def test_on_hang_up_finish_holds_the_slot_until_the_upstream_has_finished(tmp_path: Path) -> None:
    # The stand-in ignores hang-ups (it writes on into a closed connection for 30 tokens x 50 ms), and
    # uvicorn under it closes a half-closed connection at once: only `finish` keeps the cap exact. A
    # slot freed when the client left would let the next requests in beside the abandoned ones.
    stand_in = StandIn(token_delay_s=0.05)
    window = Window(target_batch_size=4, hard_cap=4, max_wait_ms=0)
    with (
        upstream_thread(stand_in) as (upstream, _),
        gate_thread(tmp_path, upstream, window, on_hang_up="finish") as gated,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        sockets = [
            _raw_request(gated.serve_url, {"model": "m", "prompt": "x", "max_tokens": 30, "stream": i % 2 == 0})
            for i in range(12)
        ]
        wait_until(lambda: stand_in.in_flight == 4 and gated.gate.admission.num_waiting == 8, 30, "cap full")
        for sock in sockets:
            sock.close()  # four hang up mid-answer, eight while waiting
        wait_until(lambda: gated.gate.admission.num_waiting == 0, 30, "the waiting ones gone")

        def one(index: int) -> int:
            request = {"model": "m", "prompt": "x", "max_tokens": 2, "stream": index % 2 == 0}
            with httpx.Client(timeout=60.0) as client:
                return client.post(gated.serve_url + "/v1/completions", json=request).status_code

        statuses = list(pool.map(one, range(4)))
        wait_until(lambda: _completed(gated) == 4, 30, "every answered request counted")
        metrics = gated.gate.metrics.exposition().decode()
    assert statuses == [200] * 4
    assert stand_in.max_in_flight == 4  # the abandoned four ran to their end before the next four went in
    assert stand_in.finished == 8
    assert _sample(metrics, mn.REQUESTS_TOTAL, outcome="cancelled") == 12


def test_an_upstream_that_is_down_gives_502_naming_it(tmp_path: Path) -> None:
    with upstream_thread(StandIn()) as (upstream, _):
        pass  # started and stopped: nothing listens there now
    with (
        gate_thread(tmp_path, upstream, Window(target_batch_size=1, hard_cap=2, max_wait_ms=0)) as gated,
        httpx.Client(timeout=60.0) as http,
    ):
        for stream in (False, True):
            body = {"model": "m", "prompt": "x", "max_tokens": 2, "stream": stream}
            response = http.post(gated.serve_url + "/v1/completions", json=body)
            assert response.status_code == 502
            assert upstream in response.json()["error"]["message"]
        assert http.get(gated.serve_url + "/v1/models").status_code == 502
        ready = http.get(gated.serve_url + "/readyz")
        assert ready.status_code == 503 and upstream in ready.text
        assert gated.gate.admission.num_running == 0
        metrics = gated.gate.metrics.exposition().decode()
        assert _sample(metrics, mn.REQUESTS_TOTAL, outcome="error") == 2


def test_the_admin_api_is_the_runtimes(tmp_path: Path) -> None:
    with (
        upstream_thread(StandIn()) as (upstream, _),
        gate_thread(
            tmp_path, upstream, Window(target_batch_size=2, hard_cap=4, max_wait_ms=5), max_hard_cap=8
        ) as gated,
        httpx.Client(timeout=60.0) as http,
    ):
        url = gated.admin_url + "/admin/window"
        assert http.get(url).status_code == 401
        state = http.get(url, headers=gated.auth_headers()).json()
        assert state["window"]["hardCap"] == 4 and state["capacity"]["maxHardCap"] == 8
        newer = Window(target_batch_size=2, hard_cap=6, max_wait_ms=5, generation=3)
        assert _put_window(gated, newer, http).json()["window"]["generation"] == 3
        assert _put_window(gated, newer, http).status_code == 200  # a re-send changes nothing
        stale = _put_window(gated, newer.model_copy(update={"generation": 2}), http)
        assert stale.status_code == 409 and stale.json()["windowInForce"]["generation"] == 3
        too_big = _put_window(gated, Window(target_batch_size=2, hard_cap=9, max_wait_ms=5, generation=4), http)
        assert too_big.status_code == 422 and "hardCap" in too_big.json()["detail"]
        budget = _put_window(gated, newer.model_copy(update={"generation": 5, "max_prefill_tokens": 512}), http)
        assert budget.status_code == 422 and "maxPrefillTokens" in budget.json()["detail"]
        lanes = {"lanes": [{"name": "critical", "window": newer.model_dump(by_alias=True), "reservedSlots": 1}]}
        body = {"window": newer.model_copy(update={"generation": 6}).model_dump(by_alias=True), **lanes}
        assert http.put(url, json=body, headers=gated.auth_headers()).status_code == 200
        lane_request = {"model": "m", "prompt": "x", "max_tokens": 2}
        critical = http.post(
            gated.serve_url + "/v1/completions", json=lane_request, headers={"X-Batchpilot-Lane": "critical"}
        )
        unknown = http.post(gated.serve_url + "/v1/completions", json={**lane_request, "lane": "nope"})
        metrics = http.get(gated.serve_url + "/metrics").text
    assert critical.status_code == 200
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lane"
    assert _sample(metrics, mn.WINDOW_GENERATION, model="tiny-test") == 6
    assert _sample(metrics, f"{mn.QUEUE_WAIT_SECONDS}_count", lane="critical") == 1


def test_the_command_reads_its_flags_from_the_environment_and_drains_on_sigterm(tmp_path: Path) -> None:
    _, token_file = write_token(tmp_path)
    ready_file = tmp_path / "ready.json"
    with upstream_thread(StandIn()) as (upstream, _):
        env = {
            **os.environ,
            "BATCHPILOT_UPSTREAM": upstream,
            "BATCHPILOT_MODEL_NAME": "env-model",
            "BATCHPILOT_HARD_CAP": "3",
            "BATCHPILOT_LANE": "critical:cap=1,reserved=1",
        }
        command = [sys.executable, "-m", "batchpilot_runtime.gate.cli", "--port", "0", "--admin-port", "0"]
        command += ["--admin-token-file", str(token_file), "--ready-file", str(ready_file), "--target-batch-size", "2"]
        process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
        try:
            wait_until(ready_file.exists, 60, "the gate's ready file")
            info = RuntimeInfo.read(ready_file)
            headers = {"Authorization": f"Bearer {info.admin_token()}"}
            with httpx.Client(timeout=30.0) as http:
                state = http.get(info.admin_url + "/admin/window", headers=headers).json()
                answer = http.post(
                    info.serve_url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}
                )
        finally:
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr.decode()[-2000:]
    assert info.model == "env-model"
    assert state["window"]["hardCap"] == 3 and state["window"]["targetBatchSize"] == 2
    assert [lane["name"] for lane in state["lanes"]] == ["critical"]
    assert json.loads(answer.text)["choices"][0]["text"] == "xx"


def test_the_command_names_a_missing_or_bad_flag(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHPILOT_")}
    missing = subprocess.run(
        [sys.executable, "-m", "batchpilot_runtime.gate.cli", "--model-name", "m"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    bad = subprocess.run(
        [sys.executable, "-m", "batchpilot_runtime.gate.cli", "--upstream", "http://x", "--model-name", "m"],
        env={**env, "BATCHPILOT_HARD_CAP": "zero"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "--upstream is required (or BATCHPILOT_UPSTREAM)" in missing.stderr
    assert bad.returncode == 2 and "--hard-cap" in bad.stderr and "zero" in bad.stderr


def test_a_connection_the_upstream_closes_unanswered_is_tried_once_more(tmp_path: Path) -> None:
    # A raw upstream: it drops the first `drops` connections after reading their request, then answers.
    answer = json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}).encode()
    seen: list[str] = []

    async def upstream(reader: Any, writer: Any, drops: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        seen.append("dropped" if len(seen) < drops else "answered")
        if seen[-1] == "dropped":
            writer.close()
            return
        head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(answer)}\r\n\r\n"
        writer.write(head.encode() + answer)
        await writer.drain()
        writer.close()

    for drops, status in ((1, 200), (2, 502)):
        seen.clear()
        loop_thread = LoopThread("raw-upstream")
        sock = bind_socket("127.0.0.1", 0)
        server = loop_thread.run(_start_raw(lambda r, w, d=drops: upstream(r, w, d), sock))
        try:
            window = Window(target_batch_size=1, hard_cap=2, max_wait_ms=0)
            with (
                gate_thread(tmp_path / str(drops), url_of("127.0.0.1", sock), window) as gated,
                httpx.Client(timeout=60.0) as http,
            ):
                response = http.post(gated.serve_url + "/v1/completions", json={"model": "m", "prompt": "x"})
        finally:
            loop_thread.call(server.close)
            loop_thread.close()
        assert response.status_code == status
        assert seen == ["dropped", "answered"] if drops == 1 else seen == ["dropped", "dropped"]
        if status == 200:
            assert response.json()["choices"][0]["text"] == "ok"


async def _start_raw(handler: Any, sock: socket.socket) -> Any:
    return await asyncio.start_server(handler, sock=sock)
