"""SGLang's live settings: ``POST /set_internal_state``, and what the server really took, read back.

The contract, from SGLang's source:

- ``python/sglang/srt/entrypoints/http_server.py``: ``/set_internal_state`` (POST or PUT) takes
  ``{"server_args": {KEY: VALUE, ...}}`` and answers 200 with what
  ``TokenizerManager.set_internal_state`` returns: one boolean per data-parallel scheduler,
  ``[res.updated for res in responses]`` (``managers/tokenizer_communicator_mixin.py``).
- ``python/sglang/srt/managers/scheduler.py``, ``Scheduler.set_internal_state``: only keys of an
  allow-list are taken (today ``pp_max_micro_batch_size`` and the two speculative-decoding
  thresholds; ``max_running_requests`` and ``chunked_prefill_size`` are proposed, SGLang #37661).
  A request naming any other key is logged ("Updating K is not supported."), *none* of its keys is
  applied, and the answer still says ``updated=True``.
- ``GET /get_server_info`` answers the server args with ``internal_states``: one dict per scheduler
  (``Scheduler.get_internal_state``), holding the global server args as they are now.

So the answer cannot say whether a key was taken: each key is sent alone (one unknown key would
void the others) and the server args are read back; a key is live when every scheduler holds the
value sent. Which keys a server takes is found by asking it this way, once per server (a
:class:`LiveKeys` per pod); a key it refuses is not sent to it again until it restarts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from batchpilot_operator.io.outbound import BodyTooLarge, read_capped

SET_PATH = "/set_internal_state"
INFO_PATH = "/get_server_info"
# /get_server_info carries every server arg and each scheduler's state: tens of KiB.
MAX_BODY_BYTES = 4 << 20


class SGLangError(Exception):
    """The server could not be asked (unreachable, too slow, an answer that is not SGLang's)."""


@dataclass
class LiveKeys:
    """What one server showed about its keys: taken live, or not (with the value it kept)."""

    live: set[str] = field(default_factory=set)
    refused: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SGLangApplied:
    """One sync of a server: the settings it now holds as sent, and those it does not take live."""

    applied: dict[str, int]
    not_live: dict[str, int]  # sent (or refused before) and not taken: they need a restart
    held: dict[str, Any]  # what the server holds for each key of not_live (None: not reported)

    @property
    def complete(self) -> bool:
        return not self.not_live

    def describe_not_live(self) -> str:
        return ", ".join(f"{k}={v} (server holds {self.held.get(k)!r})" for k, v in sorted(self.not_live.items()))


class SGLangClient:
    """Live settings of SGLang servers; ``timeout_s`` bounds each call, the whole answer included."""

    def __init__(
        self, *, timeout_s: float = 2.0, max_body_bytes: int = MAX_BODY_BYTES, client: httpx.AsyncClient | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self._client = client  # made on first use: an operator with no SGLang profile opens nothing
        self.requests_total = 0

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _call(self, method: str, url: str, body: Mapping[str, Any] | None = None) -> tuple[int, Any]:
        self.requests_total += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                if self._client is None:
                    self._client = httpx.AsyncClient(timeout=self.timeout_s)
                request = self._client.build_request(method, url, json=body)
                response = await self._client.send(request, stream=True)
                try:
                    content = await read_capped(response, self.max_body_bytes)
                finally:
                    await response.aclose()
        except (TimeoutError, httpx.TimeoutException):
            raise SGLangError(f"{method} {url}: no complete answer within {self.timeout_s:g} s") from None
        except (httpx.HTTPError, BodyTooLarge) as error:
            raise SGLangError(f"{method} {url}: {type(error).__name__}: {error}") from None
        try:
            return response.status_code, json.loads(content) if content else None
        except ValueError:
            return response.status_code, None

    async def server_args(self, base_url: str) -> list[dict[str, Any]]:
        """Each scheduler's server args as they are now (``internal_states`` of ``/get_server_info``)."""
        url = base_url.rstrip("/") + INFO_PATH
        status, body = await self._call("GET", url)
        if status != 200 or not isinstance(body, dict):
            raise SGLangError(f"GET {url}: HTTP {status}, not SGLang's server info")
        states = body.get("internal_states")
        if isinstance(states, dict):
            states = [states]
        if not isinstance(states, list) or not states or not all(isinstance(s, dict) for s in states):
            raise SGLangError(f"GET {url}: no internal_states in the answer")
        return states

    async def apply(self, base_url: str, settings: Mapping[str, int], known: LiveKeys) -> SGLangApplied:
        """Bring one server to ``settings`` where it takes them live; ``known`` is updated with what it showed.

        Keys the server holds already are not sent; keys it refused before are not sent again. Raises
        :class:`SGLangError` when the server cannot be asked at all."""
        held_by_rank = await self.server_args(base_url)
        to_send = {k: v for k, v in settings.items() if k not in known.refused and not _held(held_by_rank, k, v)}
        set_url = base_url.rstrip("/") + SET_PATH
        for key, value in to_send.items():
            status, body = await self._call("POST", set_url, {"server_args": {key: value}})
            if status == 404:
                # A server without the endpoint takes nothing live.
                known.refused.update({k: None for k in settings})
                break
            if status != 200 or not isinstance(body, list):
                raise SGLangError(f"POST {set_url}: HTTP {status}: {str(body)[:200]}")
        if to_send:
            held_by_rank = await self.server_args(base_url)
        applied: dict[str, int] = {}
        not_live: dict[str, int] = {}
        for key, value in settings.items():
            if _held(held_by_rank, key, value):
                applied[key] = value
                known.live.add(key)
                known.refused.pop(key, None)
            else:
                not_live[key] = value
                if key in to_send or key not in known.live:
                    known.refused[key] = held_by_rank[0].get(key)
        held = {k: held_by_rank[0].get(k) for k in not_live}
        return SGLangApplied(applied, not_live, held)


def _held(states: list[dict[str, Any]], key: str, value: int) -> bool:
    """Every scheduler holds ``value`` for ``key``."""
    return all(state.get(key) == value for state in states)
