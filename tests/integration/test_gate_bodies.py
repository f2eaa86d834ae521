"""What ``batchpilot-gate`` answers to a body it refuses: the runtime's status and words, whatever
engine is behind it. In front of the runtime, the gate's answer equals the runtime's own; in front
of a stand-in engine (which would take anything), a refused body never reaches it, and one that
passes arrives byte for byte as sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.server.json_body import MAX_BODY_BYTES
from tests.integration.gate_process import GateThread, StandIn, gate_thread, upstream_thread
from tests.integration.raw_http import connect, exchange, post_head, read_answer
from tests.integration.runtime_process import ThreadRuntime, runtime_thread

pytestmark = pytest.mark.timeout(180)

DIGITS_5000 = "9" * 5000
HI = '[{"role": "user", "content": "hi"}]'
# (name, path, body): bodies the runtime refuses with 400 before any model work.
REFUSED: list[tuple[str, str, bytes]] = [
    (
        "3000 nested lists beside a lane",
        "/v1/completions",
        b'{"lane":"default","x":' + b"[" * 3000 + b"]" * 3000 + b"}",
    ),
    (
        "3000 nested lists beside a lane",
        "/v1/chat/completions",
        b'{"lane":"default","x":' + b"[" * 3000 + b"]" * 3000 + b"}",
    ),
    ("100000 nested lists", "/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    ("NaN temperature", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
    ("NaN temperature", "/v1/chat/completions", f'{{"messages": {HI}, "temperature": NaN}}'.encode()),
    ("5000-digit max_tokens", "/v1/completions", f'{{"prompt": "hi", "max_tokens": {DIGITS_5000}}}'.encode()),
    ("5000-digit seed", "/v1/chat/completions", f'{{"messages": {HI}, "seed": -{DIGITS_5000}}}'.encode()),
    ("5000-digit token id", "/v1/completions", f'{{"prompt": [1, {DIGITS_5000}]}}'.encode()),
    ("1e400 top_p", "/v1/completions", b'{"prompt": "hi", "top_p": 1e400}'),
    ("UTF-16", "/v1/completions", '{"prompt": "hi"}'.encode("utf-16")),
    ("UTF-16", "/v1/chat/completions", f'{{"messages": {HI}}}'.encode("utf-16")),
    ("UTF-32", "/v1/completions", '{"prompt": "hi"}'.encode("utf-32")),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}'),
    ("a byte-order mark", "/v1/completions", '{"prompt": "hi"}'.encode("utf-8-sig")),
    ("not JSON", "/v1/completions", b'{"prompt": "hi",'),
    ("lone surrogate in the prompt", "/v1/completions", b'{"prompt": "\\ud800"}'),
    ("lone surrogate in content", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
    ("lone surrogate as a member name", "/v1/completions", b'{"prompt": "hi", "\\ud800": 1}'),
]


def _json_post(http: httpx.Client, url: str, body: bytes) -> httpx.Response:
    return http.post(url, content=body, headers={"content-type": "application/json"})


# -- in front of the runtime ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    with runtime_thread(tmp_path_factory.mktemp("bodies-runtime"), target_batch_size=1, max_wait_ms=0) as started:
        yield started


@pytest.fixture(scope="module")
def gated(runtime: ThreadRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateThread]:
    window = Window(target_batch_size=1, hard_cap=4, max_wait_ms=0)
    with gate_thread(tmp_path_factory.mktemp("bodies-gate"), runtime.serve_url, window, max_hard_cap=8) as gate:
        yield gate


@pytest.mark.parametrize(("path", "body"), [(p, b) for _, p, b in REFUSED], ids=[f"{n}-{p}" for n, p, _ in REFUSED])
def test_a_refused_body_gets_the_runtimes_answer_through_the_gate(
    runtime: ThreadRuntime, gated: GateThread, path: str, body: bytes
) -> None:
    with httpx.Client(timeout=60.0) as http:
        direct = _json_post(http, runtime.serve_url + path, body)
        through = _json_post(http, gated.serve_url + path, body)
    assert direct.status_code == 400, direct.text[:300]
    assert (through.status_code, through.json()) == (direct.status_code, direct.json())


def test_a_declared_length_over_the_limit_is_refused_at_once_as_the_runtime_does(
    runtime: ThreadRuntime, gated: GateThread
) -> None:
    # 10 bytes of a body declared as 10**9: neither server may wait for the rest.
    request = post_head("/v1/completions", 1_000_000_000) + b'{"prompt":'
    direct = exchange(runtime.serve_url, request)
    through = exchange(gated.serve_url, request)
    assert direct.status == 413
    assert direct.json()["error"] == {
        "message": f"body: 1000000000 bytes is over the limit of {MAX_BODY_BYTES}",
        "type": "invalid_request_error",
        "param": "body",
        "code": None,
    }
    assert (through.status, through.json()) == (direct.status, direct.json())


def test_a_body_that_grows_over_the_limit_is_refused_as_the_runtime_does(
    runtime: ThreadRuntime, gated: GateThread
) -> None:
    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is found while reading
        piece = b" " * (1024 * 1024)
        for _ in range(MAX_BODY_BYTES // len(piece) + 1):
            yield piece

    with httpx.Client(timeout=60.0) as http:
        direct = http.post(runtime.serve_url + "/v1/completions", content=chunked())
        through = http.post(gated.serve_url + "/v1/completions", content=chunked())
    assert direct.status_code == 413
    assert direct.json()["error"]["message"] == f"body: over the limit of {MAX_BODY_BYTES} bytes"
    assert (through.status_code, through.json()) == (direct.status_code, direct.json())


# -- in front of a stand-in engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def stand_in() -> StandIn:
    return StandIn()


@pytest.fixture(scope="module")
def stand_in_gated(stand_in: StandIn, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateThread]:
    window = Window(target_batch_size=1, hard_cap=4, max_wait_ms=0)
    with (
        upstream_thread(stand_in) as (upstream, _),
        gate_thread(tmp_path_factory.mktemp("stand-in-gate"), upstream, window) as gate,
    ):
        yield gate


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        pytest.param(
            b'{"lane":"default","x":' + b"[" * 3000 + b"]" * 3000 + b"}",
            "body: JSON nested too deeply",
            "body",
            id="nested-with-lane",
        ),
        pytest.param(b'{"prompt": "x", "seed": NaN}', "seed: NaN is not a JSON number", "seed", id="NaN"),
        pytest.param(
            f'{{"prompt": [1, {DIGITS_5000}]}}'.encode(),
            "prompt.1: 9999999999...9999 (5000 characters) is outside the signed 64-bit integer range",
            "prompt",
            id="5000-digit",
        ),
        pytest.param(
            '{"prompt": "x"}'.encode("utf-16-le"),
            "body: holds NUL characters; JSON must be sent as UTF-8",
            "body",
            id="UTF-16",
        ),
        # The gate reads no schema: a refused literal is refused wherever it is, even in a field
        # the runtime would ignore, since no engine can be trusted to carry it on.
        pytest.param(
            b'{"prompt": "x", "extra": {"a": [1, -Infinity], "b": 1e999}}',
            "extra.a.1: -Infinity is not a JSON number",
            "extra",
            id="first-of-two-in-an-unknown-field",
        ),
        pytest.param(b"NaN", "body: NaN is not a JSON number", "body", id="the-whole-body"),
    ],
)
def test_a_refused_body_never_reaches_the_engine(
    stand_in: StandIn, stand_in_gated: GateThread, body: bytes, message: str, param: str
) -> None:
    arrivals = len(stand_in.arrivals)
    with httpx.Client(timeout=60.0) as http:
        refused = _json_post(http, stand_in_gated.serve_url + "/v1/completions", body)
    assert refused.status_code == 400
    assert refused.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }
    assert len(stand_in.arrivals) == arrivals


def test_a_body_that_passes_reaches_the_engine_byte_for_byte(stand_in: StandIn, stand_in_gated: GateThread) -> None:
    # Spacing, escapes, a surrogate pair and an exponent: what a re-encoding would change.
    body = b'{ "prompt" :"caf\\u00e9 \\ud83d\\ude00",\n\t"max_tokens":2 , "temperature": 1.0E0, "lane": "default"}'
    with httpx.Client(timeout=60.0) as http:
        answer = _json_post(http, stand_in_gated.serve_url + "/v1/completions", body)
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["text"] == "xx"
    assert stand_in.bodies[-1] == body


def test_a_declared_length_over_the_limit_is_refused_before_the_engine_is_asked(
    stand_in: StandIn, stand_in_gated: GateThread
) -> None:
    arrivals = len(stand_in.arrivals)
    with connect(stand_in_gated.serve_url) as sock:
        sock.sendall(post_head("/v1/completions", MAX_BODY_BYTES + 1) + b'{"prompt": "x"')
        answer = read_answer(sock)
    assert answer.status == 413
    assert answer.json()["error"]["message"] == (
        f"body: {MAX_BODY_BYTES + 1} bytes is over the limit of {MAX_BODY_BYTES}"
    )
    assert len(stand_in.arrivals) == arrivals


def _lane_request(lane: Any) -> bytes:
    return json.dumps({"prompt": "x", "max_tokens": 1, "lane": lane}).encode()


def test_the_lane_is_the_bodys_top_level_string(stand_in_gated: GateThread) -> None:
    with httpx.Client(timeout=60.0) as http:
        unknown = _json_post(http, stand_in_gated.serve_url + "/v1/completions", _lane_request("nope"))
        nested = http.post(
            stand_in_gated.serve_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "x": {"lane": "nope"}}
        )
        not_text = _json_post(http, stand_in_gated.serve_url + "/v1/completions", _lane_request(["nope"]))
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lane"
    assert nested.status_code == 200
    assert not_text.status_code == 200  # not a lane name: the default lane, and the engine's to judge
