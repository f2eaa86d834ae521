"""Reading a request body: strict JSON, and errors in OpenAI's shape that name the field.

Shared by every route that takes a body (the OpenAI routes and the admin window). A body is
decoded once, here, into plain JSON values; a number or string the runtime could not carry on
(past 64 bits, not finite, a lone surrogate) is kept as a ``RefusedLiteral`` so that
validation reports it at its field rather than failing the whole body.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from batchpilot_runtime.server.openai_schema import ErrorDetail, ErrorResponse

# A prompt of the longest context in token ids is well under this; anything larger is refused unread.
MAX_BODY_BYTES = 16 * 1024 * 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class ApiError(Exception):
    """An error answered in OpenAI's shape; ``param`` names the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorDetail(message=self.message, type=self.kind, param=self.param))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: tuple[int | str, ...]) -> str:
    # pydantic names a union's member types in the location ("constrained-str", "list[int]");
    # the user wants the field and the index.
    parts = [str(p) for p in loc if isinstance(p, int) or not ("-" in p or "[" in p or p in _UNION_TAGS)]
    return ".".join(parts) or "body"


class RefusedLiteral:
    """Stands in for a value ``decode_json`` refuses (a number out of range, NaN, a string with a
    lone surrogate) so that validation reports it at its field; a field the model ignores may hold one."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"RefusedLiteral({self.reason!r})"


def _shown(literal: str) -> str:
    return literal if len(literal) <= 24 else f"{literal[:10]}...{literal[-4:]} ({len(literal)} characters)"


def _int_literal(literal: str) -> int | RefusedLiteral:
    # Python refuses to convert over 4,300 digits (a ValueError from json.loads); nothing here takes
    # an integer past 64 bits, and a window generation past it would not even fit a float gauge.
    if len(literal) <= 20 and INT64_MIN <= (value := int(literal)) <= INT64_MAX:
        return value
    return RefusedLiteral(f"{_shown(literal)} is outside the signed 64-bit integer range")


def _float_literal(literal: str) -> float | RefusedLiteral:
    value = float(literal)
    return value if math.isfinite(value) else RefusedLiteral(f"{_shown(literal)} is outside the range of a double")


def _constant_literal(literal: str) -> RefusedLiteral:
    return RefusedLiteral(f"{literal} is not a JSON number")


def _lone_surrogate(text: str) -> str | None:
    # json.loads joins an escaped surrogate pair into one character; what it leaves alone is unpaired.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"\\u{ord(text[error.start]):04x}"
    return None


def _refuse_lone_surrogates(payload: Any) -> None:
    """Replace each string value holding a lone surrogate (an escape no UTF-8 text can carry on,
    into a metric label or a response) with a ``RefusedLiteral``; such a member name is a 400."""
    pending = [payload]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            for key, child in node.items():
                if (surrogate := _lone_surrogate(key)) is not None:
                    raise ApiError(400, f"body: a member name holds a lone surrogate ({surrogate})", param="body")
                if isinstance(child, str) and (surrogate := _lone_surrogate(child)) is not None:
                    node[key] = RefusedLiteral(f"the string holds a lone surrogate ({surrogate})")
                else:
                    pending.append(child)
        elif isinstance(node, list):
            for index, child in enumerate(node):
                if isinstance(child, str) and (surrogate := _lone_surrogate(child)) is not None:
                    node[index] = RefusedLiteral(f"the string holds a lone surrogate ({surrogate})")
                else:
                    pending.append(child)


def decode_json(raw: bytes) -> Any:
    """A request body as strict JSON: UTF-8 text (no byte-order mark), numbers that are 64-bit
    integers or finite doubles, strings of Unicode characters. Refuses with a 400 naming the body;
    a refused number or string is decoded as a ``RefusedLiteral`` for validation to report at its
    field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, f"body: not UTF-8 ({error})", param="body") from None
    if "\x00" in text:  # JSON text never holds a raw NUL; UTF-16 and UTF-32 text does
        raise ApiError(400, "body: holds NUL characters; JSON must be sent as UTF-8", param="body")
    try:
        payload = json.loads(text, parse_int=_int_literal, parse_float=_float_literal, parse_constant=_constant_literal)
    except json.JSONDecodeError as error:
        raise ApiError(400, f"body: not valid JSON ({error})", param="body") from None
    except RecursionError:
        raise ApiError(400, "body: JSON nested too deeply", param="body") from None
    if _SURROGATE_ESCAPE.search(text):  # only an escape makes a surrogate out of UTF-8 text
        _refuse_lone_surrogates(payload)
    return payload


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
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise ApiError(413, f"body: {declared} bytes is over the limit of {limit_bytes}", param="body")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise ApiError(413, f"body: over the limit of {limit_bytes} bytes", param="body")
        chunks.append(chunk)
    return b"".join(chunks)
