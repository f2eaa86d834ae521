"""Reading a request body in the runtime's fastapi apps: the body within its limit, and
validation errors in OpenAI's shape that name the field.

Shared by every route that takes a body (the OpenAI routes and the admin window). The decoding
itself (strict JSON, ``RefusedLiteral``, ``ApiError``, the limits) is ``json_body``'s, which the
gate uses without fastapi; here a refused literal is reported at its field by pydantic's validation.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from starlette.requests import ClientDisconnect

from batchpilot_runtime.server.json_body import (
    MAX_BODY_BYTES,
    ApiError,
    RefusedLiteral,
    declared_length_error,
    over_limit_error,
)

logger = logging.getLogger("batchpilot.access")

# nginx's status for a request whose client closed the connection first; nobody receives it, the
# access log line shows it.
CLIENT_CLOSED_REQUEST = 499


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: tuple[int | str, ...]) -> str:
    # pydantic names a union's member types in the location ("constrained-str", "list[int]");
    # the user wants the field and the index.
    parts = [str(p) for p in loc if isinstance(p, int) or not ("-" in p or "[" in p or p in _UNION_TAGS)]
    return ".".join(parts) or "body"


def error_message(item: ErrorDetails) -> str:
    """pydantic's message for one error, or why ``decode_json`` refused the literal it was given."""
    given = item.get("input")
    return given.reason if isinstance(given, RefusedLiteral) else item["msg"]


def validation_error(error: ValidationError) -> ApiError:
    errors = error.errors(include_url=False)
    # With a union (a prompt is text or token ids) the deepest error is the one about the member the
    # client meant: [1, -2] is a list with a bad item, not a string.
    worst = max(errors, key=lambda e: len(e["loc"]))
    field = str(worst["loc"][0]) if worst["loc"] else "body"
    return ApiError(400, f"{_field_path(tuple(worst['loc']))}: {error_message(worst)}", param=field)


async def read_body(request: Request, limit_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused with 413 past ``limit_bytes`` without buffering the rest. A client
    that hangs up before the end raises starlette's ``ClientDisconnect`` (``add_client_gone_handler``)."""
    too_long = declared_length_error(request.headers.get("content-length"), limit_bytes)
    if too_long is not None:
        raise too_long
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise over_limit_error(limit_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def add_client_gone_handler(app: FastAPI) -> None:
    """A client that hangs up before its body is read is an ordinary outcome, not a server error:
    answered (to nobody) with 499 and logged at debug, instead of escaping to uvicorn's error log."""

    async def client_gone(request: Request, _error: Exception) -> Response:
        logger.debug("the client hung up before its body was read", extra={"path": request.url.path})
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    app.add_exception_handler(ClientDisconnect, client_gone)
