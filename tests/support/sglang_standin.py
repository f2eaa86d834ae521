"""A stand-in for an SGLang server's live-settings endpoints, following SGLang's source.

- ``POST /set_internal_state {"server_args": {...}}``: as ``Scheduler.set_internal_state``
  (``python/sglang/srt/managers/scheduler.py``) each scheduler walks the keys; the first key outside its
  allow-list is logged, none of the request's keys is applied, and the answer is still one ``true`` per
  scheduler (``TokenizerManager.set_internal_state`` returns ``[res.updated for res in responses]``).
- ``GET /get_server_info``: the server args with ``internal_states``, one dict per scheduler holding
  the global server args as they are now.

``allow`` is the allow-list: SGLang's today (``UPSTREAM_KEYS``) or one with the cap and the prefill budget
added, as SGLang #37661 proposes (``PROPOSED_KEYS``). ``endpoint=False`` serves neither path (404), as a
server from before the endpoints, ``set_endpoint=False`` one from before ``/set_internal_state``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

UPSTREAM_KEYS = frozenset({"pp_max_micro_batch_size", "speculative_accept_threshold_single",
                           "speculative_accept_threshold_acc"})  # fmt: skip
PROPOSED_KEYS = UPSTREAM_KEYS | {"max_running_requests", "chunked_prefill_size"}


@dataclass
class SGLangStandIn:
    allow: frozenset[str] = UPSTREAM_KEYS
    schedulers: int = 1  # data-parallel ranks: one answer and one internal state each
    endpoint: bool = True
    set_endpoint: bool = True  # False: /get_server_info only, as a release from before /set_internal_state
    server_args: dict[str, Any] = field(
        default_factory=lambda: {
            "model_path": "Qwen/Qwen2.5-7B-Instruct",
            "served_model_name": "qwen",
            "max_running_requests": 128,
            "chunked_prefill_size": 8192,
            "pp_max_micro_batch_size": None,
        }
    )
    posts: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def set_internal_state(self, server_args: dict[str, Any]) -> list[bool]:
        for key in server_args:
            if key not in self.allow:
                self.warnings.append(f"Updating {key} is not supported.")
                break
        else:
            self.server_args.update(server_args)
        return [True] * self.schedulers

    def server_info(self) -> dict[str, Any]:
        return {**self.server_args, "internal_states": [dict(self.server_args) for _ in range(self.schedulers)]}


@contextmanager
def sglang_standin(standin: SGLangStandIn, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``standin``; yields its base URL."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/get_server_info" or not standin.endpoint:
                self._answer(404, {"detail": "Not Found"})
                return
            with lock:
                self._answer(200, standin.server_info())

        def do_POST(self) -> None:
            if self.path != "/set_internal_state" or not (standin.endpoint and standin.set_endpoint):
                self._answer(404, {"detail": "Not Found"})
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
            server_args = body.get("server_args") if isinstance(body, dict) else None
            if not isinstance(server_args, dict):
                # FastAPI's validation of SetInternalStateReq
                self._answer(422, {"detail": [{"loc": ["body", "server_args"], "msg": "field required"}]})
                return
            with lock:
                standin.posts.append(server_args)
                self._answer(200, standin.set_internal_state(server_args))

        def log_message(self, format: str, *args: object) -> None:
            del format, args

    server = ThreadingHTTPServer((host, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="sglang-standin", daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
