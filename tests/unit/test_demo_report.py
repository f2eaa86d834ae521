"""The demo report: built from a hand-made report JSON, its numbers are the JSON's."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from batchpilot_operator.demo.report import render_html, write_report
from batchpilot_operator.demo.results import (
    DecisionRecord,
    DemoReport,
    LoadCounts,
    PhaseResult,
    compare,
    format_figure,
    round_figure,
)
from batchpilot_operator.demo.run import load_counts
from batchpilot_operator.demo.series import (
    Snapshot,
    histogram_between,
    quantile_ms,
    share_at_most,
    snapshot_from_exposition,
    summarize_model_phase,
)
from batchpilot_runtime.replay.loadgen import OUTCOMES, summarize

BOUNDS_S = [0.01, 0.05, 0.1, 0.5, 1.0]
BATCH_BOUNDS = [1.0, 2.0, 4.0, 8.0]


def make_series(p99_ms: float, target: int) -> dict[str, Any]:
    t_s = [2.0, 4.0, 6.0, 8.0]
    return {
        "t_s": t_s,
        "p50_ms": [p99_ms / 4, None, p99_ms / 3, p99_ms / 5],
        "p99_ms": [p99_ms, None, p99_ms * 1.5, p99_ms],
        "p999_ms": [p99_ms * 1.2, None, p99_ms * 2, p99_ms * 1.1],
        "queue_depth": [0.0, 3.0, 7.0, 1.0],
        "running": [1.0, 4.0, 8.0, 2.0],
        "kv_usage": [0.05, 0.2, 0.41, 0.1],
        "tokens_per_s": [50.0, 120.5, 160.25, 80.0],
        "target_batch_size": [float(target)] * 4,
        "hard_cap": [float(target * 2)] * 4,
        "max_wait_ms": [50.0, 50.0, 20.0, 20.0],
        "itl_p99_ms": [p99_ms / 10, None, p99_ms / 8, p99_ms / 12],
        "max_prefill_tokens": [1024.0, 1024.0, 512.0, 512.0] if target == 4 else [1024.0] * 4,
    }


def make_model_result(name: str, mode: str, p99_ms: float, tokens_per_s: float) -> dict[str, Any]:
    return {
        "model": name,
        "load": {"sent": 40, "accepted": 38, "completed": 37, "errors": 1, "rejected": 2},
        "runtime_outcomes": {"completed": 37, "error": 1},
        "p50_ms": round(p99_ms / 4, 1),
        "p99_ms": p99_ms,
        "p999_ms": round(p99_ms * 1.3, 1),
        "e2e_p99_ms": p99_ms * 3,
        "slo_met_share": 0.925 if mode == "adaptive" else 0.8125,
        "tokens_per_s": tokens_per_s,
        "goodput_tokens_per_s": round(tokens_per_s * 0.9, 2),
        "mean_decode_batch_size": 3.25,
        "kv_usage_max": 0.41,
        "queue_depth_max": 7.0,
        "preemptions": 0,
        "decisions": 2 if mode == "adaptive" else 0,
        "window_start": {"target_batch_size": 8, "hard_cap": 16, "max_wait_ms": 50.0, "generation": 1},
        "window_end": {"target_batch_size": 4, "hard_cap": 8, "max_wait_ms": 20.0, "generation": 3},
        "series": make_series(p99_ms, 8 if mode == "static" else 4),
        "decode_batch_size": {"upper_bounds": BATCH_BOUNDS, "counts": [5.0, 10.0, 20.0, 3.0, 0.0]},
        "queue_wait_s": {"upper_bounds": BOUNDS_S, "counts": [20.0, 10.0, 5.0, 2.0, 1.0, 0.0]},
        "itl_p50_ms": round(p99_ms / 40, 2),
        "itl_p99_ms": round(p99_ms / 10, 2),
        "itl_slo_met_share": 0.995 if mode == "adaptive" else 0.97,
    }


def make_report() -> DemoReport:
    models = [("chat", 420.0, 800.0), ("bulk", 1900.0, 3000.0)]
    phases = []
    for mode, factor, speed in (("static", 1.0, 1.0), ("adaptive", 0.6, 1.2)):
        phases.append(
            PhaseResult.model_validate(
                {
                    "mode": mode,
                    "replay_s": 20.0,
                    "wall_s": 23.5,
                    "models": [
                        make_model_result(name, mode, round(p99 * factor, 1), tps * speed) for name, p99, tps in models
                    ],
                    "decisions": [
                        {
                            "t_s": 6.0,
                            "model": "chat",
                            "direction": "down",
                            "reason": "P99 1.2 s over the SLO <800 ms>",
                            "window": "target=4 cap=8 budget=512",
                            "budget": 512,
                        }
                    ]
                    if mode == "adaptive"
                    else [],
                }
            )
        )
    return DemoReport.model_validate(
        {
            "created_at": "2026-11-29T15:00:00Z",
            "run": {
                "duration_s": 40.0,
                "phase_replay_s": 20.0,
                "wall_s": 61.2,
                "metrics_source": "prometheus",
                "scrape_interval_s": 1.0,
                "series_window_s": 10.0,
                "operator_interval_s": 5,
                "trace": "azure_llm_2023_conv.csv, time x40",
                "host": "test",
                "sizing": "chat tokens x0.65: a 1024-token prefill step took 180.0 ms here",
            },
            "models": [
                {
                    "name": name,
                    "preset": "tiny",
                    "batch_friendliness": "high",
                    "latency_metric": "ttft",
                    "slo_p99_ms": slo,
                    "slo_p999_ms": None,
                    "window": "target 8, cap 16, wait 50 ms",
                    "requests": 40,
                    "description": "<a hand-made model>",
                    "slo_itl_p99_ms": 50.0 if name == "chat" else None,
                    "window_label": "engine defaults" if name == "chat" else "the profile's starting window",
                    "surge": "surge x2.5 from 8 s to 14 s" if name == "chat" else "",
                    "surge_s": [8.0, 14.0] if name == "chat" else None,
                }
                for name, slo, _ in [(n, p * 2, t) for n, p, t in models]
            ],
            "phases": [p.model_dump() for p in phases],
            "comparison": [r.model_dump() for r in compare(phases, [name for name, _, _ in models])],
        }
    )


class CellCollector(HTMLParser):
    """Every <td> with data-* attributes, with its text, and every embedded image."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[tuple[dict[str, str], str]] = []
        self.images: list[str] = []
        self._open: dict[str, str] | None = None
        self._text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        if tag == "td":
            self._open = {k.removeprefix("data-"): v for k, v in attributes.items() if k.startswith("data-")}
            self._text = ""
        elif tag == "img":
            self.images.append(attributes.get("src", ""))

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._text += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._open is not None:
            if self._open:
                self.cells.append((self._open, self._text))
            self._open = None


