"""The demo's report: one self-contained HTML page (figures embedded as base64 PNG) and the
JSON it was drawn from, side by side.

The page is rendered from a :class:`DemoReport` alone, so rendering the JSON again gives the
same page: every number printed is a number stored in the JSON (already rounded), and every
plot is drawn from the JSON's series and histograms. Table cells carry ``data-*`` attributes
naming the figure they show, so a test can check them against the JSON.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from batchpilot_operator.demo.results import (
    MODES,
    DecisionRecord,
    DemoModelInfo,
    DemoReport,
    Histogram,
    Mode,
    ModelPhaseResult,
    TimeSeries,
    format_figure,
)
from batchpilot_operator.demo.series import CHANGE_DIRECTIONS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

REPORT_HTML = "report.html"
REPORT_JSON = "report.json"

_MODE_STYLE: dict[str, dict[str, str]] = {
    "static": {"color": "#7f7f7f", "linestyle": "--"},
    "adaptive": {"color": "#1f77b4", "linestyle": "-"},
}
_SLO_COLOR = "#d62728"


def write_report(report: DemoReport, out_dir: Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.html`` (rendered from that JSON) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / REPORT_JSON
    html_path = out_dir / REPORT_HTML
    json_path.write_text(report.model_dump_json(indent=1) + "\n")
    html_path.write_text(render_html(DemoReport.model_validate_json(json_path.read_text())))
    return html_path, json_path


# ---- figures -----------------------------------------------------------------


def _figure(rows: int, columns: int, height_per_row: float = 3.0) -> tuple[Figure, list[list[Axes]]]:
    # The object API, not pyplot: no global state, no display backend needed.
    from matplotlib.figure import Figure

    columns = max(1, columns)  # a report without models still renders (empty axes)
    figure = Figure(figsize=(6.0 * columns, height_per_row * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    return figure, [list(row) for row in axes]


def _png(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _points(t_s: Sequence[float], values: Sequence[float | None]) -> tuple[list[float], list[float]]:
    """The series with unknown points as NaN, so lines break there instead of dropping to 0."""
    return list(t_s), [math.nan if v is None else v for v in values]


def _phase_models(report: DemoReport, name: str) -> list[tuple[Mode, ModelPhaseResult]]:
    found = []
    for mode in MODES:
        phase = report.phase(mode)
        result = phase.model(name) if phase else None
        if result is not None:
            found.append((mode, result))
    return found


def _plot_series(
    axes: Axes, report: DemoReport, name: str, pick: Callable[[TimeSeries], Sequence[float | None]], label: str
) -> None:
    for mode, result in _phase_models(report, name):
        x, y = _points(result.series.t_s, pick(result.series))
        style = _MODE_STYLE[mode]
        axes.plot(x, y, label=f"{mode} {label}".strip(), color=style["color"], linestyle=style["linestyle"])


def _mark_surge(axes: Sequence[Axes], model: DemoModelInfo) -> None:
    """Shade the stretch of each phase where the model's arrivals surge."""
    if model.surge_s is None:
        return
    for ax in axes:
        ax.axvspan(*model.surge_s, color="#ff7f0e", alpha=0.12, linewidth=0, label="surge")


def _latency_figure(report: DemoReport) -> str:
    """Both tails per trailing window against their SLOs: the SLO metric's on top, the
    inter-token P99 below (where the model has an inter-token SLO or a series of it)."""
    figure, axes = _figure(2, len(report.models), 3.4)
    for column, model in enumerate(report.models):
        ax = axes[0][column]
        for mode, result in _phase_models(report, model.name):
            style = _MODE_STYLE[mode]
            x, p99 = _points(result.series.t_s, result.series.p99_ms)
            ax.plot(x, p99, label=f"{mode} P99", color=style["color"], linestyle=style["linestyle"], linewidth=1.8)
            x, p999 = _points(result.series.t_s, result.series.p999_ms)
            ax.plot(x, p999, label=f"{mode} P99.9", color=style["color"], linestyle=":", linewidth=1.0)
        ax.axhline(
            model.slo_p99_ms, color=_SLO_COLOR, linewidth=1.2, label=f"SLO P99 {format_figure(model.slo_p99_ms)} ms"
        )
        if model.slo_p999_ms is not None:
            ax.axhline(model.slo_p999_ms, color=_SLO_COLOR, linestyle=":", linewidth=1.0, label="SLO P99.9")
        ax.set_yscale("log")
        ax.set_title(f"{model.name}: {model.latency_metric} P99 / P99.9 (trailing {report.run.series_window_s:g} s)")
        ax.set_ylabel("ms")
        itl_ax = axes[1][column]
        for mode, result in _phase_models(report, model.name):
            style = _MODE_STYLE[mode]
            x, itl = _points(result.series.t_s, result.series.itl_p99_ms)
            itl_ax.plot(
                x,
                itl,
                label=f"{mode} inter-token P99",
                color=style["color"],
                linestyle=style["linestyle"],
                linewidth=1.8,
            )
        if model.slo_itl_p99_ms is not None:
            itl_ax.axhline(
                model.slo_itl_p99_ms,
                color=_SLO_COLOR,
                linewidth=1.2,
                label=f"SLO inter-token P99 {format_figure(model.slo_itl_p99_ms)} ms",
            )
        itl_ax.set_yscale("log")
        itl_ax.set_title(f"{model.name}: inter-token P99 (trailing {report.run.series_window_s:g} s)")
        itl_ax.set_xlabel("seconds into the phase")
        itl_ax.set_ylabel("ms")
        _mark_surge([ax, itl_ax], model)
        ax.legend(fontsize=7)
        itl_ax.legend(fontsize=7)
    return _png(figure)


