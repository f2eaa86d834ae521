"""What the serving and admin apps share: the engine, the tokenizer, the metrics, and the
process's lifecycle flags. One object per runtime; only the event loop's thread touches it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from batchpilot_runtime.contract.admin_api import WindowState, WindowUpdate
from batchpilot_runtime.server.metrics import MetricsExporter

if TYPE_CHECKING:
    from batchpilot_runtime.engine.async_engine import AsyncEngine

logger = logging.getLogger("batchpilot.server")


class TextCodec(Protocol):
    """The part of a tokenizer the HTTP layer needs."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...  # EOS and the other tokens that end a reply

    @property
    def chat_template(self) -> str | None: ...  # the checkpoint's Jinja chat template

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass
class LoadedModel:
    engine: AsyncEngine
    tokenizer: TextCodec
    max_model_len: int  # prompt + output tokens of one request
    on_stop: Callable[[], None] | None = None  # after the engine has stopped (closes the step log)


@dataclass
class ServingContext:
    model_name: str
    metrics: MetricsExporter
    admin_token: str
    loaded: LoadedModel | None = None  # None while the model loads
    draining: bool = False
    inflight_requests: int = 0  # accepted completions whose response has not ended
    no_inflight: asyncio.Event = field(default_factory=asyncio.Event)
    created_unix_s: int = field(default_factory=lambda: int(time.time()))
    stall_reported: bool = False  # the log says "engine stalled" once per stall, when a probe first sees it

    def __post_init__(self) -> None:
        self.no_inflight.set()

    def request_started(self) -> None:
        self.inflight_requests += 1
        self.no_inflight.clear()

    def request_ended(self) -> None:
        self.inflight_requests -= 1
        if self.inflight_requests == 0:
            self.no_inflight.set()

    def window_changed(self, state: WindowState) -> None:
        self.metrics.on_window(state)

    def window_in_force(self) -> WindowState | None:
        """The window and lanes in force; None while the model loads (the admin API's 503)."""
        return None if self.loaded is None else self.loaded.engine.window_state()

    def update_window(self, update: WindowUpdate) -> WindowState:
        """Stage ``update`` on the engine (its rules: ``AsyncEngine.update_window``) and export it."""
        if self.loaded is None:
            raise RuntimeError("update_window called while the model loads")
        state = self.loaded.engine.update_window(update)
        self.window_changed(state)
        return state

    def not_live_reason(self) -> str | None:
        """Why /healthz fails: the engine loop died, or stalled (see ``watchdog``). Never while the
        model loads or the process drains, so that a slow load or drain is not restarted."""
        loaded = self.loaded
        if loaded is None or self.draining:
            return None
        if not loaded.engine.is_alive():
            return "engine loop died"
        return self._stall_reason(loaded)

    def not_ready_reason(self) -> str | None:
        if self.draining:
            return "draining"
        if self.loaded is None:
            return "model loading"
        if not self.loaded.engine.is_alive():
            return "engine loop not running"
        return self._stall_reason(self.loaded)

    def _stall_reason(self, loaded: LoadedModel) -> str | None:
        reason = loaded.engine.health().reason
        if (reason is not None) != self.stall_reported:
            self.stall_reported = reason is not None
            if reason is not None:
                logger.error(reason)
            else:
                logger.info("engine stall cleared")
        return reason