def parse_cells(text: str) -> CellCollector:
    collector = CellCollector()
    collector.feed(text)
    return collector


def number(cell_text: str) -> float | None:
    return None if cell_text == "—" else float(cell_text)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The report written once for the module: drawing the figures is the slow part."""
    return write_report(make_report(), tmp_path_factory.mktemp("report"))


@pytest.mark.slow
def test_comparison_cells_equal_the_json(written: tuple[Path, Path]) -> None:
    html_path, json_path = written
    stored = json.loads(json_path.read_text())
    cells = parse_cells(html_path.read_text()).cells
    by_key = {(c["model"], c["figure"], c["mode"]): text for c, text in cells if "figure" in c}
    assert len(stored["comparison"]) == 28
    for row in stored["comparison"]:
        assert number(by_key[(row["model"], row["figure"], "static")]) == row["static"]
        assert number(by_key[(row["model"], row["figure"], "adaptive")]) == row["adaptive"]
        assert number(by_key[(row["model"], row["figure"], "change")]) == row["change_pct"]


def test_comparison_rows_come_from_the_phases() -> None:
    report = make_report()
    rows = {(r.model, r.figure): r for r in report.comparison}
    p99 = rows[("chat", "P99 latency")]
    assert (p99.static, p99.adaptive) == (420.0, 252.0)
    assert p99.change_pct == -40.0
    within = rows[("bulk", "Requests within the SLO")]
    assert (within.static, within.adaptive) == (81.25, 92.5)
    assert rows[("chat", "Lost requests")].static == 0.0
    assert rows[("chat", "Window changes")].adaptive == 2.0
    assert rows[("bulk", "Peak KV usage")].adaptive == 41.0
    itl = rows[("chat", "Inter-token P99")]
    assert (itl.static, itl.adaptive) == (42.0, 25.2)
    gaps = rows[("chat", "Gaps within the inter-token SLO")]
    assert (gaps.static, gaps.adaptive) == (97.0, 99.5)


@pytest.mark.slow
def test_report_names_both_slos_the_static_window_the_surge_and_the_budget(written: tuple[Path, Path]) -> None:
    html_path, json_path = written
    text = html_path.read_text()
    assert "ttft P99 ≤ 840 ms; inter-token P99 ≤ 50 ms" in text
    assert "engine defaults: target 8, cap 16, wait 50 ms" in text
    assert "surge x2.5 from 8 s to 14 s" in text
    assert "sized to this host: chat tokens x0.65: a 1024-token prefill step took 180.0 ms here" in text
    assert "static</code>: chat: engine defaults; bulk: the profile&#x27;s starting window" in text
    # The decision's budget is printed in its own cell, as stored.
    budgets = [(c, t) for c, t in parse_cells(text).cells if "budget-at" in c]
    assert budgets == [({"model": "chat", "mode": "adaptive", "budget-at": "6"}, "512")]
    stored = json.loads(json_path.read_text())
    adaptive_chat = stored["phases"][1]["models"][0]
    assert adaptive_chat["series"]["itl_p99_ms"] == [25.2, None, 31.5, 21.0]
    assert adaptive_chat["series"]["max_prefill_tokens"] == [1024.0, 1024.0, 512.0, 512.0]


@pytest.mark.slow
def test_load_counts_in_the_html_equal_the_json(written: tuple[Path, Path]) -> None:
    html_path, json_path = written
    stored = json.loads(json_path.read_text())
    cells = {
        (c["model"], c["mode"], c["count"]): text
        for c, text in parse_cells(html_path.read_text()).cells
        if "count" in c and "mode" in c
    }
    for phase in stored["phases"]:
        for result in phase["models"]:
            for count in ("sent", "accepted", "completed", "errors", "rejected"):
                assert number(cells[(result["model"], phase["mode"], count)]) == result["load"][count]
            assert number(cells[(result["model"], phase["mode"], "lost")]) == 0


@pytest.mark.slow
def test_figures_are_embedded_pngs_and_text_is_escaped(written: tuple[Path, Path]) -> None:
    text = written[0].read_text()
    images = parse_cells(text).images
    assert len(images) == 5
    for src in images:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)
        assert base64.b64decode(src.removeprefix(prefix)).startswith(b"\x89PNG\r\n\x1a\n")
    assert "&lt;a hand-made model&gt;" in text
    assert "<a hand-made" not in text
    assert "P99 1.2 s over the SLO &lt;800 ms&gt;" in text


@pytest.mark.slow
def test_report_json_round_trips_and_renders_the_same_page(written: tuple[Path, Path]) -> None:
    html_path, json_path = written
    stored = DemoReport.model_validate_json(json_path.read_text())
    assert stored == make_report()
    assert render_html(stored) == html_path.read_text()


@pytest.mark.parametrize(
    ("value", "rounded", "shown"),
    [(1234.5678, 1235.0, "1235"), (0.000123456, 0.0001235, "0.0001235"), (float("nan"), None, "—"), (0.0, 0.0, "0")],
)
def test_figures_are_printed_exactly_as_stored(value: float, rounded: float | None, shown: str) -> None:
    assert round_figure(value) == rounded
    assert format_figure(rounded) == shown


EXPOSITION = """
# TYPE batchpilot_ttft_seconds histogram
batchpilot_ttft_seconds_bucket{model="chat",lane="default",le="0.1"} 3
batchpilot_ttft_seconds_bucket{model="chat",lane="default",le="1.0"} 9
batchpilot_ttft_seconds_bucket{model="chat",lane="default",le="+Inf"} 10
batchpilot_ttft_seconds_count{model="chat",lane="default"} 10
batchpilot_ttft_seconds_sum{model="chat",lane="default"} 4.2
batchpilot_ttft_seconds_bucket{model="chat",lane="critical",le="0.1"} 1
batchpilot_ttft_seconds_bucket{model="chat",lane="critical",le="1.0"} 1
batchpilot_ttft_seconds_bucket{model="chat",lane="critical",le="+Inf"} 1
batchpilot_ttft_seconds_count{model="chat",lane="critical"} 1
batchpilot_ttft_seconds_sum{model="chat",lane="critical"} 0.05
batchpilot_ttft_seconds_bucket{model="bulk",lane="default",le="0.1"} 100
batchpilot_ttft_seconds_bucket{model="bulk",lane="default",le="1.0"} 100
batchpilot_ttft_seconds_bucket{model="bulk",lane="default",le="+Inf"} 100
# TYPE batchpilot_requests_total counter
batchpilot_requests_total{model="chat",outcome="completed"} 11
batchpilot_requests_total{model="chat",outcome="error"} 1
# TYPE batchpilot_queue_depth gauge
batchpilot_queue_depth{model="chat"} 4
# TYPE batchpilot_inter_token_seconds histogram
batchpilot_inter_token_seconds_bucket{model="chat",lane="default",le="0.01"} 90
batchpilot_inter_token_seconds_bucket{model="chat",lane="default",le="0.05"} 99
batchpilot_inter_token_seconds_bucket{model="chat",lane="default",le="+Inf"} 100
batchpilot_inter_token_seconds_count{model="chat",lane="default"} 100
batchpilot_inter_token_seconds_sum{model="chat",lane="default"} 0.9
# TYPE batchpilot_window_max_prefill_tokens gauge
batchpilot_window_max_prefill_tokens{model="chat"} 256
batchpilot_window_max_prefill_tokens{model="bulk"} 0
"""


def test_snapshot_sums_lanes_and_keeps_one_model() -> None:
    before = snapshot_from_exposition("", "chat", 0.0)
    after = snapshot_from_exposition(EXPOSITION, "chat", 2.0)
    histogram = histogram_between(before, after, "batchpilot_ttft_seconds")
    assert histogram.upper_bounds == [0.1, 1.0]
    assert histogram.counts == [4.0, 6.0, 1.0]
    assert after.counters_with_prefix("batchpilot_requests_total") == {"completed": 11.0, "error": 1.0}
    assert after.counter("batchpilot_ttft_seconds_count") == 11.0
    assert after.gauges["batchpilot_queue_depth"] == 4.0
    # rank 5.5 of 11: 1.5 into the second bucket's 6 observations -> 0.1 + 0.9 * 1.5 / 6
    assert quantile_ms(histogram, 0.5) == 325.0
    assert share_at_most(histogram, 0.55) == pytest.approx((4 + 3) / 11)


def test_snapshot_reads_the_inter_token_histogram_and_the_budget_gauge() -> None:
    chat = snapshot_from_exposition(EXPOSITION, "chat", 2.0)
    gaps = histogram_between(None, chat, "batchpilot_inter_token_seconds")
    assert gaps.counts == [90.0, 9.0, 1.0]
    assert quantile_ms(gaps, 0.99) == 50.0
    assert chat.budget() == 256
    # The runtime's 0 means whole prompts: no budget.
    assert snapshot_from_exposition(EXPOSITION, "bulk", 2.0).budget() is None


# ---- the pure parts the report is built from ------------------------------------------------


def make_snapshot(
    at_s: float,
    completed: float,
    ttft_buckets: dict[float, float],
    tokens: float,
    itl_buckets: dict[float, float] | None = None,
    budget: float = 0.0,
) -> Snapshot:
    return Snapshot(
        at_s=at_s,
        gauges={
            "batchpilot_queue_depth": 2.0,
            "batchpilot_kv_cache_usage_ratio": 0.25,
            "batchpilot_window_target_batch_size": 8.0,
            "batchpilot_window_hard_cap": 16.0,
            "batchpilot_window_max_wait_seconds": 0.05,
            "batchpilot_window_generation": 3.0,
            "batchpilot_window_max_prefill_tokens": budget,
        },
        counters={
            "batchpilot_requests_total:completed": completed,
            "batchpilot_generated_tokens_total": tokens,
            "batchpilot_batch_size:decode_sum": tokens,
            "batchpilot_batch_size:decode_count": tokens / 4,
        },
        histograms={"batchpilot_ttft_seconds": ttft_buckets, "batchpilot_inter_token_seconds": itl_buckets or {}},
    )


def test_phase_summary_is_the_difference_of_its_first_and_last_snapshots() -> None:
    snapshots = [
        make_snapshot(10.0, 5, {0.1: 5.0, 1.0: 5.0, math.inf: 5.0}, 100.0),
        make_snapshot(12.0, 10, {0.1: 8.0, 1.0: 10.0, math.inf: 10.0}, 300.0),
        make_snapshot(14.0, 25, {0.1: 15.0, 1.0: 25.0, math.inf: 25.0}, 500.0),
    ]
    decisions = [
        DecisionRecord(t_s=1.0, model="chat", direction="hold", reason="dead band"),
        DecisionRecord(t_s=2.0, model="chat", direction="down", reason="over"),
        DecisionRecord(t_s=2.0, model="bulk", direction="up", reason="headroom"),
    ]
    result = summarize_model_phase(
        model="chat",
        latency_metric="ttft",
        slo_p99_ms=500.0,
        snapshots=snapshots,
        load=LoadCounts(sent=20, accepted=20, completed=20, errors=0, rejected=0),
        decisions=decisions,
        series_window_s=10.0,
    )
    # 20 requests in the phase: 10 at <= 100 ms, 10 in (100 ms, 1 s].
    assert result.runtime_outcomes == {"completed": 20}
    assert result.p50_ms == 100.0
    assert result.p99_ms == round_figure(100.0 + 900.0 * 9.8 / 10)
    assert result.slo_met_share == round_figure((10 + 10 * 400 / 900) / 20)
    assert result.tokens_per_s == 100.0  # 400 tokens over 4 s
    assert result.mean_decode_batch_size == 4.0
    assert result.decisions == 1  # only the change of this model's window counts
    assert result.window_end is not None and result.window_end.max_wait_ms == 50.0
    assert result.series.t_s == [2.0, 4.0]
    assert result.kv_usage_max == 0.25
    # No inter-token SLO, no gaps, no budget: unknown, not zero.
    assert (result.itl_p99_ms, result.itl_slo_met_share) == (None, None)
    assert result.series.itl_p99_ms == [None, None]
    assert result.series.max_prefill_tokens == [None, None]
    assert result.window_end is not None and result.window_end.max_prefill_tokens is None


def test_phase_summary_has_the_inter_token_tail_and_the_budget_over_time() -> None:
    snapshots = [
        make_snapshot(0.0, 0, {}, 0.0, {0.01: 0.0, 0.1: 0.0, math.inf: 0.0}, budget=1024.0),
        make_snapshot(10.0, 10, {}, 200.0, {0.01: 80.0, 0.1: 100.0, math.inf: 100.0}, budget=1024.0),
        make_snapshot(20.0, 20, {}, 400.0, {0.01: 160.0, 0.1: 200.0, math.inf: 200.0}, budget=256.0),
    ]
    result = summarize_model_phase(
        model="chat",
        latency_metric="ttft",
        slo_p99_ms=500.0,
        slo_itl_p99_ms=55.0,
        snapshots=snapshots,
        load=LoadCounts(sent=20, accepted=20, completed=20, errors=0, rejected=0),
        decisions=[],
        series_window_s=10.0,
    )
    # 200 gaps: 160 at <= 10 ms, 40 in (10 ms, 100 ms]; 55 ms is half-way through that bucket.
    assert result.itl_p99_ms == round_figure(10.0 + 90.0 * 38.0 / 40.0)
    assert result.itl_slo_met_share == round_figure((160 + 20) / 200)
    # Per trailing 10 s: the first window's 20 of 100 slow gaps, then the second's 20 of 100.
    assert result.series.itl_p99_ms == [round_figure(10.0 + 90.0 * 19.0 / 20.0)] * 2
    assert result.series.max_prefill_tokens == [1024.0, 256.0]
    assert result.window_start is not None and result.window_start.max_prefill_tokens == 1024
    assert result.window_end is not None and result.window_end.describe().endswith("budget 256 tokens")


def test_load_counts_call_a_broken_stream_lost() -> None:
    outcomes = dict.fromkeys(OUTCOMES, 0)
    outcomes.update(completed=7, rejected_429=2, server_error=1, incomplete=1)
    summary = summarize([], 1.0, [])
    counts = load_counts(dataclasses.replace(summary, requests_sent=11, outcomes=outcomes))
    assert (counts.sent, counts.accepted, counts.completed, counts.errors, counts.rejected) == (11, 9, 7, 1, 2)
    assert counts.lost == 1