def _batch_figure(report: DemoReport) -> str:
    figure, axes = _figure(1, len(report.models), 3.2)
    for column, model in enumerate(report.models):
        ax = axes[0][column]
        histograms = [(mode, result.decode_batch_size) for mode, result in _phase_models(report, model.name)]
        used = max((_last_used_bucket(h) for _, h in histograms), default=0)
        labels = _bucket_labels(histograms[0][1] if histograms else Histogram(upper_bounds=[], counts=[]), used)
        width = 0.8 / max(1, len(histograms))
        for offset, (mode, histogram) in enumerate(histograms):
            total = histogram.total or 1.0
            shares = [100.0 * c / total for c in histogram.counts[: used + 1]]
            positions = [i + offset * width for i in range(len(shares))]
            ax.bar(positions, shares, width=width, label=mode, color=_MODE_STYLE[mode]["color"])
        ax.set_xticks([i + width * (len(histograms) - 1) / 2 for i in range(len(labels))])
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_xlabel("sequences in the step (bucket)")
        ax.set_ylabel("% of decode steps")
        ax.set_title(f"{model.name}: decode batch size")
        ax.legend(fontsize=7)
    return _png(figure)


def _wait_figure(report: DemoReport) -> str:
    """Cumulative share of requests by queue wait: a curve further left waited less."""
    figure, axes = _figure(1, len(report.models), 3.2)
    for column, model in enumerate(report.models):
        ax = axes[0][column]
        for mode, result in _phase_models(report, model.name):
            histogram = result.queue_wait_s
            total = histogram.total
            if total <= 0 or not histogram.upper_bounds:
                continue
            running, shares = 0.0, []
            for count in histogram.counts[: len(histogram.upper_bounds)]:
                running += count
                shares.append(100.0 * running / total)
            bounds_ms = [1000.0 * b for b in histogram.upper_bounds]
            style = _MODE_STYLE[mode]
            ax.step(bounds_ms, shares, where="post", label=mode, color=style["color"], linestyle=style["linestyle"])
        ax.set_xscale("log")
        ax.set_ylim(0, 101)
        ax.set_xlim(right=_wait_axis_end_ms(report, model.name))
        ax.set_xlabel("queue wait (ms, bucket upper bound)")
        ax.set_ylabel("% of requests waiting at most that")
        ax.set_title(f"{model.name}: queue-wait distribution")
        ax.legend(fontsize=7)
    return _png(figure)


def _wait_axis_end_ms(report: DemoReport, name: str) -> float:
    """A little past the largest bucket any phase used, so the curves are not squeezed left."""
    ends = []
    for _, result in _phase_models(report, name):
        histogram = result.queue_wait_s
        used = _last_used_bucket(histogram)
        if histogram.upper_bounds:
            ends.append(histogram.upper_bounds[min(used, len(histogram.upper_bounds) - 1)])
    return 2000.0 * max(ends, default=1.0)


def _last_used_bucket(histogram: Histogram) -> int:
    used = [i for i, count in enumerate(histogram.counts) if count > 0]
    return max(used, default=0)


def _bucket_labels(histogram: Histogram, used: int) -> list[str]:
    return [f"≤{histogram.upper_bounds[i]:g}" if i < len(histogram.upper_bounds) else "more" for i in range(used + 1)]


