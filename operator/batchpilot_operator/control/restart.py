"""The restart path (``tuning.mode: restart``): the recommendation written into the workload's container args.

Each due interval, per profile: read the workload (Deployment or StatefulSet of spec.restart), take the
flags its engine container runs with as the window in force (so the policy recommends from what the pods
really run), notice when args the operator applied are gone (a GitOps sync or a hand edit: reported as a
Warning Event and ``Synced=False``, reason ``RetuneReverted``, never fought: a re-apply goes through the
same budget as any restart), and restart when :func:`restart_plan.decide` says the recommendation is worth
it and the budget allows. The write is a server-side apply of the container's args alone, under the field
manager ``batchpilot`` (io/kube.py), which Argo CD and Flux can be told to leave alone (docs/engines.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from batchpilot_operator.api.profile import BatchProfileSpec, EngineKind, TuningMode
from batchpilot_operator.api.restart import RestartBudget, RestartStatus
from batchpilot_operator.api.status import PodsStatus
from batchpilot_operator.control.conditions import ready_fact
from batchpilot_operator.control.engine_knobs import llamacpp_flags, sglang_server_args, vllm_args
from batchpilot_operator.control.plan import followed
from batchpilot_operator.control.records import ProfileRecord
from batchpilot_operator.control.restart_plan import (
    DAY_S,
    LLAMACPP_ALIASES,
    LLAMACPP_FLAGS,
    SGLANG_FLAGS,
    VLLM_FLAGS,
    Budget,
    Rejected,
    RestartBook,
    Verdict,
    Watch,
    decide,
    judge,
    llamacpp_rewrite_args,
    next_allowed,
    read_flags,
    rewrite_args,
    rolled_out,
    worth,
)
from batchpilot_operator.control.status import FALSE, TRUE, ConditionFact, StatusFacts, rfc3339
from batchpilot_operator.tuning.reading import slo_over
from batchpilot_runtime.contract.window import Window

log = logging.getLogger("batchpilot.operator")

QueueEvent = Callable[[ProfileRecord, str, str, str], None]


class Workloads(Protocol):
    """The workload calls of io/kube.py's KubeClient."""

    async def read_workload(self, namespace: str, kind: str, name: str) -> dict[str, Any]: ...

    async def apply_container_args(
        self, namespace: str, kind: str, name: str, container: str, args: list[str]
    ) -> dict[str, Any]: ...


def budget_of(spec: RestartBudget) -> Budget:
    hours = spec.allowed_hours.minutes() if spec.allowed_hours is not None else None
    return Budget(spec.max_per_day, float(spec.min_interval_seconds), hours, spec.min_change, spec.stable_intervals)


def engine_flags(engine: EngineKind, window: Window) -> dict[str, int]:
    """``window`` as the engine's command-line flags."""
    if engine == EngineKind.SGLANG:
        server_args = sglang_server_args(window)
        return {f"--{key.replace('_', '-')}": value for key, value in server_args.items()}
    if engine == EngineKind.LLAMACPP:
        return llamacpp_flags(window)
    return vllm_args(window)


def window_flags(engine: EngineKind) -> tuple[tuple[str, str], dict[str, str]]:
    """The engine's (cap flag, budget flag) and the short names its parser takes for flags."""
    if engine == EngineKind.SGLANG:
        return SGLANG_FLAGS, {}
    if engine == EngineKind.LLAMACPP:
        return LLAMACPP_FLAGS, LLAMACPP_ALIASES
    return VLLM_FLAGS, {}


def engine_args(engine: EngineKind, args: Sequence[str], flags: Mapping[str, int]) -> list[str]:
    """The container's ``args`` carrying ``flags``; ValueError when the engine's args cannot take them."""
    if engine == EngineKind.LLAMACPP:
        return llamacpp_rewrite_args(args, flags)
    return rewrite_args(args, flags)


