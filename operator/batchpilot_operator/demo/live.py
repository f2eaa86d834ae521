"""The demo's terminal view: a rich live table on a terminal, plain progress lines otherwise.

Per model: the window in force (with its prompt-token budget per step), P50/P99 of its SLO
metric against the SLO and the inter-token P99 against its SLO over the last few seconds, queue depth, running sequences, tokens/s, KV-cache usage, and the operator's
last decision with its reason; above them, the phase and a progress bar of the replay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from batchpilot_operator.demo.results import format_figure, round_figure
from batchpilot_operator.demo.series import Snapshot, histogram_between, increase_between, quantile_ms
from batchpilot_operator.tuning.model_metrics import SLO_LATENCY_HISTOGRAMS
from batchpilot_runtime.contract import metric_names as rm

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.live import Live

    from batchpilot_operator.demo.collector import Collector
    from batchpilot_operator.demo.settings import DemoModel

VIEW_WINDOW_S = 10.0


@dataclass
class LastDecision:
    at_s: float
    direction: str
    reason: str
    window: str | None


@dataclass
class ViewState:
    """What the orchestration tells the view; the figures come from the collector."""

    phase: str = "starting"
    phase_number: int = 0
    phases: int = 2
    replay_s: float = 0.0
    phase_started_s: float | None = None
    requests_total: int = 0
    requests_done: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    decisions: dict[str, LastDecision] = field(default_factory=dict)
    decisions_in_phase: int = 0
    note: str = ""


@dataclass(frozen=True)
class ModelFigures:
    window: str
    p50_ms: float | None
    p99_ms: float | None
    queue_depth: float | None
    running: float | None
    tokens_per_s: float | None
    kv_usage: float | None
    itl_p99_ms: float | None = None


def model_figures(before: Snapshot | None, latest: Snapshot | None, latency_metric: str) -> ModelFigures:
    """The live figures of one model from two snapshots (the latest and one some seconds earlier)."""
    if latest is None:
        return ModelFigures("—", None, None, None, None, None, None)
    window = latest.window()
    # target/cap/wait[/budget]: short enough for an 80-column terminal.
    shown = f"{window.target_batch_size}/{window.hard_cap}/{format_figure(window.max_wait_ms)} ms" if window else "—"
    if window is not None and window.max_prefill_tokens is not None:
        shown += f"/{window.max_prefill_tokens}"
    latency = histogram_between(before, latest, SLO_LATENCY_HISTOGRAMS[latency_metric]) if before is not None else None
    span_s = latest.at_s - before.at_s if before is not None else 0.0
    tokens = increase_between(before, latest, rm.GENERATED_TOKENS_TOTAL) if before is not None else 0.0
    return ModelFigures(
        window=shown,
        p50_ms=quantile_ms(latency, 0.5) if latency is not None else None,
        p99_ms=quantile_ms(latency, 0.99) if latency is not None else None,
        queue_depth=latest.gauges.get(rm.QUEUE_DEPTH),
        running=latest.gauges.get(rm.RUNNING_SEQUENCES),
        tokens_per_s=round_figure(tokens / span_s, 3) if span_s > 0 else None,
        kv_usage=latest.gauges.get(rm.KV_CACHE_USAGE_RATIO),
        itl_p99_ms=quantile_ms(histogram_between(before, latest, rm.INTER_TOKEN_SECONDS), 0.99)
        if before is not None
        else None,
    )


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100.0 * value:.0f}%"


class View:
    """Renders :class:`ViewState` and the collector's latest snapshots, live or as plain lines."""

    def __init__(
        self,
        models: tuple[DemoModel, ...],
        collector: Collector | None,
        state: ViewState,
        *,
        live: bool,
        stream: TextIO,
    ) -> None:
        self.models = models
        self.collector = collector
        self.state = state
        self.live_enabled = live
        self.stream = stream
        self._live: Live | None = None
        self._console: Console | None = None
        self._last_plain_s = 0.0

    def start(self) -> None:
        if not self.live_enabled:
            return
        from rich.console import Console
        from rich.live import Live

        self._console = Console(file=self.stream)
        self._live = Live(self.render(), console=self._console, refresh_per_second=4, transient=False)
        self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.stop()
            self._live = None

    def say(self, text: str) -> None:
        """A line that stays (phase changes, decisions, results)."""
        if self._live is not None and self._console is not None:
            self._console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def refresh(self, now_s: float) -> None:
        """Redraw the live view, or print the plain status every ten seconds."""
        if self._live is not None:
            self._live.update(self.render())
            return
        if now_s - self._last_plain_s >= 10.0:
            self._last_plain_s = now_s
            for line in self.plain_lines(now_s):
                print(line, file=self.stream, flush=True)

    def _figures(self, model: DemoModel) -> ModelFigures:
        if self.collector is None:
            return model_figures(None, None, model.latency_metric)
        before, latest = self.collector.recent(model.name, VIEW_WINDOW_S)
        return model_figures(before, latest, model.latency_metric)

    def _label(self, model: DemoModel) -> str:
        """The window's name while the static phase holds it."""
        return f" ({model.window_label})" if self.state.phase == "static" and model.window_label else ""

    def plain_lines(self, now_s: float) -> list[str]:
        state = self.state
        elapsed = 0.0 if state.phase_started_s is None else now_s - state.phase_started_s
        lines = [
            f"[{state.phase}] {state.requests_done}/{state.requests_total} requests answered, "
            f"{elapsed:.0f}/{state.replay_s:.0f} s"
        ]
        for model in self.models:
            f = self._figures(model)
            itl = (
                f"inter-token P99 {format_figure(f.itl_p99_ms)} ms (SLO {format_figure(model.slo_itl_p99_ms)} ms); "
                if model.slo_itl_p99_ms is not None
                else ""
            )
            lines.append(
                f"  {model.name}{self._label(model)}: {f.window}; {model.latency_metric} P50 {format_figure(f.p50_ms)} ms, "
                f"P99 {format_figure(f.p99_ms)} ms (SLO {format_figure(model.slo_p99_ms)} ms); {itl}"
                f"queue {format_figure(f.queue_depth)}, running {format_figure(f.running)}, "
                f"{format_figure(f.tokens_per_s)} tokens/s, KV {_percent(f.kv_usage)}"
            )
        return lines

    def render(self) -> RenderableType:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        state = self.state
        now_s = time.monotonic()
        elapsed = 0.0 if state.phase_started_s is None else now_s - state.phase_started_s
        header = Text.assemble(
            ("batchpilot demo", "bold"),
            f"  phase {state.phase_number}/{state.phases}: ",
            (state.phase, "bold cyan"),
            f"   replay {min(elapsed, state.replay_s):.0f}/{state.replay_s:.0f} s, "
            f"{state.requests_done}/{state.requests_total} requests answered",
        )
        bar = ProgressBar(total=max(1, state.requests_total), completed=state.requests_done, width=60)
        table = Table(expand=True, title_justify="left")
        for column, justify in (
            ("model", "left"),
            ("target/cap/wait/budget", "left"),
            ("P50 ms", "right"),
            ("P99 ms", "right"),
            ("SLO P99", "right"),
            ("ITL P99", "right"),
            ("SLO ITL", "right"),
            ("queue", "right"),
            ("running", "right"),
            ("tokens/s", "right"),
            ("KV", "right"),
        ):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]
        decisions = Table(expand=True, show_header=True)
        decisions.add_column("model")
        decisions.add_column("last decision", ratio=1)
        for model in self.models:
            f = self._figures(model)
            over = f.p99_ms is not None and f.p99_ms > model.slo_p99_ms
            p99 = Text(format_figure(f.p99_ms), style="bold red" if over else "green")
            itl_slo = model.slo_itl_p99_ms
            itl_over = itl_slo is not None and f.itl_p99_ms is not None and f.itl_p99_ms > itl_slo
            itl = Text(
                format_figure(f.itl_p99_ms), style="bold red" if itl_over else "green" if itl_slo is not None else ""
            )
            table.add_row(
                model.name + self._label(model),
                f.window,
                format_figure(f.p50_ms),
                p99,
                f"{model.latency_metric} {format_figure(model.slo_p99_ms)}",
                itl,
                format_figure(itl_slo),
                format_figure(f.queue_depth),
                format_figure(f.running),
                format_figure(f.tokens_per_s),
                _percent(f.kv_usage),
            )
            last = state.decisions.get(model.name)
            text = "none yet" if last is None else f"{last.direction}: {last.reason}"
            decisions.add_row(model.name, text)
        parts: list[RenderableType] = [header, bar, table, decisions]
        if state.note:
            parts.append(Text(state.note, style="dim"))
        return Group(*parts)
