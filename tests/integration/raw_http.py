"""HTTP/1.1 on a bare socket, for what an HTTP client will not send: a body shorter than its
``Content-Length``, a head that never ends, a hang-up mid-body."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

# A guard against a server that never answers (the test then fails), not a measured time.
ANSWER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(ANSWER_TIMEOUT_S)
    return sock


def post_head(path: str, content_length: int, extra: str = "") -> bytes:
    """The head of a JSON POST declaring ``content_length`` body bytes."""
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{extra}"
    return f"{head}Content-Length: {content_length}\r\n\r\n".encode()


def read_answer(sock: socket.socket) -> RawAnswer:
    """The answer's status, headers and body (by its Content-Length, else up to the close)."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a whole head: {received[:200]!r}")
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = int(headers["content-length"]) if "content-length" in headers else None
    while length is None or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return RawAnswer(int(status_line.split()[1]), headers, body)


def exchange(url: str, request: bytes) -> RawAnswer:
    """Send ``request`` on a new connection and read the answer."""
    with connect(url) as sock:
        sock.sendall(request)
        return read_answer(sock)
