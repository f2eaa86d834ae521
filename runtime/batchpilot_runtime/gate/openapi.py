"""The OpenAPI document of the gate's serving port (``GET /openapi.json``), written out by hand:
the port is raw ASGI (proxy.py), so nothing derives it.

It says what the gate itself guarantees: which paths and methods it serves, what it refuses before
the engine sees a request (400 for a body the runtime's strict decoder refuses, 413, 429 with
Retry-After, 431, 503 while draining, 502 when the engine cannot be reached), and that an admitted
request's answer is the engine's, passed through as it came (JSON, or server-sent events when
streamed). A request body is any JSON the decoder accepts: its fields are the engine's to judge.
"""

from __future__ import annotations

import json
from typing import Any

# Path -> the methods it serves (a 405 names them in Allow).
SERVED_METHODS: dict[str, tuple[str, ...]] = {
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/v1/models": ("GET",),
    "/health": ("GET",),
    "/healthz": ("GET",),
    "/readyz": ("GET",),
    "/metrics": ("GET",),
    "/openapi.json": ("GET",),
}

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}
_JSON_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}
# The engine's answer, as it came: any JSON, or a stream of events.
_ENGINE_ANSWER = {
    "content": {
        "application/json": {"schema": {}},
        "text/event-stream": {
            "schema": {
                "type": "object",
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                "required": ["data"],
            }
        },
    }
}


def _admitted(summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"description": "An OpenAI request for the engine."}}},
            },
            "parameters": [
                {"name": "X-Batchpilot-Lane", "in": "header", "required": False, "schema": {"type": "string"}}
            ],
            "responses": {
                "200": {"description": "The engine's answer.", **_ENGINE_ANSWER},
                "400": {"description": "Refused: a body the decoder refuses, or an unknown lane.", **_JSON_ERROR},
                "4XX": {"description": "The engine's refusal, passed through.", "content": {"application/json": {}}},
                "413": {"description": "The body is over the limit.", **_JSON_ERROR},
                "429": {"description": "The waiting queue is full (Retry-After).", **_JSON_ERROR},
                "431": {"description": "Headers over the limit.", **_JSON_ERROR},
                "502": {"description": "The engine could not be reached.", **_JSON_ERROR},
                "503": {"description": "Draining.", **_JSON_ERROR},
                "5XX": {"description": "The engine's failure, passed through.", "content": {"application/json": {}}},
            },
        }
    }


def _get(summary: str, ok: dict[str, Any], *, upstream: bool = False) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", **ok}}
    if upstream:
        responses["502"] = {"description": "The engine could not be reached.", **_JSON_ERROR}
        responses["5XX"] = {"description": "The engine's answer, passed through.", "content": {"application/json": {}}}
    return {"get": {"summary": summary, "responses": responses}}


def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "batchpilot-gate",
            "version": "0.1.0",
            "description": "The batching window enforced in front of an OpenAI-compatible engine.",
        },
        "paths": {
            "/v1/completions": _admitted("A completion, admitted under the window and passed to the engine."),
            "/v1/chat/completions": _admitted("A chat completion, admitted under the window and passed to the engine."),
            "/v1/models": _get(
                "The engine's models, passed through.", {"content": {"application/json": {}}}, upstream=True
            ),
            "/health": _get("The engine's health, passed through.", {"content": {}}, upstream=True),
            "/healthz": _get("The gate is alive.", _TEXT),
            "/readyz": {
                "get": {
                    "summary": "The gate is ready: not draining, and the engine's /health answers 200.",
                    "responses": {
                        "200": {"description": "Ready", **_TEXT},
                        "503": {"description": "Not ready", **_JSON_ERROR},
                    },
                }
            },
            "/metrics": _get("The gate's own metrics (Prometheus text).", _TEXT),
            "/openapi.json": _get("This document.", {"content": {"application/json": {}}}),
        },
        "components": {"schemas": {"Error": _ERROR}},
    }


DOCUMENT_BYTES = json.dumps(document()).encode()
