"""The no-regret suite's summary: ratios per cell, dropped cells, and each minimum with its cell."""

from __future__ import annotations

import itertools
import random

import pytest

from batchpilot_runtime.replay.trace import TraceRequest
from tests.bench.bench_suite import summarize
from tests.bench.suite_shapes import bursts, doubling, fit_context, largest_burst


def cell(adaptive: float, start: float, best: float, defaults: float = 0.0) -> dict[str, float]:
    return {"adaptive": adaptive, "starting_window": start, "best_static": best, "engine_defaults": defaults}


def test_the_minimum_of_each_ratio_names_its_cell_and_the_mean_covers_the_kept_cells() -> None:
    report = summarize(
        {
            "a 1s": cell(0.5, 0.4, 0.5),
            "b 1s": cell(0.3, 0.4, 0.6),
            "c 1s": cell(0.0, 0.0, 0.0),  # no static window meets: dropped
        }
    )
    summary = report["summary"]
    assert summary["cells_kept"] == 2 and summary["cells_dropped"] == 1
    assert "dropped" in report["cells"]["c 1s"]
    assert summary["adaptive_over_best_min"] == pytest.approx(0.5)
    assert summary["adaptive_over_best_min_cell"] == "b 1s"
    assert summary["adaptive_over_best_mean"] == pytest.approx(0.75)
    assert summary["adaptive_over_start_min"] == pytest.approx(0.75)
    assert summary["adaptive_over_start_min_cell"] == "b 1s"
    assert summary["cells_under_0.95x_adaptive_over_best"] == ["b 1s"]
    assert summary["cells_under_0.98x_adaptive_over_start"] == ["b 1s"]
    assert "adaptive_auto_over_best_min" not in summary  # no run from a derived window in these cells


def test_the_run_from_a_derived_window_is_judged_against_that_window_held_still() -> None:
    cells = {
        "a 1s": {**cell(0.5, 0.4, 0.6), "adaptive_auto": 0.66, "auto_window": 0.55},
        "b 1s": {**cell(0.3, 0.4, 0.6), "adaptive_auto": 0.5, "auto_window": 0.55},
    }
    report = summarize(cells)
    summary = report["summary"]
    assert report["cells"]["a 1s"]["adaptive_auto_over_auto_window"] == pytest.approx(1.2)
    assert report["cells"]["a 1s"]["adaptive_auto_over_best_static"] == pytest.approx(1.1)
    assert summary["adaptive_auto_over_best_min"] == pytest.approx(0.5 / 0.6)
    assert summary["adaptive_auto_over_best_min_cell"] == "b 1s"
    assert summary["adaptive_auto_over_start_min"] == pytest.approx(0.5 / 0.55)
    assert summary["cells_under_0.98x_adaptive_auto_over_start"] == ["b 1s"]
    # The derived window is one more static window: best static is the best of them all.
    assert summarize({"c 1s": {**cell(0.5, 0.4, 0.6), "auto_window": 0.8}})["cells"]["c 1s"]["best_static_any"] == 0.8


def test_best_static_is_the_best_of_every_static_window_run() -> None:
    # The starting window beat the grid here: adaptive is judged against it.
    report = summarize({"a 1s": cell(0.5, 0.8, 0.6, defaults=0.7)})
    assert report["cells"]["a 1s"]["best_static_any"] == pytest.approx(0.8)
    assert report["cells"]["a 1s"]["adaptive_over_best_static"] == pytest.approx(0.5 / 0.8)


def test_a_starting_window_that_serves_nothing_gives_ratio_one_only_when_adaptive_serves_nothing() -> None:
    report = summarize({"a 1s": cell(0.0, 0.0, 0.2), "b 1s": cell(0.1, 0.0, 0.2)})
    assert report["cells"]["a 1s"]["adaptive_over_starting_window"] == 1.0
    assert "adaptive_over_starting_window" not in report["cells"]["b 1s"]


def test_bursts_put_tens_of_arrivals_in_one_second() -> None:
    times = bursts(random.Random(0), 10.0, 3.0, 120.0, (20, 40))
    assert times == sorted(times) and all(0 <= t < 600 for t in times)
    assert 20 <= largest_burst(times_as_requests(times), 1.0) <= 80


def test_the_rate_doubles_after_the_ramp() -> None:
    times = [float(t) for t in range(0, 1000)]  # one arrival a second
    warped = doubling(times, at_s=100.0, ramp_s=60.0)
    assert warped[:101] == times[:101]
    late = [t for t in warped if t > 300.0]
    gaps = {round(b - a, 6) for a, b in itertools.pairwise(late)}
    assert gaps == {0.5}
    assert warped == sorted(warped)


def test_a_request_is_clipped_to_the_engines_context() -> None:
    assert fit_context(9000, 300) == (8192 - 300, 300)
    assert fit_context(100, 10_000) == (100, 4096)
    assert fit_context(0, 0) == (1, 1)


def times_as_requests(times: list[float]) -> list[TraceRequest]:
    return [TraceRequest(t, 1, 1) for t in times]
