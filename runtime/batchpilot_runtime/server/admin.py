"""The admin app (its own port): read and replace the batching window.

Every call on ``/admin/window`` needs the bearer token, reads as well as writes: without a valid
one it is 401, and nothing about the pod (window, capacity, model) is told. ``GET`` answers the
``WindowState`` in force. ``PUT`` takes an ``admin_api.WindowUpdate``, validated strictly (numbers as
JSON numbers, never strings; a generation at most ``MAX_GENERATION``): 422 for an invalid body or
a window the pod cannot hold, 409 for a generation older than the one in force, 200 with the
applied ``WindowState`` otherwise. The window applies at the engine's next step boundary (the
gate's: at its next admission).

The app serves any ``WindowHolder``: the runtime's ``ServingContext`` and ``batchpilot-gate``, so
that the operator tunes both through the very same API. Nothing here imports torch.
"""

from __future__ import annotations

import hmac
import logging
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from batchpilot_runtime.contract.admin_api import (
    ADMIN_WINDOW_PATH,
    AdminError,
    InvalidWindowError,
    StaleGenerationError,
    WindowState,
    WindowUpdate,
)
from batchpilot_runtime.server.json_body import ApiError, decode_json
from batchpilot_runtime.server.logs import RequestIdMiddleware
from batchpilot_runtime.server.openapi_doc import allow_every_method, document_bodies, json_request_body
from batchpilot_runtime.server.request_body import add_client_gone_handler, error_message, read_body

logger = logging.getLogger("batchpilot.admin")

MAX_ADMIN_BODY_BYTES = 1024 * 1024


class WindowHolder(Protocol):
    """What the admin app reads and replaces the window of."""

    @property
    def admin_token(self) -> str: ...

    def window_in_force(self) -> WindowState | None:
        """None while not ready (503)."""
        ...

    def update_window(self, update: WindowUpdate) -> WindowState:
        """Apply ``update``: ``StaleGenerationError`` (409), ``InvalidWindowError`` (422)."""
        ...


def _refusal(
    status: int,
    error: str,
    detail: str,
    ctx: WindowHolder,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    state = ctx.window_in_force()
    in_force = state.window if state is not None else None
    body = AdminError(error=error, detail=detail, window_in_force=in_force)
    return JSONResponse(body.model_dump(mode="json", by_alias=True), status_code=status, headers=headers)


def describe_validation_error(error: ValidationError) -> str:
    """Each problem as ``field.path: message``, with the wire (camelCase) field names."""
    lines = []
    for item in error.errors(include_url=False):
        path = ".".join(str(p) for p in item["loc"]) or "body"
        lines.append(f"{path}: {error_message(item)}")
    return "; ".join(lines)


def _token_ok(header: str | None, token: str) -> bool:
    if header is None:
        return False
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(presented.strip().encode(), token.encode())


def _unauthorized() -> JSONResponse:
    """401, telling nothing about the pod (no window in force): the caller has not proven who it is."""
    body = AdminError(error="unauthorized", detail="a valid 'Authorization: Bearer <token>' header is required")
    return JSONResponse(
        body.model_dump(mode="json", by_alias=True, exclude_none=True),
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def create_admin_app(ctx: WindowHolder, title: str = "batchpilot runtime admin") -> FastAPI:
    app = FastAPI(title=title, version="0.1.0", docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    add_client_gone_handler(app)

    @app.get(
        ADMIN_WINDOW_PATH,
        response_model=WindowState,
        response_model_by_alias=True,
        responses={401: {"model": AdminError}, 503: {"model": AdminError}},
    )
    async def get_window(request: Request) -> JSONResponse:
        if not _token_ok(request.headers.get("authorization"), ctx.admin_token):
            return _unauthorized()
        state = ctx.window_in_force()
        if state is None:
            return JSONResponse({"error": "loading", "detail": "the model is still loading"}, status_code=503)
        return JSONResponse(state.model_dump(mode="json", by_alias=True))

    @app.put(
        ADMIN_WINDOW_PATH,
        response_model=WindowState,
        responses={
            401: {"model": AdminError},
            409: {"model": AdminError},
            413: {"model": AdminError},
            422: {"model": AdminError},
            503: {"model": AdminError},
        },
        openapi_extra=json_request_body(WindowUpdate, by_alias=True),
    )
    async def put_window(request: Request) -> JSONResponse:
        # 1. Authenticate before reading anything else.
        if not _token_ok(request.headers.get("authorization"), ctx.admin_token):
            return _unauthorized()
        if ctx.window_in_force() is None:
            return _refusal(503, "loading", "the model is still loading", ctx)
        # 2. Decode the body as strict JSON and validate it against the wire model.
        try:
            raw = await read_body(request, MAX_ADMIN_BODY_BYTES)
        except ApiError as error:
            return _refusal(413, "too_large", error.message, ctx)
        try:
            # Strict: a window is sent as JSON numbers; "16" for a cap is a client's bug, not a cap.
            update = WindowUpdate.model_validate(decode_json(raw), strict=True)
        except ApiError as error:
            return _refusal(422, "invalid_window", error.message, ctx)
        except ValidationError as error:
            return _refusal(422, "invalid_window", describe_validation_error(error), ctx)
        # 3. Let the engine (or the gate) decide against what is in force and what the pod can hold.
        try:
            state = ctx.update_window(update)
        except StaleGenerationError as error:
            return _refusal(409, "stale_generation", str(error), ctx)
        except InvalidWindowError as error:
            return _refusal(422, "invalid_window", str(error), ctx)
        logger.info(
            "window updated", extra={"window": state.window.describe(), "lanes": [lane.name for lane in state.lanes]}
        )
        return JSONResponse(state.model_dump(mode="json", by_alias=True))

    document_bodies(app, [(WindowUpdate, True)])
    allow_every_method(app)
    app.add_middleware(RequestIdMiddleware, logger_name="batchpilot.access")
    return app
