"""The demo, start to end: runtimes, Prometheus, two phases of replay under the operator, the report.

Phases: the operator (``batchpilot-operator local``, a child process) first runs both
profiles in ``static`` mode, then in ``adaptive`` mode; each phase replays the very same
arrivals against the very same runtimes, which keep running between the phases (the
phase figures are differences of the counters and histograms scraped at its start and
end). Whatever happens — an error, Ctrl-C, SIGTERM — every child is stopped before the
demo returns, and an error names what failed with the end of its log.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import platform
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import httpx
import yaml

from batchpilot_operator.demo.answers import CHAT_CHECKPOINT, KV_CACHE_TOKENS, ask_all
from batchpilot_operator.demo.children import (
    Child,
    DemoError,
    RuntimeEndpoint,
    find_prometheus,
    free_port,
    http_ok,
    prometheus_command,
    prometheus_config,
    prometheus_has_scraped,
    runtime_command,
    start_runtime,
    threads_per_runtime,
    wait_until,
)
from batchpilot_operator.demo.collector import Collector
from batchpilot_operator.demo.decisions import parse_decision_line
from batchpilot_operator.demo.live import LastDecision, View, ViewState
from batchpilot_operator.demo.report import write_report
from batchpilot_operator.demo.results import (
    MODES,
    ChatAnswer,
    DecisionRecord,
    DemoModelInfo,
    DemoReport,
    DemoRunInfo,
    LoadCounts,
    Mode,
    PhaseResult,
    compare,
    format_figure,
)
from batchpilot_operator.demo.series import Snapshot, outcomes_between, summarize_model_phase
from batchpilot_operator.demo.settings import (
    OPERATOR_INTERVAL_S,
    SCRAPE_INTERVAL_S,
    SERIES_WINDOW_S,
    Arrivals,
    DemoModel,
    DemoSettings,
    demo_trace_path,
    plan_arrivals,
)
from batchpilot_operator.demo.sizing import Sizing, models_to_size, size_to_host
from batchpilot_runtime.replay.loadgen import LoadSummary, RequestResult, run_load

_REJECTED = ("rejected_429", "rejected_503", "client_error")
SETTLE_S = OPERATOR_INTERVAL_S + 2 * SCRAPE_INTERVAL_S


def load_counts(summary: LoadSummary) -> LoadCounts:
    """Outcomes of one model's replay. A refusal (429/503/4xx) was never accepted; a request
    whose stream broke without an error event (``incomplete``, ``transport_error``) is lost."""
    outcomes = summary.outcomes
    rejected = sum(outcomes.get(o, 0) for o in _REJECTED)
    return LoadCounts(
        sent=summary.requests_sent,
        accepted=summary.requests_sent - rejected,
        completed=outcomes.get("completed", 0),
        errors=outcomes.get("server_error", 0),
        rejected=rejected,
    )


def window_flags(model: DemoModel) -> list[str]:
    w = model.window
    return [
        "--target-batch-size",
        str(w.target_batch_size),
        "--hard-cap",
        str(w.hard_cap),
        "--max-wait-ms",
        str(w.max_wait_ms),
        "--tail-mark-ratio",
        str(w.tail_mark_ratio),
        *(["--max-prefill-tokens", str(w.max_prefill_tokens)] if w.max_prefill_tokens is not None else []),
    ]


def describe_window(model: DemoModel) -> str:
    """The model's starting (static) window, as the report and the live view name it."""
    w = model.window
    text = f"target {w.target_batch_size}, cap {w.hard_cap}, wait {w.max_wait_ms} ms, tail {w.tail_mark_ratio:g}x"
    if w.max_prefill_tokens is not None:
        text += f", budget {w.max_prefill_tokens} tokens"
    return text


def write_token(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(24) + "\n")
    return path


