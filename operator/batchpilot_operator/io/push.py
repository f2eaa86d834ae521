"""Push windows to runtime pods over their admin API (httpx, concurrent, bounded).

One :meth:`AdminClient.sync` brings one pod to a window, level-triggered: it
reads what the pod has in force (``GET /admin/window``) and writes
(``PUT``) only when the pod is behind, so a restarted pod heals on the next
tick without anyone remembering it was restarted.

Every call has an overall deadline (``timeout_s``: connecting, sending, the
headers and the whole body; a pod that drips its answer a byte at a time is cut
off there) and a body cap (``max_body_bytes``; the admin API answers a few
hundred bytes, so a longer answer is garbage and is not read further).

Failures and what happens to them (every one becomes the pod's PushResult; no
pod failure raises out of :meth:`AdminClient.sync`):

- connection refused or reset, 5xx: retried with exponential backoff (and
  jitter) a bounded number of times, then reported as ``error``; the next tick
  tries again.
- deadline passed: reported as ``error`` at once. The pod had its whole
  deadline, and a retry would hold the tick (every profile's) that much longer;
  the next tick tries again. So a pod that never answers costs a tick one
  deadline per call, not ``retries`` of them.
- an answer that cannot be used (a URL httpx refuses, a body over the cap, one
  that does not decode, JSON that is invalid or not a window state): reported as
  ``error`` at once, without retrying.
- 401: reported as ``unauthorized`` (a wrong token does not get better by retrying).
- 409: the pod holds a newer generation than ours; reported as ``conflict`` with
  the pod's window, so the caller can move past it.
- 422: the pod refuses the window (e.g. a cap above its KV capacity). The window
  is clamped once to the capacity the pod reports and sent again; if that is
  refused too, or nothing could be clamped, it is reported as ``refused`` and the
  caller must not send that generation to that pod again.

Every pod is independent: one slow or dead pod never delays another beyond the
shared concurrency limit.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from batchpilot_operator.io.outbound import BodyTooLarge, read_capped
from batchpilot_operator.io.outcomes import CONFLICT as CONFLICT  # re-exported: push results carry these
from batchpilot_operator.io.outcomes import ERROR as ERROR
from batchpilot_operator.io.outcomes import OK as OK
from batchpilot_operator.io.outcomes import REFUSED as REFUSED
from batchpilot_operator.io.outcomes import UNAUTHORIZED as UNAUTHORIZED
from batchpilot_runtime.contract.admin_api import (
    ADMIN_WINDOW_PATH,
    AdminError,
    LaneWindow,
    PodCapacity,
    WindowState,
    WindowUpdate,
)
from batchpilot_runtime.contract.window import Window

# The admin API answers a WindowState or an AdminError: a few hundred bytes, a few KiB with many lanes.
MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class PodTarget:
    """One runtime pod's admin endpoint."""

    name: str  # namespace/pod, or the runtime's name in local mode
    admin_url: str  # base URL, e.g. http://10.0.0.7:8081
    token: str | None = None


@dataclass(frozen=True)
class PushResult:
    pod: str
    outcome: str  # OK | CONFLICT | REFUSED | UNAUTHORIZED | ERROR
    state: WindowState | None = None  # what the pod reported last (None when it could not be read)
    pushed: bool = False  # a PUT was accepted during this sync
    clamped: Window | None = None  # the clamped window the pod accepted instead of ours
    detail: str = ""
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome == OK


