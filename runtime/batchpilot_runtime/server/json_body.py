"""Strict JSON request bodies and errors in OpenAI's shape, without a web framework.

Shared by the runtime's apps (through ``request_body``, which adds the fastapi parts) and by the
gate's raw ASGI proxy, so that both refuse the same bodies with the same status and words. A body
is decoded once into plain JSON values; a number or string that cannot be carried on (past 64
bits, not finite, a lone surrogate) is kept as a ``RefusedLiteral`` so that whoever reads the
body can report it at its field rather than fail the whole body.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

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

    def body(self) -> dict[str, Any]:
        """OpenAI's error object (``openai_schema.ErrorResponse``), as plain JSON values."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class RefusedLiteral:
    """Stands in for a value ``decode_json`` refuses (a number out of range, NaN, a string with a
    lone surrogate) so that validation reports it at its field; a field the model ignores may hold one."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"RefusedLiteral({self.reason!r})"


def declared_length_error(declared: str | None, limit_bytes: int = MAX_BODY_BYTES) -> ApiError | None:
    """The 413 for a ``Content-Length`` over ``limit_bytes``, answered before any of the body is read."""
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        return ApiError(413, f"body: {declared} bytes is over the limit of {limit_bytes}", param="body")
    return None


def over_limit_error(limit_bytes: int = MAX_BODY_BYTES) -> ApiError:
    """The 413 for a body that grew past ``limit_bytes`` while it was read (no length was declared)."""
    return ApiError(413, f"body: over the limit of {limit_bytes} bytes", param="body")


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


def first_refused(payload: Any) -> ApiError | None:
    """The 400 for the first ``RefusedLiteral`` of a decoded body in document order, at its path
    (``prompt.1``; ``body`` for the whole), in the words validation would use; None when it holds none."""
    if isinstance(payload, RefusedLiteral):
        return ApiError(400, f"body: {payload.reason}", param="body")
    # The containers being walked, each with its members still to see: a path is built per
    # container, and a container of scalars only (a prompt's token ids) is passed over in C.
    stack: list[tuple[tuple[int | str, ...], Iterator[tuple[int | str, Any]]]] = [((), _members(payload))]
    while stack:
        path, members = stack[-1]
        for key, child in members:
            if isinstance(child, RefusedLiteral):
                field = (*path, key)
                return ApiError(400, f"{'.'.join(map(str, field))}: {child.reason}", param=str(field[0]))
            if isinstance(child, dict | list):
                stack.append(((*path, key), _members(child)))
                break
        else:
            stack.pop()
    return None


_WALKED_TYPES = frozenset({RefusedLiteral, dict, list})


def _members(node: Any) -> Iterator[tuple[int | str, Any]]:
    """(key or index, value) of a container's members; none when no member needs a look."""
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    if _WALKED_TYPES.isdisjoint(map(type, values)):
        return iter(())
    return iter(node.items()) if isinstance(node, dict) else enumerate(node)