def _load_figure(report: DemoReport) -> str:
    figure, axes = _figure(3, len(report.models), 2.4)
    for column, model in enumerate(report.models):
        panels: list[tuple[Callable[[TimeSeries], Sequence[float | None]], str]] = [
            (lambda s: s.tokens_per_s, "generated tokens/s"),
            (lambda s: s.queue_depth, "queue depth (requests)"),
            (lambda s: [None if v is None else 100.0 * v for v in s.kv_usage], "KV-cache usage (%)"),
        ]
        for row, (pick, title) in enumerate(panels):
            ax = axes[row][column]
            _plot_series(ax, report, model.name, pick, "")
            ax.set_title(f"{model.name}: {title}", fontsize=9)
            ax.legend(fontsize=7)
        axes[-1][column].set_xlabel("seconds into the phase")
    return _png(figure)


def _window_figure(report: DemoReport) -> str:
    figure, axes = _figure(3, len(report.models), 2.8)
    for column, model in enumerate(report.models):
        top, bottom, budget_ax = axes[0][column], axes[1][column], axes[2][column]
        for mode, result in _phase_models(report, model.name):
            style = _MODE_STYLE[mode]
            x, target = _points(result.series.t_s, result.series.target_batch_size)
            top.step(
                x, target, where="post", label=f"{mode} target", color=style["color"], linestyle=style["linestyle"]
            )
            x, cap = _points(result.series.t_s, result.series.hard_cap)
            top.step(x, cap, where="post", label=f"{mode} cap", color=style["color"], linestyle=":")
            x, wait = _points(result.series.t_s, result.series.max_wait_ms)
            bottom.step(
                x, wait, where="post", label=f"{mode} max wait", color=style["color"], linestyle=style["linestyle"]
            )
            x, budget = _points(result.series.t_s, result.series.max_prefill_tokens)
            budget_ax.step(
                x, budget, where="post", label=f"{mode} budget", color=style["color"], linestyle=style["linestyle"]
            )
        adaptive = report.phase("adaptive")
        for decision in adaptive.decisions if adaptive else []:
            if decision.model == model.name and decision.direction in CHANGE_DIRECTIONS:
                for ax in (top, bottom, budget_ax):
                    ax.axvline(decision.t_s, color="#2ca02c", alpha=0.5, linewidth=0.9)
        _mark_surge([top, bottom, budget_ax], model)
        if not any(
            v is not None for _, result in _phase_models(report, model.name) for v in result.series.max_prefill_tokens
        ):
            budget_ax.text(
                0.5, 0.5, "no budget: whole prompts", transform=budget_ax.transAxes, ha="center", color="#777777"
            )
        top.set_title(f"{model.name}: target and cap (green lines: the operator changed the window)", fontsize=9)
        top.set_ylabel("sequences")
        bottom.set_title(f"{model.name}: max wait", fontsize=9)
        bottom.set_ylabel("ms")
        budget_ax.set_title(f"{model.name}: prompt tokens per step (maxPrefillTokens; none: whole prompts)", fontsize=9)
        budget_ax.set_ylabel("tokens")
        budget_ax.set_xlabel("seconds into the phase")
        top.legend(fontsize=7)
        bottom.legend(fontsize=7)
        budget_ax.legend(fontsize=7)
    return _png(figure)


def render_figures(report: DemoReport) -> list[tuple[str, str, str]]:
    """(anchor, caption, base64 PNG) for every figure of the report."""
    return [
        (
            "latency",
            "Both tails over time against their SLOs: first-token and inter-token P99 (same arrivals in both "
            "phases; shaded: the surge)",
            _latency_figure(report),
        ),
        ("batch", "Decode batch-size distribution", _batch_figure(report)),
        ("wait", "Queue-wait distribution (cumulative)", _wait_figure(report)),
        ("load", "Throughput, queue depth and KV-cache usage", _load_figure(report)),
        (
            "window",
            "The window's fields over time, its prompt-token budget included, with the operator's decisions",
            _window_figure(report),
        ),
    ]