@dataclass(frozen=True)
class _Answer:
    """One admin call's answer, its body read whole (under the cap)."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


class _Retryable(Exception):
    pass


class _Final(Exception):
    def __init__(self, outcome: str, detail: str, error: AdminError | None = None) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail
        self.error = error


def clamp_to_capacity(window: Window, capacity: PodCapacity) -> Window | None:
    """The window with its cap (and target) lowered to what the pod holds; None when nothing changes."""
    hard_cap = min(window.hard_cap, capacity.max_hard_cap)
    target = min(window.target_batch_size, hard_cap)
    if hard_cap == window.hard_cap and target == window.target_batch_size:
        return None
    return window.model_copy(update={"hard_cap": hard_cap, "target_batch_size": target})


def in_sync(state: WindowState, window: Window) -> bool:
    """True when the pod runs this generation (or a newer one) of the window."""
    return state.window.generation >= window.generation


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx's interface on aiohttp's connection pool.

    httpcore's pool rescans every connection (with a readability syscall each) for every
    request it assigns, which made 8,000 admin calls per interval take minutes in the scale
    benchmark; aiohttp's pool does not. Errors are mapped to httpx's, so callers see httpx only.
    The body is streamed (the caller reads it under its cap and deadline, then closes it).
    """

    def __init__(self, *, limit: int) -> None:
        self._limit = limit
        self._session: Any = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=self._limit, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True)
        timeouts = request.extensions.get("timeout") or {}
        read_s = timeouts.get("read") or timeouts.get("connect")
        timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.get("connect"), sock_read=read_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        try:
            response = await self._session.request(
                request.method, str(request.url), headers=headers, data=await request.aread(), timeout=timeout
            )
        except (TimeoutError, aiohttp.ClientError) as error:
            raise _as_httpx_error(error, request) from None
        # aiohttp hands over the body decoded and de-chunked: its framing headers no longer apply.
        dropped = {"content-encoding", "transfer-encoding"}
        if "content-encoding" in response.headers:
            dropped.add("content-length")
        response_headers = [(k, v) for k, v in response.headers.items() if k.lower() not in dropped]
        return httpx.Response(
            response.status, headers=response_headers, stream=_AiohttpStream(response, request), request=request
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _AiohttpStream(httpx.AsyncByteStream):
    """An aiohttp response body as httpx's stream; closed before its end, it drops the connection."""

    def __init__(self, response: Any, request: httpx.Request) -> None:
        self._response = response
        self._request = request
        self._finished = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        import aiohttp

        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as error:
            raise _as_httpx_error(error, self._request) from None
        self._finished = True

    async def aclose(self) -> None:
        if self._finished:
            self._response.release()  # read to its end: the connection goes back to the pool
        else:
            self._response.close()  # a body left unread (over the cap, past the deadline) is not drained


def _as_httpx_error(error: Exception, request: httpx.Request) -> httpx.TransportError:
    import aiohttp

    if isinstance(error, TimeoutError):
        return httpx.ReadTimeout(str(error) or "timed out", request=request)
    if isinstance(error, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(error), request=request)
    return httpx.ReadError(f"{type(error).__name__}: {error}", request=request)


class AdminClient:
    """Admin calls to runtime pods. ``timeout_s`` is the deadline of one call, from the first byte sent to the
    last byte of the body (httpx's per-phase timeouts are set to it as well); ``max_body_bytes`` caps an answer.
    A sync makes at most four calls (GET, PUT, and after a 422 a GET and a clamped PUT), so a pod that never
    answers holds its sync for one ``timeout_s``, and any pod for at most four (plus the backoffs of 5xx)."""

    def __init__(
        self,
        *,
        timeout_s: float = 2.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
        concurrency: int = 64,
        max_body_bytes: int = MAX_BODY_BYTES,
        client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if retries < 1:
            raise ValueError(f"retries must be >= 1, got {retries}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._semaphore = asyncio.Semaphore(concurrency)
        self._client = client or httpx.AsyncClient(timeout=timeout_s, transport=AiohttpTransport(limit=concurrency))
        self._sleep = sleep
        self.requests_total = 0

    async def aclose(self) -> None:
        await self._client.aclose()

    def _headers(self, target: PodTarget) -> dict[str, str]:
        return {"Authorization": f"Bearer {target.token}"} if target.token else {}

    async def _exchange(self, method: str, url: str, body: str | None, headers: dict[str, str]) -> _Answer:
        """One request and its whole body, within the deadline and under the cap."""
        async with asyncio.timeout(self.timeout_s):
            request = self._client.build_request(method, url, content=body, headers=headers)
            response = await self._client.send(request, stream=True)
            try:
                return _Answer(response.status_code, await read_capped(response, self.max_body_bytes))
            finally:
                await response.aclose()

    async def _call(self, method: str, target: PodTarget, body: str | None = None) -> _Answer:
        """One request with bounded retries on transport errors and 5xx; _Final when retrying is futile or slow.

        This is the I/O boundary: every way a pod can fail a call becomes _Retryable or _Final here.
        """
        url = target.admin_url.rstrip("/") + ADMIN_WINDOW_PATH
        headers = self._headers(target)
        if body is not None:
            headers["Content-Type"] = "application/json"
        last_error = ""
        for attempt in range(self.retries):
            if attempt:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                await self._sleep(delay * (0.5 + random.random() / 2))  # jitter: pods do not retry in lockstep
            try:
                async with self._semaphore:
                    self.requests_total += 1
                    answer = await self._exchange(method, url, body, headers)
            except (TimeoutError, httpx.TimeoutException):
                raise _Final(
                    ERROR, f"{method} {url}: timed out: no complete answer within {self.timeout_s:g} s"
                ) from None
            except (httpx.InvalidURL, httpx.UnsupportedProtocol) as error:
                raise _Final(ERROR, f"{method} {url}: invalid URL: {error}") from None
            except httpx.TransportError as error:
                last_error = f"{method} {url}: {type(error).__name__}: {error or 'connection failed'}"
                continue
            except BodyTooLarge as error:
                raise _Final(ERROR, f"{method} {url}: {error}") from None
            except httpx.HTTPError as error:  # the rest: a body that does not decode, a malformed answer
                raise _Final(ERROR, f"{method} {url}: {type(error).__name__}: {error}") from None
            if answer.status_code >= 500:
                last_error = f"{method} {url}: HTTP {answer.status_code}: {answer.text[:200]}"
                continue
            return answer
        raise _Retryable(f"{last_error} ({self.retries} attempts)")

    @staticmethod
    def _admin_error(answer: _Answer) -> AdminError | None:
        try:
            return AdminError.model_validate_json(answer.content)
        except ValidationError:
            return None

    def _check(self, answer: _Answer) -> WindowState:
        if answer.status_code == 200:
            try:
                return WindowState.model_validate_json(answer.content)
            except ValidationError as error:
                raise _Final(ERROR, f"unreadable window state: {error.errors()[0]['msg']}") from None
        admin_error = self._admin_error(answer)
        detail = admin_error.detail if admin_error else answer.text[:300]
        if answer.status_code in (401, 403):
            raise _Final(UNAUTHORIZED, f"HTTP {answer.status_code}: {detail}", admin_error)
        if answer.status_code == 409:
            raise _Final(CONFLICT, f"HTTP 409: {detail}", admin_error)
        if answer.status_code == 422:
            raise _Final(REFUSED, f"HTTP 422: {detail}", admin_error)
        raise _Final(ERROR, f"HTTP {answer.status_code}: {detail}", admin_error)

    async def get_state(self, target: PodTarget) -> WindowState:
        """The pod's window in force; raises PushFailed."""
        try:
            return self._check(await self._call("GET", target))
        except _Retryable as error:
            raise PushFailed(ERROR, str(error)) from None
        except _Final as error:
            raise PushFailed(error.outcome, error.detail) from None

    async def _put(self, target: PodTarget, window: Window, lanes: Sequence[LaneWindow] | None) -> WindowState:
        update = WindowUpdate(window=window, lanes=list(lanes) if lanes is not None else None)
        return self._check(await self._call("PUT", target, update.model_dump_json(by_alias=True, exclude_none=True)))

    async def sync(
        self,
        target: PodTarget,
        window: Window,
        lanes: Sequence[LaneWindow] | None = None,
        *,
        known_state: WindowState | None = None,
        verify: bool = True,
    ) -> PushResult:
        """Bring one pod to ``window`` when it is behind. Never raises for pod failures.

        ``verify``: read the pod's window first and write only when it is behind (level-triggered);
        without it (the caller knows the pod is behind, e.g. the window just changed) the PUT goes
        out at once and the pod is read only when it refuses.
        """
        attempts_before = self.requests_total
        state = known_state
        try:
            if state is None and verify:
                state = self._check(await self._call("GET", target))
            if state is not None and in_sync(state, window):
                if state.window.generation > window.generation:
                    return PushResult(target.name, CONFLICT, state, detail="pod holds a newer generation")
                return PushResult(target.name, OK, state, attempts=self.requests_total - attempts_before)
            try:
                new_state = await self._put(target, window, lanes)
                return PushResult(
                    target.name, OK, new_state, pushed=True, attempts=self.requests_total - attempts_before
                )
            except _Final as refusal:
                if refusal.outcome not in (REFUSED, CONFLICT):
                    raise
                if state is None:  # learn what the pod holds and can hold
                    state = self._check(await self._call("GET", target))
                if refusal.outcome == CONFLICT:
                    raise
                clamped = clamp_to_capacity(window, state.capacity)
                if clamped is None:
                    raise
                try:
                    new_state = await self._put(target, clamped, lanes)
                except _Final as second:
                    raise _Final(
                        REFUSED, f"{refusal.detail}; clamped to capacity and refused again: {second.detail}"
                    ) from None
                return PushResult(
                    target.name,
                    OK,
                    new_state,
                    pushed=True,
                    clamped=clamped,
                    detail=f"{refusal.detail}; clamped hardCap to the pod's capacity {state.capacity.max_hard_cap}",
                    attempts=self.requests_total - attempts_before,
                )
        except _Retryable as error:
            return PushResult(
                target.name, ERROR, state, detail=str(error), attempts=self.requests_total - attempts_before
            )
        except _Final as error:
            in_force = error.error.window_in_force if error.error else None
            if error.outcome == CONFLICT and state is not None and in_force is not None:
                state = state.model_copy(update={"window": in_force})
            return PushResult(
                target.name, error.outcome, state, detail=error.detail, attempts=self.requests_total - attempts_before
            )

    async def sync_all(self, jobs: Sequence[tuple[PodTarget, Window, Sequence[LaneWindow] | None]]) -> list[PushResult]:
        """Sync many pods concurrently (bounded by the client's concurrency)."""
        return list(await asyncio.gather(*(self.sync(t, w, lanes) for t, w, lanes in jobs)))


class PushFailed(Exception):
    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail
