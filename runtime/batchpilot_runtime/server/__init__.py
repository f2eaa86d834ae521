"""The runtime's HTTP layer: the OpenAI-compatible serving app, the admin app, metrics and logs.

Everything here is a thin layer around ``engine.AsyncEngine``: handlers validate, enqueue
and await token events; the engine thread owns the scheduler, the model and the KV cache.

Modules:
- ``app``: ``POST /v1/completions`` (SSE streaming, stop strings, lanes), ``GET /v1/models``,
  ``/healthz``, ``/readyz``, ``/metrics`` on the serving port.
- ``chat``: ``POST /v1/chat/completions`` on the model's chat template (``chat_template``: the
  sandboxed Jinja rendering, ChatML by default).
- ``generation``: one accepted request from the engine's token events to the client (streamed
  or whole), shared by the OpenAI routes; ``json_body``: strict JSON and OpenAI's error
  shape, without a web framework (the gate uses it too); ``request_body``: reading a body, errors
  naming the field.
- ``admin``: ``GET``/``PUT /admin/window`` on the admin port (bearer token).
- ``metrics``: ``MetricsExporter``, the engine's ``EngineObserver``, exporting every metric
  of ``metric_names`` from its own registry.
- ``text``: detokenization and stop strings (pure).
- ``header_limits``: 431 past the limits on a request's head, on every port of the runtime and
  the gate (``listen.http_server`` applies them).
- ``logs``: JSON log lines carrying the request id (``X-Request-Id`` honoured or generated).
- ``runtime``: one process = engine + both ports on one event loop; SIGTERM drains.
- ``config``: ``ServeConfig`` and lane specs (pure).
- ``ready``: ``RuntimeInfo``, the ready file a launcher reads (light: no torch, no web stack).

Why FastAPI on uvicorn: the OpenAI clients and the operator speak plain HTTP/1.1 JSON and
SSE, which both do well; pydantic (already the wire contract's library) validates bodies
and gives the OpenAPI schema the fuzz tests read; uvicorn's ``Server`` can run twice on one
asyncio loop (serving and admin ports in one process, one drain) and takes pre-bound
sockets, so port 0 works without a probe-then-bind race. The hot path does not go through
FastAPI's dependency machinery: the completions handler reads and validates the body itself
(so every error names its field and malformed JSON is a 400, not a 422 in FastAPI's shape),
and streams through a small ASGI response that notices a client hang-up at once rather than
at the next write. Alternatives weighed: aiohttp (no pydantic/OpenAPI integration, its own
server loop), grpc (OpenAI clients need HTTP), Granian or Hypercorn (no gain on one CPU
worker per pod, less common to operate).

How another process starts and finds a runtime: ``batchpilot-runtime serve --port 0
--admin-port 0 --ready-file PATH [--admin-token-file TOKEN]``; once both ports answer and
the model is loaded, PATH holds ``RuntimeInfo`` as JSON (pid, model, serve_url, admin_url,
admin_token_file). Without ``--admin-token-file`` a random token is written to a new
private temporary directory (0700/0600) whose path is logged and put in the ready file:
the admin port never runs without a token. ``tests/integration/runtime_process.py`` wraps
this for tests and the demo, and ``runtime.RuntimeThread`` runs a runtime in-process.
"""