def write_profiles(models: tuple[DemoModel, ...], mode: Mode, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for model in models:
        (folder / f"{model.name}.yaml").write_text(yaml.safe_dump(model.profile_manifest(mode), sort_keys=False))
    return folder


class Demo:
    def __init__(self, settings: DemoSettings, stream: TextIO, sizing: Sizing | None = None) -> None:
        self.settings = settings
        self.sizing = sizing or Sizing(1.0, None, ())
        self.models = settings.effective_models()
        self.stream = stream
        self.out_dir = settings.out_dir
        self.logs = settings.out_dir / "logs"
        self.children: list[Child] = []
        self.runtimes: dict[str, tuple[Child, RuntimeEndpoint]] = {}
        self.prometheus_url: str | None = None
        self.collector: Collector | None = None
        self.state = ViewState(phases=len(MODES))
        self.view = View(self.models, None, self.state, live=settings.live, stream=stream)
        self.started_s = time.monotonic()
        self.answers: list[ChatAnswer] = []

    # ---- children ------------------------------------------------------------------------

    def _child(self, name: str, argv: list[str], log_name: str, on_line: Callable[[str], None] | None = None) -> Child:
        child = Child(name, argv, self.logs / log_name, on_line=on_line)
        self.children.append(child)
        return child

    async def _start_runtimes(self, token_file: Path) -> None:
        async def start(model: DemoModel) -> tuple[Child, RuntimeEndpoint]:
            ready_file = self.out_dir / "run" / f"{model.name}.ready.json"
            ready_file.parent.mkdir(parents=True, exist_ok=True)
            argv = runtime_command(
                model=model.name,
                preset=model.preset,
                window_flags=window_flags(model),
                kv_cache_tokens=model.kv_cache_tokens,
                token_file=token_file,
                ready_file=ready_file,
                seed=self.settings.seed,
                threads=threads_per_runtime(len(self.models), os.cpu_count()),
            )
            child = self._child(f"runtime {model.name} (preset {model.preset})", argv, f"runtime-{model.name}.log")
            endpoint = await start_runtime(child, ready_file, self.settings.ready_timeout_s)
            return child, endpoint

        started = await asyncio.gather(*(start(m) for m in self.models))
        for (child, endpoint), model in zip(started, self.models, strict=True):
            self.runtimes[model.name] = (child, endpoint)
            self.view.say(f"runtime {model.name}: preset {model.preset}, serving {endpoint.serve_url}")

    async def _real_answers(self, token_file: Path) -> list[ChatAnswer]:
        """The real chat model answers demo/answers.py's questions, alone with every core, then stops."""
        ready_file = self.out_dir / "run" / "chat-model.ready.json"
        ready_file.parent.mkdir(parents=True, exist_ok=True)
        argv = runtime_command(
            model=CHAT_CHECKPOINT,
            preset=None,
            checkpoint=CHAT_CHECKPOINT,
            window_flags=[],
            kv_cache_tokens=KV_CACHE_TOKENS,
            token_file=token_file,
            ready_file=ready_file,
            seed=self.settings.seed,
            threads=threads_per_runtime(1, os.cpu_count()),
        )
        child = self._child(f"runtime {CHAT_CHECKPOINT}", argv, "runtime-chat-model.log")
        self.view.say(f"the real chat model, {CHAT_CHECKPOINT}, answers first (temperature 0):")
        endpoint = await start_runtime(child, ready_file, self.settings.ready_timeout_s)
        try:
            answers = await ask_all(endpoint.serve_url)
        except (httpx.HTTPError, ValueError) as error:
            raise child.failure(f"did not answer ({error})") from None
        finally:
            await child.stop()
        for answer in answers:
            self.view.say(f"  Q: {answer.question}")
            text = answer.answer.replace("\n", "\n     ")  # a poem's lines stay under the answer
            self.view.say(f"  A: {text}  ({answer.completion_tokens} tokens, {answer.seconds:g} s)")
        return answers

    async def _start_prometheus(self) -> None:
        binary = find_prometheus() if self.settings.prometheus else None
        if binary is None:
            why = "--no-prometheus" if not self.settings.prometheus else "prometheus is not on PATH"
            self.view.say(f"{why}: the operator scrapes the runtimes' /metrics itself")
            return
        folder = self.out_dir / "prometheus"
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "prometheus.yml"
        targets = [e.serve_url.removeprefix("http://") for _, e in self.runtimes.values()]
        config.write_text(prometheus_config(targets, SCRAPE_INTERVAL_S))
        port = free_port()
        child = self._child("prometheus", prometheus_command(binary, config, folder / "data", port), "prometheus.log")
        await child.start()
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as client:

            async def ready() -> bool:
                return await http_ok(client, f"{url}/-/ready")

            async def scraped() -> bool:
                return await prometheus_has_scraped(client, url, len(self.runtimes))

            await wait_until(child, ready, 60.0, "become ready")
            await wait_until(child, scraped, 60.0, "scrape the runtimes")
        self.prometheus_url = url
        self.view.say(f"prometheus {url} scrapes both runtimes every {SCRAPE_INTERVAL_S:g} s")

    def _check_children(self) -> None:
        for child in self.children:
            child.check_alive()

    async def _stop_children(self) -> None:
        running = [c for c in self.children if c.returncode is None]
        await asyncio.gather(*(c.stop() for c in running), return_exceptions=True)

    # ---- phases --------------------------------------------------------------------------

    async def _run_phase(self, number: int, mode: Mode, arrivals: list[Arrivals]) -> PhaseResult:
        assert self.collector is not None  # set in run() before the phases
        if number > 1:
            # Let the previous phase's traffic leave the operator's rate window, so that the new
            # operator starts from what it sees of its own phase and nothing of the last one.
            self.view.say(f"waiting {SETTLE_S:g} s for the last phase's traffic to leave the rate window")
            await asyncio.sleep(SETTLE_S)
        folder = write_profiles(self.models, mode, self.out_dir / "profiles" / mode)
        decisions: list[DecisionRecord] = []
        phase_start_s: list[float] = []
        operator = self._child(
            f"operator ({mode} mode)",
            self._operator_command(folder),
            f"operator-{mode}.log",
            on_line=self._decision_reader(mode, decisions, phase_start_s),
        )
        self._announce_phase(number, mode, arrivals)
        await operator.start()

        def on_result(_result: RequestResult) -> None:
            self.state.requests_done += 1

        first = await self.collector.scrape_now()
        start_s = time.monotonic()
        phase_start_s.append(start_s)
        self.state.phase_started_s = start_s
        # 1. The replay, from the start mark (a scrape of every runtime) to the last answer.
        summaries = await self._replay(mode, arrivals, on_result, start_s)
        # 2. The end mark: every request has been answered; the runtimes count a request just
        #    after its last byte, so wait (briefly) until their counters hold every accepted one.
        await self._scrape_settled(first, {m: load_counts(s).accepted for m, s in summaries.items()})
        end_s = time.monotonic()
        await operator.stop()
        phase = self._phase_result(mode, summaries, first, end_s, decisions)
        self._say_phase_result(phase)
        return phase

    def _decision_reader(
        self, mode: Mode, decisions: list[DecisionRecord], phase_start_s: list[float]
    ) -> Callable[[str], None]:
        """The operator's line callback: each decision line is appended to ``decisions`` (timed from the
        phase start, once ``phase_start_s`` holds it) and shown in the live view; warnings are shown too."""
        names = [m.name for m in self.models]

        def on_line(line: str) -> None:
            parsed = parse_decision_line(line, names)
            if parsed is None:
                if " Warning " in line:  # a push failure or a clamped window: worth seeing at once
                    self.view.say(f"  operator: {line}")
                return
            now_s = time.monotonic()
            t_s = now_s - phase_start_s[0] if phase_start_s else 0.0
            decisions.append(
                DecisionRecord(
                    t_s=round(t_s, 2),
                    model=parsed.model,
                    direction=parsed.direction,
                    reason=parsed.reason,
                    window=parsed.window,
                    budget=parsed.budget,
                )
            )
            self.state.decisions[parsed.model] = LastDecision(now_s, parsed.direction, parsed.reason, parsed.window)
            if parsed.direction != "hold":
                self.view.say(
                    f"  [{mode} +{t_s:.0f}s] {parsed.model} {parsed.direction}: "
                    f"{parsed.window + ' — ' if parsed.window else ''}{parsed.reason}"
                )

        return on_line

    def _announce_phase(self, number: int, mode: Mode, arrivals: list[Arrivals]) -> None:
        """Reset the live view's phase state and say what this phase replays."""
        self.state.phase, self.state.phase_number = mode, number
        self.state.replay_s = self.settings.phase_replay_s
        self.state.requests_total = sum(len(a.requests) for a in arrivals)
        self.state.requests_done = 0
        self.state.decisions.clear()
        if mode == "static":
            held = "; ".join(f"{m.name}: {m.window_label}" for m in self.models)
            what = f"static windows ({held})"
        else:
            what = "adaptive windows (the operator retunes them from the same start)"
        self.view.say(
            f"phase {number}/{len(MODES)}: {what}, replaying "
            f"{self.state.requests_total} requests over {self.settings.phase_replay_s:g} s"
        )
        for a in arrivals:
            if a.surge is not None:
                self.view.say(f"  {a.model}: {a.surge.describe()} into the phase (the same in both phases)")

    def _phase_result(
        self,
        mode: Mode,
        summaries: dict[str, LoadSummary],
        first: dict[str, Snapshot | None],
        end_s: float,
        decisions: list[DecisionRecord],
    ) -> PhaseResult:
        """Each model's figures between the start mark ``first`` and ``end_s``, with its replay's outcomes."""
        results = []
        for model in self.models:
            results.append(
                summarize_model_phase(
                    model=model.name,
                    latency_metric=model.latency_metric,
                    slo_p99_ms=model.slo_p99_ms,
                    slo_itl_p99_ms=model.slo_itl_p99_ms,
                    snapshots=self._phase_snapshots(model.name, first, end_s),
                    load=load_counts(summaries[model.name]),
                    decisions=decisions,
                    series_window_s=SERIES_WINDOW_S,
                )
            )
        return PhaseResult(
            mode=mode,
            replay_s=self.settings.phase_replay_s,
            wall_s=round(max(s.duration_s for s in summaries.values()), 2),
            models=results,
            decisions=decisions,
        )

    def _say_phase_result(self, phase: PhaseResult) -> None:
        for result in phase.models:
            slo = next(m for m in self.models if m.name == result.model)
            itl = (
                f"inter-token P99 {format_figure(result.itl_p99_ms)} ms (SLO {format_figure(slo.slo_itl_p99_ms)}), "
                if slo.slo_itl_p99_ms is not None
                else ""
            )
            self.view.say(
                f"  {phase.mode} {result.model}: P99 {format_figure(result.p99_ms)} ms "
                f"(SLO {format_figure(slo.slo_p99_ms)}), {itl}{format_figure(result.tokens_per_s)} tokens/s, "
                f"{result.load.completed}/{result.load.accepted} completed, lost {result.load.lost}, "
                f"{result.decisions} window changes"
            )

    def _operator_command(self, profiles: Path) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "batchpilot_operator.cli.main",
            "local",
            "--profiles",
            str(profiles),
            "--output",
            "json",
        ]
        # The profile's interval, and Prometheus's real scrape interval: the operator's rate window
        # is the larger of the interval and four scrapes.
        argv += ["--interval", str(OPERATOR_INTERVAL_S), "--scrape-interval", str(SCRAPE_INTERVAL_S)]
        for _, endpoint in self.runtimes.values():
            argv += ["--runtime", endpoint.operator_flag()]
        if self.prometheus_url:
            argv += ["--prometheus-url", self.prometheus_url]
        return argv

    async def _replay(
        self, mode: Mode, arrivals: list[Arrivals], on_result: Callable[[RequestResult], None], start_s: float
    ) -> dict[str, LoadSummary]:
        """Replay every model's arrivals at once, watching the children: a crash ends the demo at
        once, naming the child; so does a replay that takes far longer than it should."""
        timeout_s = 3 * self.settings.phase_replay_s + 300.0
        loads = {
            a.model: asyncio.create_task(
                run_load(
                    [self.runtimes[a.model][1].serve_url + f",model={a.model}"],
                    a.requests,
                    seed=self.settings.seed,
                    scaling=a.scaling,
                    request_timeout_s=timeout_s,
                    on_result=on_result,
                ),
                name=f"load-{a.model}",
            )
            for a in arrivals
        }
        try:
            while not all(task.done() for task in loads.values()):
                await asyncio.wait(loads.values(), timeout=0.5)
                self._check_children()
                self.view.refresh(time.monotonic())
                if time.monotonic() > start_s + timeout_s:
                    raise DemoError(f"the {mode} replay did not finish within {timeout_s:g} s")
            return {model: task.result() for model, task in loads.items()}
        finally:
            for task in loads.values():
                task.cancel()

    def _phase_snapshots(self, model: str, first: dict[str, Snapshot | None], end_s: float) -> list[Snapshot]:
        assert self.collector is not None
        mark = first.get(model)
        if mark is None:
            raise DemoError(
                f"runtime {model}: /metrics did not answer at the start of the phase "
                f"({self.collector.failures.get(model, 'no detail')})"
            )
        return self.collector.between(model, mark.at_s, end_s)

    async def _scrape_settled(self, first: dict[str, Snapshot | None], accepted: dict[str, int]) -> None:
        assert self.collector is not None
        deadline_s = time.monotonic() + 10.0
        while True:
            latest = await self.collector.scrape_now()
            settled = True
            for model, count in accepted.items():
                before, after = first.get(model), latest.get(model)
                if before is None or after is None:
                    settled = False
                    continue
                outcomes = outcomes_between(before, after)
                settled &= sum(v for k, v in outcomes.items() if k != "rejected") >= count
            if settled or time.monotonic() >= deadline_s:
                return
            await asyncio.sleep(0.2)

    # ---- the whole run -------------------------------------------------------------------

    async def _refresh_view(self) -> None:
        while True:
            self.view.refresh(time.monotonic())
            await asyncio.sleep(0.25)

    async def run(self) -> Path:
        arrivals = plan_arrivals(self.settings)
        self.logs.mkdir(parents=True, exist_ok=True)
        token_file = write_token(self.out_dir / "run" / "admin-token")
        refresher: asyncio.Task[None] | None = None
        self.view.say(
            f"batchpilot demo: {len(self.models)} models, {self.settings.phase_replay_s:g} s of arrivals "
            f"per phase, output in {self.out_dir}"
        )
        try:
            if self.settings.answers:
                self.answers = await self._real_answers(token_file)
            await self._start_runtimes(token_file)
            await self._start_prometheus()
            self.collector = Collector(
                {name: endpoint.metrics_url for name, (_, endpoint) in self.runtimes.items()}, SCRAPE_INTERVAL_S
            )
            self.view.collector = self.collector
            self.collector.start()
            self.view.start()
            refresher = asyncio.create_task(self._refresh_view(), name="demo-view")
            phases = [await self._run_phase(n, mode, arrivals) for n, mode in enumerate(MODES, start=1)]
        finally:
            if refresher is not None:
                refresher.cancel()
            self.view.stop()
            if self.collector is not None:
                await self.collector.aclose()
            await self._stop_children()
            # Prometheus's database only served the operator's queries; the report has the figures.
            shutil.rmtree(self.out_dir / "prometheus" / "data", ignore_errors=True)
        report = self._report(phases, arrivals)
        html_path, json_path = write_report(report, self.out_dir)
        for row in report.comparison:
            if row.figure in (
                "P99 latency",
                "Inter-token P99",
                "Throughput",
                "Requests within the SLO",
                "Lost requests",
            ):
                if row.static is None and row.adaptive is None:
                    continue
                self.view.say(
                    f"{row.model:6s} {row.figure:24s} static {format_figure(row.static):>8s}  "
                    f"adaptive {format_figure(row.adaptive):>8s} {row.unit}".rstrip()
                )
        self.view.say(f"figures: {json_path}")
        return html_path

    def _report(self, phases: list[PhaseResult], arrivals: list[Arrivals]) -> DemoReport:
        counts = {a.model: len(a.requests) for a in arrivals}
        scaling = "; ".join(f"{a.model}: {a.describe()}" for a in arrivals)
        surges = {a.model: a.surge for a in arrivals if a.surge is not None}
        return DemoReport(
            created_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            run=DemoRunInfo(
                duration_s=self.settings.duration_s,
                phase_replay_s=self.settings.phase_replay_s,
                wall_s=round(time.monotonic() - self.started_s, 1),
                metrics_source="prometheus" if self.prometheus_url else "scrape",
                scrape_interval_s=SCRAPE_INTERVAL_S,
                series_window_s=SERIES_WINDOW_S,
                operator_interval_s=OPERATOR_INTERVAL_S,
                trace=f"{(self.settings.trace_path or demo_trace_path()).name} ({scaling})",
                host=f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
                command=self.settings.command,
                sizing=self.sizing.describe(),
            ),
            models=[
                DemoModelInfo(
                    name=m.name,
                    preset=m.preset,
                    batch_friendliness=m.batch_friendliness,
                    latency_metric=m.latency_metric,
                    slo_p99_ms=m.slo_p99_ms,
                    slo_p999_ms=m.slo_p999_ms,
                    window=describe_window(m),
                    requests=counts[m.name],
                    description=m.description,
                    slo_itl_p99_ms=m.slo_itl_p99_ms,
                    window_label=m.window_label,
                    surge=surges[m.name].describe() if m.name in surges else "",
                    surge_s=(surges[m.name].start_s, surges[m.name].end_s) if m.name in surges else None,
                )
                for m in self.models
            ],
            phases=phases,
            comparison=compare(phases, [m.name for m in self.models]),
            answers=self.answers,
        )


def run_demo(settings: DemoSettings, stream: TextIO = sys.stdout) -> Path:
    """Run the demo; return the HTML report's path. Children are stopped whatever happens."""
    if settings.token_scale is None and models_to_size(settings):
        print("timing a prefill step on this host to size the chat prompts...", file=stream, flush=True)
    settings, sizing = size_to_host(settings)
    if sizing.step_s is not None:
        # Measured here: the command that replays this run replays it at the same size.
        settings = replace(settings, command=f"{settings.command} --token-scale {sizing.scale:g}".strip())
    print(f"sizing: {sizing.describe()}", file=stream, flush=True)
    demo = Demo(settings, stream, sizing)

    def kill_leftovers() -> None:
        for child in demo.children:
            child.kill_now()

    atexit.register(kill_leftovers)

    async def main() -> Path:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if task is not None:
            # SIGTERM unwinds like Ctrl-C does: the phases are cancelled and the children stopped.
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGTERM, task.cancel)
        return await demo.run()

    try:
        return asyncio.run(main())
    finally:
        kill_leftovers()
        atexit.unregister(kill_leftovers)
