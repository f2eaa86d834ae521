"""Reading a request body in the runtime's fastapi apps: the body within its limit, and
validation errors in OpenAI's shape that name the field.

Shared by every route that takes a body (the OpenAI routes and the admin window). The decoding
itself (strict JSON, ``RefusedLiteral``, ``ApiError``, the limits) is ``json_body``'s, which the
gate uses without fastapi; here a refused literal is reported at its field by pydantic's validation.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from batchpilot_runtime.server.json_body import (
    MAX_BODY_BYTES,
    ApiError,
    RefusedLiteral,
    declared_length_error,
    over_limit_error,
)


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
    """The request body, refused with 413 past ``limit_bytes`` without buffering the rest."""
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
