"""The limits every port shares (the runtime's serving and admin apps, the gate's serving and admin
apps): request headers past their limit get 431, a head that never ends is refused without being
buffered, and a client that hangs up mid-body is an ordinary outcome, not an error log."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.server.header_limits import MAX_HEAD_BYTES, MAX_HEADER_BYTES, MAX_HEADER_FIELDS
from tests.integration.gate_process import GateThread, gate_thread
from tests.integration.raw_http import connect, exchange, post_head, read_answer
from tests.integration.runtime_process import ThreadRuntime, runtime_thread, wait_until

pytestmark = pytest.mark.timeout(180)


@dataclass(frozen=True)
class Port:
    """A port and a GET it answers 200 to; ``base``: the fields that request needs (Host, the
    admin token)."""

    url: str
    path: str
    base: tuple[tuple[str, str], ...]

    def get(self, fields: list[tuple[str, str]]) -> bytes:
        """The GET with ``fields`` after the base ones."""
        lines = [f"GET {self.path} HTTP/1.1"] + [f"{name}: {value}" for name, value in (*self.base, *fields)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def filled_to(self, header_bytes: int) -> bytes:
        """The GET with one more field, whose value brings the header bytes (names and values) to
        ``header_bytes``."""
        used = sum(len(name) + len(value) for name, value in self.base) + len("X-Fill")
        return self.get([("X-Fill", "a" * (header_bytes - used))])


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    with runtime_thread(tmp_path_factory.mktemp("limits-runtime"), target_batch_size=1, max_wait_ms=0) as started:
        yield started


@pytest.fixture(scope="module")
def gated(runtime: ThreadRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateThread]:
    window = Window(target_batch_size=1, hard_cap=4, max_wait_ms=0)
    with gate_thread(tmp_path_factory.mktemp("limits-gate"), runtime.serve_url, window, max_hard_cap=8) as gate:
        yield gate


PORTS = ("runtime-serve", "runtime-admin", "gate-serve", "gate-admin")


@pytest.fixture(params=PORTS)
def port(request: pytest.FixtureRequest, runtime: ThreadRuntime, gated: GateThread) -> Port:
    host = ("Host", "test")
    return {
        "runtime-serve": Port(runtime.serve_url, "/healthz", (host,)),
        "runtime-admin": Port(runtime.admin_url, "/admin/window", (host, ("Authorization", f"Bearer {runtime.token}"))),
        "gate-serve": Port(gated.serve_url, "/healthz", (host,)),
        "gate-admin": Port(gated.admin_url, "/admin/window", (host, ("Authorization", f"Bearer {gated.token}"))),
    }[request.param]


def _refused_with_431(port: Port, request: bytes, message: str) -> None:
    answer = exchange(port.url, request)
    assert answer.status == 431, answer.body[:300]
    assert answer.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    }


# -- header limits ------------------------------------------------------------------------------------


def _fields(count: int) -> list[tuple[str, str]]:
    return [(f"X-Field-{index}", "1") for index in range(count)]


def test_headers_at_the_limits_are_served(port: Port) -> None:
    assert exchange(port.url, port.get(_fields(MAX_HEADER_FIELDS - len(port.base)))).status == 200
    assert exchange(port.url, port.filled_to(MAX_HEADER_BYTES)).status == 200


def test_one_field_over_the_limit_is_431(port: Port) -> None:
    message = f"request headers: {MAX_HEADER_FIELDS + 1} fields is over the limit of {MAX_HEADER_FIELDS}"
    _refused_with_431(port, port.get(_fields(MAX_HEADER_FIELDS - len(port.base) + 1)), message)


def test_one_byte_over_the_limit_is_431(port: Port) -> None:
    message = f"request headers: {MAX_HEADER_BYTES + 1} bytes is over the limit of {MAX_HEADER_BYTES}"
    _refused_with_431(port, port.filled_to(MAX_HEADER_BYTES + 1), message)


HEAD_OVER_THE_LIMIT = f"request head: over the limit of {MAX_HEAD_BYTES} bytes"


def test_a_1_mb_header_is_431_before_the_head_ends(port: Port) -> None:
    # The parser's bound: past MAX_HEAD_BYTES of a head still arriving, the rest is not buffered.
    _refused_with_431(port, port.get([("X-Big", "a" * 1024 * 1024)]), HEAD_OVER_THE_LIMIT)


def test_20000_headers_are_431(port: Port) -> None:
    # About 360 KB: refused by the parser's bound, or by the field count when the head arrived in
    # so few reads that it ended first (reads are up to 256 KiB; the one a head begins in and the
    # one it ends in are not counted, so that no body byte is).
    answer = exchange(port.url, port.get(_fields(20_000)))
    fields_over = f"request headers: {20_000 + len(port.base)} fields is over the limit of {MAX_HEADER_FIELDS}"
    assert answer.status == 431
    assert answer.json()["error"]["message"] in {HEAD_OVER_THE_LIMIT, fields_over}


def test_a_head_that_never_ends_is_431_and_closed(port: Port) -> None:
    # 2 MB of one header value and no end of head: a server that buffers heads would wait for ever.
    with connect(port.url) as sock:
        sock.sendall(f"GET {port.path} HTTP/1.1\r\nHost: test\r\nX-Endless: ".encode())
        sock.sendall(b"a" * (2 * 1024 * 1024))
        answer = read_answer(sock)
        closed = sock.recv(1) == b""  # what follows the answer: the end of the connection
    assert answer.status == 431
    assert answer.json()["error"]["message"] == HEAD_OVER_THE_LIMIT
    assert answer.headers["connection"] == "close"
    assert closed


# -- a hang-up mid-body -------------------------------------------------------------------------------


def _access_record(caplog: pytest.LogCaptureFixture, path: str) -> logging.LogRecord | None:
    records = [r for r in caplog.records if r.name == "batchpilot.access" and getattr(r, "path", None) == path]
    return records[-1] if records else None


@pytest.mark.parametrize("app", ["runtime-serve", "runtime-admin", "gate-admin"])
def test_a_hang_up_mid_body_is_not_an_error(
    caplog: pytest.LogCaptureFixture, runtime: ThreadRuntime, gated: GateThread, app: str
) -> None:
    url, path, auth = {
        "runtime-serve": (runtime.serve_url, "/v1/completions", ""),
        "runtime-admin": (runtime.admin_url, "/admin/window", f"Authorization: Bearer {runtime.token}\r\n"),
        "gate-admin": (gated.admin_url, "/admin/window", f"Authorization: Bearer {gated.token}\r\n"),
    }[app]
    method_head = post_head(path, 1000, auth)
    if path == "/admin/window":
        method_head = method_head.replace(b"POST ", b"PUT ", 1)
    caplog.set_level(logging.INFO)
    caplog.clear()
    with connect(url) as sock:
        sock.sendall(method_head + b'{"prompt":')  # 10 of the 1,000 bytes declared, then hang up
    wait_until(lambda: _access_record(caplog, path) is not None, 30, "the hung-up request's access line")
    # A request after it is served after the hung-up one was wholly handled (one event loop): any
    # error it caused is logged by then.
    after = exchange(url, b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
    assert after.status == (404 if path == "/admin/window" else 200)
    record = _access_record(caplog, path)
    assert record is not None and getattr(record, "status", None) == 499
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
