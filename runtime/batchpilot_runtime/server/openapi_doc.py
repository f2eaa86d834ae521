"""What the serving and admin apps' OpenAPI documents say beyond what FastAPI derives: the request
bodies their routes read by hand (through the strict decoder, so FastAPI never sees the model) and
every status and media type a route answers with, so that a client, and the API fuzzer CI runs
(tests/integration/test_api_fuzz.py), can hold each answer to the document; and a 405 whose
``Allow`` header is true to it.

A body's nested models go into ``components/schemas`` under ``Body_<Model>`` (``document_bodies``):
pydantic puts them under the schema's own ``$defs``, which an OpenAPI reader resolves nowhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchpilot_runtime.server.openai_schema import ErrorResponse

_BODY_REF = "#/components/schemas/Body_{model}"

PLAIN_TEXT = {"text/plain": {"schema": {"type": "string"}}}
_ERROR = {"model": ErrorResponse}
# One event of a stream (as OpenAPI 3.2's itemSchema would say it): ``data`` is a chunk's JSON, or
# ``[DONE]`` to end it.
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
# What the completion routes answer besides a completion: a stream of server-sent events when asked
# to stream, and refusals in OpenAI's error shape.
SERVING_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}}},
    400: _ERROR,
    404: _ERROR,
    413: _ERROR,
    429: _ERROR,
    503: _ERROR,
}


def _body_schema(model: type[BaseModel], by_alias: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    schema = model.model_json_schema(by_alias=by_alias, ref_template=_BODY_REF)
    return schema, schema.pop("$defs", {})


def allow_every_method(app: FastAPI) -> None:
    """Answer 405 with an ``Allow`` header naming every method the path serves (RFC 9110 15.5.6).
    Starlette names only those of the first route whose path matched, so ``/admin/window``, served
    by two routes, said ``GET, HEAD`` to a ``DELETE`` although it takes ``PUT`` too."""

    @app.exception_handler(StarletteHTTPException)
    async def _with_allow(request: Request, error: StarletteHTTPException) -> Response:
        if error.status_code != 405:
            return await http_exception_handler(request, error)
        path = request.url.path
        routes = [r for r in app.routes if isinstance(r, APIRoute) and r.path_regex.match(path)]
        methods = {method for route in routes for method in route.methods or ()}
        allowed = ", ".join(sorted(methods | ({"HEAD"} if "GET" in methods else set())))
        return JSONResponse({"detail": error.detail}, status_code=405, headers={"Allow": allowed})


def json_request_body(model: type[BaseModel], *, by_alias: bool = False) -> dict[str, Any]:
    """A route's ``openapi_extra`` for a JSON body of ``model`` (its nested models referenced in the
    components; ``document_bodies`` puts them there)."""
    schema, _ = _body_schema(model, by_alias)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def document_bodies(app: FastAPI, bodies: Sequence[tuple[type[BaseModel], bool]]) -> None:
    """Add the nested models of each ``(model, by_alias)`` body to ``app``'s document, once, when it is
    first built."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model, by_alias in bodies:
            _, nested = _body_schema(model, by_alias)
            schemas.update({f"Body_{name}": schema for name, schema in nested.items()})
        return document

    app.openapi = openapi  # type: ignore[method-assign]