def running_window(spec: BatchProfileSpec, running: Mapping[str, int], engine: EngineKind) -> Window | None:
    """spec.window with the cap and prefill budget the workload's args carry; None when they make no window."""
    (cap_flag, budget_flag), _ = window_flags(engine)
    fields = spec.window.model_dump()
    if cap_flag in running:
        fields["hard_cap"] = running[cap_flag]
        fields["target_batch_size"] = min(fields["target_batch_size"], running[cap_flag])
    if budget_flag in running:
        fields["max_prefill_tokens"] = running[budget_flag]
    try:
        return Window.model_validate({**fields, "generation": 1})
    except ValueError:
        return None


def _parse_time(text: Any) -> float | None:
    try:
        moment = datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo is not None else None


def restore(book: RestartBook, written: Mapping[str, Any]) -> None:
    """The history and applied flags an earlier operator left in status.restart: the budget survives restarts."""
    status = written.get("restart") if isinstance(written.get("restart"), Mapping) else {}
    assert isinstance(status, Mapping)
    times = [_parse_time(text) for text in status.get("history") or []]
    book.history = [t for t in times if t is not None]
    applied = status.get("appliedArgs")
    if isinstance(applied, Mapping) and all(isinstance(v, int) for v in applied.values()):
        book.applied = {str(k): int(v) for k, v in applied.items()}


