"""The thread that serves an ``Engine`` to asyncio.

``AsyncEngine`` owns an ``Engine`` on one dedicated thread. That thread is the only one that
touches the scheduler, the model and the KV cache; ``submit``/``abort``/``update_window``
hand it commands through a condition-guarded inbox, in the order they were accepted, and it
hands events back to each request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe`` (one
call per step and loop). It sleeps on the condition until a command arrives or the scheduler's
next deadline (the wait or tail rule) falls due, so an idle engine costs no CPU. A watchdog
(``watchdog.EngineWatchdog``) is told of every step and every such sleep, so that a step that
never returns shows in ``AsyncEngine.health()`` (and so in /healthz and /metrics).

A request's fields are checked once, in ``submit``, on the caller's thread (``types.check_request``),
so that a refusal is raised at once. Its id, lane and the queue's room are checked there too, by the
scheduler's own rule (``scheduling.admission.check_queueable``) applied to what this object holds
(the ids it has taken, the window state it last accepted, the last load plus the submits in the
inbox); the scheduler applies the same rule to its own state on the engine thread, and has the last
word (a preemption may have grown the queue since the load was read). Window updates reach the
scheduler in the same inbox, so a request for a lane that an update just staged finds it staged,
and the scheduler queues it for the step that applies it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from batchpilot_runtime.contract.admin_api import DEFAULT_LANE, LaneWindow, WindowState, WindowUpdate, is_resend
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.engine.engine import Engine
from batchpilot_runtime.engine.types import (
    FINISH_TO_OUTCOME,
    AcceptedRequest,
    EngineLoad,
    EngineStoppedError,
    GenerationRequest,
    InvalidWindowError,
    TokenEvent,
)
from batchpilot_runtime.engine.watchdog import DEFAULT_STALL_TIMEOUT_S, EngineHealth, EngineWatchdog
from batchpilot_runtime.scheduling.admission import check_queueable
from batchpilot_runtime.scheduling.lanes import lanes_by_name
from batchpilot_runtime.scheduling.types import QueueFullError, RequestRejected

log = logging.getLogger(__name__)

# When the scheduler reports a deadline that is already due but still plans nothing, the
# engine thread re-checks after this long instead of spinning.
_MIN_IDLE_WAIT_S = 0.001
# With requests in the scheduler but neither a plan nor a deadline (nothing should do
# that), re-check at this period so that a scheduler oversight cannot hang a request; the
# watchdog counts these waits towards a stall.
_STALLED_POLL_S = 0.05


@dataclass(frozen=True)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenEvent]


@dataclass(frozen=True)
class _Submit:
    accepted: AcceptedRequest
    sink: _Sink


@dataclass(frozen=True)
class _Finish:
    request_id: str
    reason: str


@dataclass(frozen=True)
class _SetWindow:
    window: Window
    lanes: Mapping[str, LaneWindow] | None
    state: WindowState  # what the caller was told; reported to the observer once applied


_Command = _Submit | _Finish | _SetWindow


def _deliver(batch: Sequence[tuple[asyncio.Queue[TokenEvent], TokenEvent]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)


class AsyncEngine:
    """Runs ``Engine.step`` on its own thread; never blocks the asyncio loop.

    Invariant: only the engine thread calls the ``Engine`` (scheduler, model, KV). Callers
    touch nothing but the inbox, and a few fields of this object guarded by ``_cond``; the
    engine thread never holds ``_cond`` during a step, so ``health()`` answers while one hangs.
    """

    def __init__(self, engine: Engine, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._inbox: deque[_Command] = deque()
        self._accepting = True
        self._stop: Literal["drain", "cancel"] | None = None
        self._pending_submits = 0
        self._request_ids: set[str] = set()  # submitted and not yet finished
        self._window_state = engine.window_state()
        self._watchdog = EngineWatchdog(stall_timeout_s, engine.clock())
        # Written by the engine thread only (a reference swap), read by anyone:
        self._load = engine.load()
        self._failure: str | None = None
        # Owned by the engine thread:
        self._sinks: dict[str, _Sink] = {}
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._thread = threading.Thread(target=self._run, name="batchpilot-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting; with ``drain`` finish every running and waiting request, else cancel them."""
        with self._cond:
            self._accepting = False
            if self._stop != "cancel":
                self._stop = "drain" if drain else "cancel"
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)

    def is_alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and self._failure is None

    @property
    def accepting(self) -> bool:
        with self._cond:
            return self._accepting

    def load(self) -> EngineLoad:
        return self._load

    def health(self) -> EngineHealth:
        """The watchdog's reading: whether pending requests have gone without a step for longer
        than the stall timeout (a hung step), and for how long. Safe from any thread."""
        with self._cond:
            return self._watchdog.check(self.engine.clock())

    # -- requests -----------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Queue a request and return its events, the last one with a ``finish_reason``.

        Raises at once: ``RequestRejected`` (bad field, id in use), ``QueueFullError`` (the
        waiting queue is full), ``EngineStoppedError`` (draining or stopped). Leaving the
        iteration early (a client that hung up) cancels the request and frees its KV."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        with self._cond:
            now_s = self.engine.clock()
            accepted = self.engine.check_request(request, now_s)
            if not self._accepting or self._failure is not None:
                raise EngineStoppedError(self._failure or "the engine is shutting down and accepts no new request")
            # The lanes of the window state last accepted: the scheduler has staged or applied every
            # one of them by the time it sees this request (both travel in the same inbox).
            named = {lane_window.name for lane_window in self._window_state.lanes}
            load = self._load
            check_queueable(
                request.request_id,
                request.request_id in self._request_ids,
                request.lane,
                request.lane == DEFAULT_LANE or request.lane in named,
                lambda: sorted({DEFAULT_LANE, *named}),
                load.queue_depth + self._pending_submits,
                self.engine.max_queue,
                lambda: load.retry_after_s,
            )
            self._pending_submits += 1
            self._request_ids.add(request.request_id)
            self._watchdog.requests_pending(now_s, len(self._request_ids))
            self._inbox.append(_Submit(accepted, _Sink(loop, queue)))
            self._cond.notify()
        return self._stream(request.request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue[TokenEvent]) -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.is_final
                yield event
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op when it already ended); its stream ends with ``cancelled``."""
        self.finish(request_id, "cancelled")

    def finish(self, request_id: str, reason: str = "stop") -> None:
        """End a request early (e.g. ``"stop"`` on a stop string the server matched): its KV is
        freed and its stream ends with ``reason``. No-op when it already ended."""
        if reason not in FINISH_TO_OUTCOME:
            raise ValueError(f"reason must be one of {', '.join(FINISH_TO_OUTCOME)}, got {reason!r}")
        with self._cond:
            self._inbox.append(_Finish(request_id, reason))
            self._cond.notify()

    # -- the window ---------------------------------------------------------------------

    def update_window(self, update: WindowUpdate) -> WindowState:
        """Validate and stage a window for the next step boundary; returns the accepted state.

        ``update.lanes``, when given, is the complete new set of named lanes (a lane left out is
        retired once its requests finish); None keeps the lanes in force. Re-sending the window in
        force with its generation is accepted and changes nothing (level-triggered pushes).
        ``StaleGenerationError`` (409): a generation older than the one in force, or the same
        generation with other values. ``InvalidWindowError`` (422): the pod cannot hold it."""
        offered = update.window
        try:
            new_lanes = None if update.lanes is None else lanes_by_name(update.lanes)
        except ValueError as error:
            raise InvalidWindowError(str(error)) from None
        with self._cond:
            current = self._window_state
            in_force = current.window
            current_lanes = {lane.name: lane for lane in current.lanes}
            lanes = current_lanes if new_lanes is None else new_lanes
            if is_resend(offered, in_force, lanes == current_lanes):
                return current
            self.engine.validate_window(offered, list(lanes.values()))
            state = current.model_copy(update={"window": offered, "lanes": [lanes[name] for name in sorted(lanes)]})
            self._window_state = state
            self._inbox.append(_SetWindow(offered, new_lanes, state))
            self._cond.notify()
        return state

    def window_state(self) -> WindowState:
        with self._cond:
            return self._window_state

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            self._observe_window(self.window_state())
            while True:
                # 1. Take the commands, and the stop order, that arrived since the last step.
                with self._cond:
                    commands = list(self._inbox)
                    self._inbox.clear()
                    stop = self._stop
                replies = self._apply(commands)
                with self._cond:
                    self._pending_submits -= sum(1 for c in commands if isinstance(c, _Submit))
                    self._load = engine.load()
                self._dispatch(replies)
                if stop == "cancel":
                    cancelled = [e for rid in engine.live_request_ids if (e := engine.abort(rid)) is not None]
                    self._dispatch(cancelled)
                    break
                if stop == "drain" and not engine.has_unfinished and not self._sinks:
                    break
                # 2. One step, unless there is nothing to run now.
                steps_before = engine.steps_run
                events = self._step_guarded()
                stepped = engine.steps_run != steps_before
                if stepped or events:  # a step ran, or failed and ended its requests
                    with self._cond:
                        self._watchdog.step_ended(engine.clock())
                self._load = engine.load()
                self._dispatch(events)
                if stepped:
                    continue
                # 3. Idle: sleep until a command arrives or the next admission deadline.
                with self._cond:
                    if self._inbox or self._stop != stop:
                        continue
                    self._idle_wait()
        except BaseException as error:  # the thread must not die silently
            log.exception("engine thread failed")
            self._fail_everything(f"engine failure: {error!r}")
            raise
        finally:
            with self._cond:
                self._accepting = False

    def _apply(self, commands: Sequence[_Command]) -> list[TokenEvent]:
        replies: list[TokenEvent] = []
        engine = self.engine
        for command in commands:
            if isinstance(command, _Submit):
                request_id = command.accepted.request.request_id
                self._sinks[request_id] = command.sink
                try:
                    engine.enqueue(command.accepted)
                except (QueueFullError, RequestRejected) as refused:
                    # The caller's checks ran on a snapshot; the scheduler has the last word.
                    replies.append(TokenEvent(request_id, None, "error", str(refused)))
            elif isinstance(command, _Finish):
                event = engine.finish(command.request_id, command.reason)
                if event is not None:
                    replies.append(event)
            else:
                engine.set_window(command.window, command.lanes)
                self._observe_window(command.state)
        return replies

    def _step_guarded(self) -> list[TokenEvent]:
        """A step; when it raises, the requests in flight end with an error and the loop goes on."""
        try:
            return self.engine.step()
        except Exception as error:
            log.exception("engine step failed; failing the requests in flight")
            message = f"engine step failed: {error!r}"
            return [
                event
                for request_id in self.engine.live_request_ids
                if (event := self.engine.finish(request_id, "error", message)) is not None
            ]

    def _idle_wait(self) -> None:
        """Sleep on ``_cond`` (held) until a command or the scheduler's next deadline. The watchdog
        does not count a sleep the scheduler asked for, nor one with no request in the scheduler."""
        engine = self.engine
        by_design = not engine.has_unfinished or engine.next_deadline_s() is not None
        if by_design:
            self._watchdog.wait_started()
        self._cond.wait(self._idle_timeout_s())
        if by_design:
            self._watchdog.wait_ended(engine.clock())

    def _idle_timeout_s(self) -> float | None:
        deadline_s = self.engine.next_deadline_s()
        if deadline_s is None:
            return _STALLED_POLL_S if self.engine.has_unfinished else None
        return max(deadline_s - self.engine.clock(), _MIN_IDLE_WAIT_S)

    def _dispatch(self, events: Sequence[TokenEvent]) -> None:
        if not events:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]] = {}
        finished: list[str] = []
        for event in events:
            sink = self._sinks.get(event.request_id)
            if sink is None:
                continue
            by_loop.setdefault(sink.loop, []).append((sink.queue, event))
            if event.is_final:
                del self._sinks[event.request_id]
                finished.append(event.request_id)
        if finished:
            with self._cond:
                self._request_ids.difference_update(finished)
                self._watchdog.requests_pending(self.engine.clock(), len(self._request_ids))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:
                # The caller's loop is closed: nobody is left to read these events.
                log.debug("dropping %d events for a closed event loop", len(batch))

    def _fail_everything(self, message: str) -> None:
        with self._cond:
            self._failure = message
            self._accepting = False
        self._dispatch([TokenEvent(rid, None, "error", message) for rid in list(self._sinks)])

    def _observe_window(self, state: WindowState) -> None:
        observer = self.engine.observer
        if observer is not None:
            observer.on_window(state)
