"""Structured logs: one JSON object per line, carrying the request id of the request being served.

The request id lives in a context variable set by ``RequestIdMiddleware``, so that any log
line emitted while serving a request (by a handler or a library) carries it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

REQUEST_ID_HEADER = "x-request-id"
# A client's id is honoured only when it is short and plain, so that it cannot forge log fields.
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("batchpilot_request_id", default=None)

# Attributes every LogRecord has; anything else passed in ``extra=`` becomes a JSON field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message", "asctime"}

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = request_id_var.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_") and key != "color_message":
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "info") -> None:
    """Send the root logger (and uvicorn's) to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers[:] = []
        uvicorn_logger.propagate = True


def new_request_id() -> str:
    return uuid.uuid4().hex


def client_request_id(scope: Scope) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == REQUEST_ID_HEADER.encode():
            text = bytes(value).decode("latin-1")
            return text if _CLIENT_REQUEST_ID.match(text) else None
    return None


class RequestIdMiddleware:
    """Pure ASGI middleware (it must not buffer streamed bodies): picks the request id, exposes it in
    ``scope["state"]["request_id"]`` and the ``X-Request-Id`` response header, and logs one access line."""

    def __init__(self, app: ASGIApp, logger_name: str) -> None:
        self.app = app
        self.logger = logging.getLogger(logger_name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = client_request_id(scope) or new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        started_s = time.perf_counter()
        status_code = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = int(message["status"])
                headers = list(message.get("headers", ()))
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.logger.info(
                "request",
                extra={
                    "method": scope.get("method"),
                    "path": scope.get("path"),
                    "status": status_code,
                    "duration_ms": round((time.perf_counter() - started_s) * 1000.0, 3),
                },
            )
            request_id_var.reset(token)
