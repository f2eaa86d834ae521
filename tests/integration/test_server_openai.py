"""The serving API as OpenAI clients see it: the official client, SSE streaming, stop strings,
lanes, request ids, and the health endpoints; plus the pure stop-string detector."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_runtime.contract import metric_names as mn
from batchpilot_runtime.contract.admin_api import LANE_HEADER, LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.server.text import StopStringDetector
from tests.integration.runtime_process import ThreadRuntime, parse_sse, runtime_thread, wait_until


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    critical = LaneWindow(
        name="critical", window=Window(target_batch_size=1, hard_cap=2, max_wait_ms=0), reserved_slots=1
    )
    with runtime_thread(tmp_path_factory.mktemp("openai"), lanes=(critical,)) as started:
        yield started


@pytest.fixture
def client(runtime: ThreadRuntime) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime.serve_url, timeout=60.0) as http:
        yield http


def test_official_client_completes(runtime: ThreadRuntime) -> None:
    api = openai.OpenAI(base_url=f"{runtime.serve_url}/v1", api_key="unused", max_retries=0)
    completion = api.completions.create(model="tiny-test", prompt="Hello, batchpilot", max_tokens=7, temperature=0)
    assert completion.object == "text_completion"
    assert completion.model == "tiny-test"
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(b"Hello, batchpilot")
    assert completion.usage.completion_tokens <= 7
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_official_client_streams(runtime: ThreadRuntime) -> None:
    api = openai.OpenAI(base_url=f"{runtime.serve_url}/v1", api_key="unused", max_retries=0)
    stream = api.completions.create(
        model="tiny-test",
        prompt=[5, 6, 7, 8],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1
    assert finishing[0].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens == 4


def test_stream_text_equals_non_stream_text(client: httpx.Client) -> None:
    body = {"prompt": "The same request twice", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = parse_sse(list(response.iter_lines()))
    assert payloads[-1] == "[DONE]"
    streamed = "".join(p["choices"][0]["text"] for p in payloads[:-1] if p.get("choices"))
    assert streamed == whole["choices"][0]["text"]
    # One chunk per generated token, so that a client can time the first one.
    assert sum(1 for p in payloads[:-1] if p.get("choices")) == 12


def test_seeded_sampling_is_reproducible(client: httpx.Client) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
    first = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    second = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert first == second


def test_stop_string_ends_the_completion(client: httpx.Client) -> None:
    body = {"prompt": "stop test", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    # A stop string taken from the greedy output itself, so the model is certain to produce it.
    clean = [i for i, ch in enumerate(full) if ch != "\ufffd" and i > 0]
    assert clean, f"greedy output has no plain character to stop on: {full!r}"
    position = clean[len(clean) // 2]
    stop = full[position]
    expected = full[: full.index(stop)]
    before = _outcomes(client)
    stopped = client.post("/v1/completions", json={**body, "stop": [stop, "never-in-output-xyz"]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == expected
    with client.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as response:
        payloads = parse_sse(list(response.iter_lines()))
    chunks = [p for p in payloads if isinstance(p, dict) and p.get("choices")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # Both ended by a stop string count as completed, not cancelled.
    after = wait_until(
        lambda: (o := _outcomes(client))["completed"] == before["completed"] + 2 and o,
        30.0,
        "two completions in /metrics",
    )
    assert after["cancelled"] == before["cancelled"]


def _outcomes(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {
        s.labels["outcome"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == mn.REQUESTS_TOTAL
    }


def test_lane_by_header_and_body_and_unknown_lane(client: httpx.Client) -> None:
    body = {"prompt": "lane", "max_tokens": 2}
    assert client.post("/v1/completions", json=body, headers={LANE_HEADER: "critical"}).status_code == 200
    assert client.post("/v1/completions", json={**body, "lane": "critical"}).status_code == 200
    refused = client.post("/v1/completions", json={**body, "lane": "platinum"})
    assert refused.status_code == 400
    assert "platinum" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "lane"
    by_header = client.post("/v1/completions", json=body, headers={LANE_HEADER: "bronze"})
    assert by_header.status_code == 400
    assert "bronze" in by_header.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "model": "some-other-model"}, "model"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
        ({"prompt": "x", "top_k": 40}, "top_k"),
        ({"prompt": "x", "logit_bias": {"50256": -100}}, "logit_bias"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
    ],
)
def test_bad_fields_are_named(client: httpx.Client, body: dict[str, object], field: str) -> None:
    response = client.post("/v1/completions", json=body)
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert error["param"] == field
    assert field in error["message"]


def test_unimplemented_sampling_is_refused_by_name_unless_off(client: httpx.Client) -> None:
    both = client.post("/v1/completions", json={"prompt": "x", "presence_penalty": 0.5, "min_p": 0.1})
    assert both.status_code == 400
    assert both.json()["error"]["message"] == (
        "presence_penalty: not supported by this runtime (leave it out or send null or 0); "
        "min_p: not supported by this runtime (leave it out or send null or 0)"
    )
    # What LangChain and others send by default means "off", and is served.
    off = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "top_k": -1, "suffix": None}
    served = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **off})
    assert served.status_code == 200, served.text


def test_a_batch_of_several_prompts_is_refused_naming_prompt(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": ["a", "b"]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "prompt: a list of 2 prompts is not supported; send one request per prompt (a string, or a list of token ids)"
    )


@pytest.mark.parametrize(("single", "plain"), [(["Hello"], "Hello"), ([[5, 6, 7]], [5, 6, 7])], ids=["text", "ids"])
def test_a_batch_of_one_prompt_is_served_as_that_prompt(client: httpx.Client, single: object, plain: object) -> None:
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    batched = client.post("/v1/completions", json={"prompt": single, **body})
    alone = client.post("/v1/completions", json={"prompt": plain, **body})
    assert batched.status_code == 200, batched.text
    assert [(c["index"], c["text"]) for c in batched.json()["choices"]] == [(0, alone.json()["choices"][0]["text"])]
    assert batched.json()["usage"] == alone.json()["usage"]


def test_official_client_gets_a_typed_error_for_several_prompts(runtime: ThreadRuntime) -> None:
    api = openai.OpenAI(base_url=f"{runtime.serve_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model="tiny-test", prompt=["one", "two"], max_tokens=2)
    assert "prompt: a list of 2 prompts is not supported" in str(refused.value)


def test_request_id_is_honoured_or_generated(client: httpx.Client) -> None:
    mine = client.get("/v1/models", headers={"X-Request-Id": "trace-abc.123"})
    assert mine.headers["x-request-id"] == "trace-abc.123"
    generated = client.get("/v1/models")
    assert len(generated.headers["x-request-id"]) == 32
    forged = client.get("/v1/models", headers={"X-Request-Id": 'bad" {id}'})
    assert forged.headers["x-request-id"] != 'bad" {id}'
    assert len(forged.headers["x-request-id"]) == 32


def test_models_health_and_readiness(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-test"]
    assert models["data"][0]["max_model_len"] > 0
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").json() == {"ready": True}
    # vLLM's /health, which LLM clients check: 200 and an empty body while the engine is alive.
    health = client.get("/health")
    assert (health.status_code, health.content) == (200, b"")


def test_health_fails_while_the_model_loads(
    runtime: ThreadRuntime, client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime.ctx, "loaded", None)
    health = client.get("/health")
    assert (health.status_code, health.json()) == (503, {"status": "model loading"})


def test_openapi_schema_documents_completions(client: httpx.Client) -> None:
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "prompt" in body["properties"]
    assert "max_tokens" in body["properties"]
    json.dumps(schema)


# -- the stop-string detector (pure) ----------------------------------------------------------


def _decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def _feed(text: bytes, stops: list[str]) -> tuple[str, StopStringDetector]:
    detector = StopStringDetector(_decode, stops)
    out = ""
    for byte in text:
        out += detector.push(byte)
        if detector.stopped:
            break
    out += detector.flush()
    return out, detector


@pytest.mark.parametrize(
    ("text", "stops", "expected", "stopped"),
    [
        (b"hello world", ["wor"], "hello ", True),
        (b"hello world", ["xyz"], "hello world", False),
        (b"aab", ["ab"], "a", True),
        (b"abcabd", ["abd", "ca"], "ab", True),
        ("caf\u00e9 ok".encode(), ["ok"], "caf\u00e9 ", True),
        (b"no stops", [], "no stops", False),
        (b"ends with partial st", ["stop"], "ends with partial st", False),
    ],
)
def test_stop_string_detector(text: bytes, stops: list[str], expected: str, stopped: bool) -> None:
    out, detector = _feed(text, stops)
    assert out == expected
    assert detector.stopped is stopped


def test_detector_holds_back_incomplete_utf8_and_stop_prefixes() -> None:
    detector = StopStringDetector(_decode, ["END"])
    e_acute = "\u00e9".encode()
    assert detector.push(e_acute[0]) == ""  # half a character
    assert detector.push(e_acute[1]) == "\u00e9"
    assert detector.push(ord("E")) == ""  # could be the start of END
    assert detector.push(ord("x")) == "Ex"
    assert detector.push(ord("E")) == ""
    assert detector.push(ord("N")) == ""
    assert detector.push(ord("D")) == ""
    assert detector.stopped
    assert detector.text == "\u00e9Ex"
    assert detector.num_tokens == 7


def test_oversized_body_is_413(client: httpx.Client) -> None:
    response = client.post(
        "/v1/completions", content=b" " * (16 * 1024 * 1024 + 1), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["error"]["param"] == "body"
    assert client.get("/readyz").status_code == 200


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=60) | st.text(max_size=30).map(str.encode),
    stops=st.lists(st.text(alphabet="ab\u00e9 ", min_size=1, max_size=3), max_size=3),
)
def test_detector_streams_exactly_the_text_before_the_first_completed_stop(data: bytes, stops: list[str]) -> None:
    full = _decode(list(data))
    # Generation ends as soon as any stop string is complete; the text ends before the earliest one.
    expected, stopped = full, False
    for end in range(1, len(full) + 1):
        hits = [i for i in (full[:end].find(s) for s in stops) if i >= 0]
        if hits:
            expected, stopped = full[: min(hits)], True
            break
    out, detector = _feed(data, stops)
    assert out == expected
    assert detector.stopped == stopped