# ---- HTML --------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1250px; color: #222; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: right; }
th:first-child, td:first-child, td.text { text-align: left; }
td.better { background: #e6f4e6; } td.worse { background: #fbe9e9; }
figure { margin: 1rem 0 2rem; } figcaption { font-weight: 600; margin-bottom: 0.4rem; }
img { max-width: 100%; } code { background: #f4f4f4; padding: 0 0.2rem; } .muted { color: #777; }
"""


def _e(value: object) -> str:
    return html.escape(str(value))


def _cell(value: float | int | None, **data: str) -> str:
    attributes = "".join(f' data-{key.replace("_", "-")}="{_e(v)}"' for key, v in data.items())
    return f"<td{attributes}>{_e(format_figure(value))}</td>"


def _verdict(better: str, static: float | None, adaptive: float | None) -> str:
    if static is None or adaptive is None or better == "neither" or static == adaptive:
        return ""
    improved = adaptive < static if better == "lower" else adaptive > static
    return "better" if improved else "worse"


def _comparison_table(report: DemoReport) -> str:
    rows = ["<tr><th>model</th><th>figure</th><th>unit</th><th>static</th><th>adaptive</th><th>change %</th></tr>"]
    for row in report.comparison:
        verdict = _verdict(row.better, row.static, row.adaptive)
        rows.append(
            f'<tr><td class="text">{_e(row.model)}</td><td class="text">{_e(row.figure)}</td>'
            f'<td class="text">{_e(row.unit)}</td>'
            + _cell(row.static, model=row.model, figure=row.figure, mode="static")
            + _cell(row.adaptive, model=row.model, figure=row.figure, mode="adaptive").replace(
                "<td", f'<td class="{verdict}"' if verdict else "<td", 1
            )
            + _cell(row.change_pct, model=row.model, figure=row.figure, mode="change")
            + "</tr>"
        )
    return '<table id="comparison">' + "".join(rows) + "</table>"


def _load_table(report: DemoReport) -> str:
    columns = ("sent", "accepted", "completed", "errors", "rejected", "lost")
    rows = [
        "<tr><th>phase</th><th>model</th>"
        + "".join(f"<th>{c}</th>" for c in columns)
        + "<th>runtime outcomes</th></tr>"
    ]
    for phase in report.phases:
        for result in phase.models:
            counts = result.load
            values = {c: getattr(counts, c) for c in columns}
            outcomes = ", ".join(f"{k} {v}" for k, v in result.runtime_outcomes.items()) or "—"
            rows.append(
                f'<tr><td class="text">{_e(phase.mode)}</td><td class="text">{_e(result.model)}</td>'
                + "".join(_cell(values[c], model=result.model, mode=phase.mode, count=c) for c in columns)
                + f'<td class="text">{_e(outcomes)}</td></tr>'
            )
    return '<table id="load">' + "".join(rows) + "</table>"


def _models_table(report: DemoReport) -> str:
    rows = [
        "<tr><th>model</th><th>preset</th><th>batch-friendliness</th><th>SLO</th>"
        "<th>starting (static) window</th><th>arrivals per phase</th><th>surge</th><th>why</th></tr>"
    ]
    for m in report.models:
        slo = f"{m.latency_metric} P99 ≤ {format_figure(m.slo_p99_ms)} ms"
        if m.slo_p999_ms is not None:
            slo += f", P99.9 ≤ {format_figure(m.slo_p999_ms)} ms"
        if m.slo_itl_p99_ms is not None:
            slo += f"; inter-token P99 ≤ {format_figure(m.slo_itl_p99_ms)} ms"
        window = f"{m.window_label}: {m.window}" if m.window_label else m.window
        rows.append(
            f'<tr><td class="text">{_e(m.name)}</td><td class="text">{_e(m.preset)}</td>'
            f'<td class="text">{_e(m.batch_friendliness)}</td><td class="text">{_e(slo)}</td>'
            f'<td class="text">{_e(window)}</td>{_cell(m.requests, model=m.name, count="requests")}'
            f'<td class="text">{_e(m.surge or "none")}</td><td class="text">{_e(m.description)}</td></tr>'
        )
    return '<table id="models">' + "".join(rows) + "</table>"


def _answers_section(report: DemoReport) -> str:
    """The real chat model's answers (none with --no-answers)."""
    if not report.answers:
        return ""
    rows = ["<tr><th>question</th><th>answer</th><th>tokens</th><th>seconds</th></tr>"]
    for answer in report.answers:
        rows.append(
            f'<tr><td class="text">{_e(answer.question)}</td><td class="text">{_e(answer.answer)}</td>'
            f"{_cell(answer.completion_tokens)}{_cell(answer.seconds)}</tr>"
        )
    return (
        f"<h2>Real answers</h2><p>Before the replay, the real chat model (<code>{_e(report.answers[0].model)}</code>,"
        " SmolLM2-135M-Instruct) answered these over <code>/v1/chat/completions</code> at temperature 0, alone on"
        " the machine; the replay below runs the <code>tiny</code> preset (random weights), which serves enough"
        ' requests per second here for the operator to act on.</p><table id="answers">' + "".join(rows) + "</table>"
    )


def _shown_decisions(decisions: list[DecisionRecord]) -> list[DecisionRecord]:
    """Every change, and a hold only when its reason differs from the model's previous decision
    (the same hold every interval says nothing new; the JSON keeps them all)."""
    shown: list[DecisionRecord] = []
    last_reason: dict[str, str] = {}
    for decision in decisions:
        if decision.direction in CHANGE_DIRECTIONS or last_reason.get(decision.model) != decision.reason:
            shown.append(decision)
        last_reason[decision.model] = decision.reason
    return shown


def _decisions_list(report: DemoReport) -> str:
    parts = []
    for phase in report.phases:
        changes = sum(1 for d in phase.decisions if d.direction in CHANGE_DIRECTIONS)
        parts.append(
            f"<h3>{_e(phase.mode)} phase: {len(phase.decisions)} decisions, {changes} of them window changes</h3>"
        )
        shown = _shown_decisions(phase.decisions)
        if not shown:
            continue
        items = "".join(
            f'<tr><td>{_e(format_figure(d.t_s))}</td><td class="text">{_e(d.model)}</td>'
            f'<td class="text">{_e(d.direction)}</td><td class="text">{_e(d.window or "")}</td>'
            + _cell(d.budget, model=d.model, mode=phase.mode, budget_at=format_figure(d.t_s))
            + f'<td class="text">{_e(d.reason)}</td></tr>'
            for d in shown
        )
        parts.append(
            f'<table class="decisions" data-mode="{_e(phase.mode)}"><tr><th>s</th><th>model</th>'
            f"<th>direction</th><th>window</th><th>budget</th><th>reason</th></tr>{items}</table>"
        )
    if report.phases:
        parts.append('<p class="muted">Repeated holds with an unchanged reason are left out here.</p>')
    return "".join(parts)


def _static_names(report: DemoReport) -> str:
    named = [f"{m.name}: {m.window_label}" for m in report.models if m.window_label]
    return "; ".join(named) if named else "each profile's starting window"


def render_html(report: DemoReport) -> str:
    run = report.run
    reproduce = f" · reproduce with <code>{_e(run.command)}</code>" if run.command else ""
    sizing = f" · sized to this host: {_e(run.sizing)}" if run.sizing else ""
    figures = "".join(
        f'<figure id="{anchor}"><figcaption>{_e(caption)}</figcaption>'
        f'<img alt="{_e(caption)}" src="data:image/png;base64,{png}"></figure>'
        for anchor, caption, png in render_figures(report)
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>batchpilot demo report</title><style>{_CSS}</style></head>
<body>
<h1>batchpilot demo: static vs adaptive batching windows</h1>
<p>Two runtimes served two models while the same arrivals were replayed twice: first with the
operator holding each profile's window (<code>static</code>: {_e(_static_names(report))}), then retuning it
(<code>adaptive</code>). A model with an inter-token SLO is held to both tails at once: the first
token (<code>slo.p99Ms</code>) and the gaps between tokens (<code>slo.interTokenP99Ms</code>), which
the prompt-token budget per step (<code>maxPrefillTokens</code>) trades against each other.
Every figure below is in <code>{REPORT_JSON}</code> beside this page.</p>
<p class="muted">{_e(report.created_at)} · host: {_e(run.host)} · trace: {_e(run.trace)} ·
replay {_e(format_figure(run.phase_replay_s))} s per phase · wall time {_e(format_figure(run.wall_s))} s ·
operator metrics from {_e(run.metrics_source)}, every {_e(run.operator_interval_s)} s ·
demo scrapes every {_e(format_figure(run.scrape_interval_s))} s{sizing}{reproduce}</p>
{_answers_section(report)}<h2>Models</h2>{_models_table(report)}
<h2>Static vs adaptive</h2>
<p>Latencies are those of each model's SLO metric over the whole phase, read from the runtimes'
histograms; the inter-token figures are those of the gaps between two tokens of one request;
green: adaptive did better.</p>
{_comparison_table(report)}
<h2>Every request accounted for</h2>
<p>Accepted requests either completed or ended with an explicit error: <em>lost</em> must be 0.</p>
{_load_table(report)}
<h2>Figures</h2>{figures}
<h2>Decisions</h2>{_decisions_list(report)}
</body></html>
"""