def _container(workload: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    containers = (((workload.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    return next((c for c in containers if isinstance(c, dict) and c.get("name") == name), None)


def _flags_text(flags: Mapping[str, int]) -> str:
    return " ".join(f"{k} {v}" for k, v in flags.items()) or "no batching flags"


class RestartPath:
    def __init__(self, workloads: Workloads | None, queue_event: QueueEvent) -> None:
        self.workloads = workloads
        self.queue_event = queue_event
        self._books: dict[tuple[str, str | None], RestartBook] = {}  # (profile key, uid) -> its book

    def book(self, record: ProfileRecord) -> RestartBook:
        return self._books.setdefault((record.ref.key, record.ref.uid), RestartBook())

    def forget(self, key: str) -> None:
        for book_key in [k for k in self._books if k[0] == key]:
            del self._books[book_key]

    def amend(self, record: ProfileRecord, facts: StatusFacts) -> StatusFacts:
        """Restart mode: Synced (and Ready) say what the workload runs, and status.restart is added. The pods
        run the workload's args, so every Ready pod counts as running the window in force."""
        spec = record.spec
        if spec is None or spec.mode != TuningMode.RESTART:
            return facts
        book = self.book(record)
        ready = facts.pods.ready if facts.pods is not None else 0
        if book.synced is None or not ready:
            return facts
        synced = ready if book.synced.status == TRUE else 0
        pods = PodsStatus(total=facts.pods.total if facts.pods else 0, ready=ready, synced=synced,
                          summary=f"{synced}/{ready}")  # fmt: skip
        return dataclasses.replace(facts, synced=book.synced, ready=ready_fact(book.synced), pods=pods)

    def status_of(self, record: ProfileRecord) -> dict[str, Any] | None:
        """status.restart, in restart mode once the path has run."""
        if record.spec is None or record.spec.mode != TuningMode.RESTART:
            return None
        status = self.book(record).status
        if status is None:  # not evaluated yet by this operator: keep what the last one wrote (its history)
            written = record.status.written.get("restart")
            return dict(written) if isinstance(written, Mapping) else None
        return status

    async def sync(self, record: ProfileRecord, now_s: float) -> None:
        """One evaluation of ``record``'s restart path; its outcome lands on its book."""
        spec, book = record.spec, self.book(record)
        if spec is None or spec.restart is None:
            return
        if book.history is None:
            restore(book, record.status.written)
        history = book.history if book.history is not None else []
        book.history = [t for t in history if now_s - DAY_S < t <= now_s]
        target = spec.restart.workload
        ref = f"{target.kind}/{target.name}"
        verdict: Verdict | None = None
        try:
            verdict = await self._evaluate(record, spec, book, now_s, ref)
        finally:
            book.status = self._status(spec.restart, book, now_s, ref, verdict)

    async def _evaluate(
        self, record: ProfileRecord, spec: BatchProfileSpec, book: RestartBook, now_s: float, ref: str
    ) -> Verdict | None:
        assert spec.restart is not None
        target = spec.restart.workload
        if self.workloads is None:
            book.synced = ConditionFact(FALSE, "NoCluster", "tuning.mode restart needs the Kubernetes API")
            return None
        try:
            workload = await self.workloads.read_workload(record.ref.namespace, target.kind, target.name)
        except Exception as error:  # KubeError, or a body that is not a workload
            self._fail(record, book, "WorkloadUnreadable", f"{ref}: {error}")
            return None
        container = _container(workload, target.container)
        if container is None:
            self._fail(record, book, "ContainerNotFound", f"{ref} has no container {target.container!r}")
            return None
        flags, aliases = window_flags(spec.engine)
        args = [str(a) for a in container.get("args") or []]
        try:
            running = read_flags(args, flags, aliases)
            in_command = read_flags([str(c) for c in container.get("command") or []], flags, aliases)
        except ValueError as error:
            self._fail(record, book, "BadArgs", f"{ref} container {target.container}: {error}")
            return None
        if in_command:
            message = (f"{ref} container {target.container} sets {', '.join(in_command)} in command, which the "
                       "operator does not rewrite: move the engine's flags to args")  # fmt: skip
            self._fail(record, book, "FlagsInCommand", message)
            return None
        book.running = running
        self._notice_revert(record, book, now_s, ref)
        self._follow(record, spec, running)
        if book.reverted_at is not None:
            book.watch = None  # the args are no longer the operator's: there is no restart of its to judge
        if book.watch is not None and not rolled_out(workload):
            rolling = _flags_text(book.watch.applied)
            book.synced = ConditionFact(TRUE, "RollingOut", f"{ref} rolls out {rolling}; judged once it is done")
            return book.verdict  # no restart, and no judgement, while the last one rolls out
        if book.evaluation == record.memory.evaluations and book.verdict is not None:
            return book.verdict  # no new evaluation since the last sync (a pod turned Ready): nothing to decide
        book.evaluation = record.memory.evaluations
        obs = record.memory.observations
        over = slo_over(spec, obs) if obs is not None else None
        if book.watch is not None:
            watch = book.watch
            outcome, book.watch = judge(watch, over)
            if outcome == "rollback":
                await self._rollback(record, book, now_s, ref, args, watch)
                return book.verdict
        recommended = record.memory.recommended
        wanted = engine_flags(spec.engine, recommended) if recommended is not None else {}
        budget = budget_of(spec.restart)
        verdict = decide(
            budget, book.history or [], now_s, running, wanted,
            streak=book.streak, trend=book.trend, slo_over=over is True, rejected=book.rejected,
        )  # fmt: skip
        book.streak, book.trend, book.verdict = verdict.streak, verdict.trend, verdict
        if verdict.restart:
            trend = tuple(sorted(worth(running, wanted, budget.min_change).items()))
            watch = Watch(dict(running), dict(wanted), over is False, budget.stable_intervals, trend)
            await self._restart(record, book, now_s, ref, args, wanted, verdict, watch)
        elif book.reverted_at is None:
            book.synced = ConditionFact(TRUE, "WorkloadRuns", f"{ref} runs {_flags_text(running)}; {verdict.reason}")
        return verdict

    def _fail(self, record: ProfileRecord, book: RestartBook, reason: str, message: str) -> None:
        if book.synced is None or book.synced.message != message:
            self.queue_event(record, "Warning", reason, message)
        book.synced = ConditionFact(FALSE, reason, message)

    def _notice_revert(self, record: ProfileRecord, book: RestartBook, now_s: float, ref: str) -> None:
        """Args the operator applied that the workload no longer carries: reported once, not fought."""
        if not book.applied:
            return
        if all(book.running.get(flag) == value for flag, value in book.applied.items()):
            book.reverted_at = None
            return
        message = (
            f"{ref} runs {_flags_text(book.running)}, not the applied {_flags_text(book.applied)}: a GitOps sync "
            "(Argo CD, Flux) or an edit undid the retune. Tell the GitOps tool to ignore the args owned by the "
            "field manager batchpilot (docs/engines.md); the operator re-applies no sooner than its restart "
            "budget allows"
        )
        if book.reverted_at is None:
            book.reverted_at = now_s
            self.queue_event(record, "Warning", "RetuneReverted", message)
        book.synced = ConditionFact(FALSE, "RetuneReverted", message)

    @staticmethod
    def _follow(record: ProfileRecord, spec: BatchProfileSpec, running: Mapping[str, int]) -> None:
        """The window in force becomes what the workload runs (numbered by :func:`~.plan.followed`)."""
        record.loop.window = followed(record.loop.window, running_window(spec, running, spec.engine))

    async def _restart(
        self,
        record: ProfileRecord,
        book: RestartBook,
        now_s: float,
        ref: str,
        args: Sequence[str],
        wanted: Mapping[str, int],
        verdict: Verdict,
        watch: Watch,
    ) -> None:
        if not await self._write(record, book, now_s, ref, args, wanted, "RestartFailed"):
            return
        book.watch = watch
        log.info("restart %s: %s %s", record.ref.key, ref, verdict.reason)
        self.queue_event(record, "Normal", "Restarted", f"{ref} restarted with {_flags_text(wanted)}: {verdict.reason}")
        book.synced = ConditionFact(TRUE, "Restarted", f"{ref} rolls with {_flags_text(wanted)}: {verdict.reason}")

    async def _rollback(
        self, record: ProfileRecord, book: RestartBook, now_s: float, ref: str, args: Sequence[str], watch: Watch
    ) -> None:
        """The SLO broke after a restart made while it was met: back to the args before it, now (see
        restart_plan's docstring for why this one restart is outside minIntervalSeconds and allowedHours)."""
        if not await self._write(record, book, now_s, ref, args, watch.previous, "RollbackFailed"):
            return
        book.rejected = Rejected(dict(watch.previous), watch.trend, now_s + DAY_S)
        book.streak, book.trend = 0, ()
        message = (f"{ref}: the SLO broke after the restart with {_flags_text(watch.applied)}, which it met before; "
                   f"rolled back to {_flags_text(watch.previous)}, and the same change is not tried again for a day")  # fmt: skip
        log.warning("restart %s: %s", record.ref.key, message)
        self.queue_event(record, "Warning", "RestartRolledBack", message)
        book.synced = ConditionFact(TRUE, "RolledBack", message)

    async def _write(
        self,
        record: ProfileRecord,
        book: RestartBook,
        now_s: float,
        ref: str,
        args: Sequence[str],
        flags: Mapping[str, int],
        failure: str,
    ) -> bool:
        """Apply ``flags`` into the container's args and book it as a restart; False (and why) when it failed."""
        assert record.spec is not None and record.spec.restart is not None and self.workloads is not None
        target = record.spec.restart.workload
        try:
            new_args = engine_args(record.spec.engine, args, flags)
        except ValueError as error:
            self._fail(record, book, "BadArgs", f"{ref} container {target.container}: {error}")
            return False
        try:
            await self.workloads.apply_container_args(
                record.ref.namespace, target.kind, target.name, target.container, new_args
            )
        except Exception as error:
            self._fail(record, book, failure, f"{ref}: applying {_flags_text(flags)} failed: {error}")
            return False
        book.history = [*(book.history or []), now_s]
        book.applied = dict(flags)
        book.running = dict(flags)
        book.reverted_at = None
        self._follow(record, record.spec, flags)
        return True

    @staticmethod
    def _status(
        budget: RestartBudget, book: RestartBook, now_s: float, ref: str, verdict: Verdict | None
    ) -> dict[str, Any]:
        history = sorted(book.history or [])
        allowed_at = None
        if verdict is not None:  # after a restart, the budget as that restart left it
            allowed_at = next_allowed(budget_of(budget), history, now_s) if verdict.restart else verdict.next_allowed_s
        status = RestartStatus(
            workload=ref,
            applied_args=book.applied,
            last_at=rfc3339(history[-1]) if history else None,
            count24h=len(history),
            next_allowed_at=rfc3339(allowed_at) if allowed_at is not None else None,
            history=[rfc3339(t) for t in history[-budget.max_per_day :]],
            reverted_at=rfc3339(book.reverted_at) if book.reverted_at is not None else None,
            previous_args=book.watch.previous if book.watch is not None else None,
            message=book.synced.message if book.synced is not None else None,
        )
        return status.model_dump(by_alias=True, exclude_none=True, mode="json")
