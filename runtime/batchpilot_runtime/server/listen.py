"""Listening sockets, the admin token and the uvicorn servers of a process with two ports.

Shared by ``batchpilot-runtime serve`` and ``batchpilot-gate``; no torch here, so that the gate
(which must not import the model) starts its ports the way the runtime does.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import uvicorn

from batchpilot_runtime.server.header_limits import BoundedHttpToolsProtocol, HeaderLimits

GRACEFUL_CLOSE_S = 5


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to its owner, which drains both ports together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def http_server(app: Any) -> QuietServer:
    """A server for an ASGI app, without uvicorn's own logging, lifespan or websockets, under the
    limits on a request's head that every port shares (``header_limits``)."""
    return QuietServer(
        uvicorn.Config(
            HeaderLimits(app),
            http=BoundedHttpToolsProtocol,
            log_config=None,
            access_log=False,
            lifespan="off",
            ws="none",
            timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
        )
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before serving so that port 0 resolves to a known free port (no probe-then-bind race).

    The protocol is named (IPPROTO_TCP, not 0) because asyncio turns Nagle's algorithm off only on
    sockets that say they are TCP, and accepted sockets inherit it: with 0, a small write behind
    unacknowledged data (an SSE chunk after the headers) waited for the peer's delayed ACK, ~40 ms.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def load_admin_token(path: Path | None) -> tuple[str, Path]:
    """The admin bearer token and the file it is in.

    Without a file, a random token is written to a new private directory (mode 0700, file 0600)
    and only its path is logged: the admin port is never open without a token.
    """
    if path is not None:
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"--admin-token-file {path}: the file is empty")
        return token, path
    directory = Path(tempfile.mkdtemp(prefix="batchpilot-admin-"))
    token_path = directory / "token"
    token = secrets.token_urlsafe(32)
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token, token_path


def url_of(host: str, sock: socket.socket) -> str:
    """The URL a client on this host reaches ``sock`` at (a wildcard address shown as loopback)."""
    port = sock.getsockname()[1]
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
