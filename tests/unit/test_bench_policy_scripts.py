"""The policy benchmarks run end to end on a short slice and write figures that respect the bounds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.bench import bench_policy, bench_policy_loads, bench_slo

pytestmark = pytest.mark.slow


def seconds(value: float | str) -> float:
    """A latency from the JSON, where an infinite one (a request that never finished) is "inf"."""
    return float(value)


def test_bench_policy_writes_every_field_and_checks_its_targets_against_the_bounds(tmp_path: Path) -> None:
    out = tmp_path / "policy.json"
    argv = ["--quick", "--duration", "300", "--screen-minutes", "2", "--finalists", "1", "--workers", "1"]
    assert bench_policy.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"adaptive", "best_static", "aimd", "large_fixed"}
    assert set(report["references"]) == {"start_static", "work_conserving", "work_conserving_unlimited_kv"}
    for figures in (*report["policies"].values(), *report["references"].values()):
        assert set(bench_policy.JSON_FIELDS) <= set(figures)
        # No policy serves more than was offered, nor beats each request's latency alone.
        assert figures["goodput_tokens_per_s"] <= report["bounds"]["offered_tokens_per_s"] + 1e-9
        assert seconds(figures["p99_s"]) >= report["bounds"]["p99_floor_s"] - 1e-9
    bounds = report["bounds"]
    best = report["policies"]["best_static"]["goodput_tokens_per_s"]
    assert bounds["goodput_ceiling_over_best_static"] == pytest.approx(bounds["offered_tokens_per_s"] / best)
    # A target beyond the ceiling cannot be reported as met.
    if not bounds["goodput_1.3x_reachable"]:
        assert report["targets_met"]["goodput_ge_1.3x_best_static"] is False
    if not bounds["p99_0.3x_large_fixed_reachable"]:
        assert report["targets_met"]["adaptive_p99_le_0.3x_large_fixed"] is False


def test_bench_policy_loads_sweeps_every_load_and_policy(tmp_path: Path) -> None:
    out = tmp_path / "loads.json"
    argv = ["--loads", "0.3", "0.64", "--duration", "300", "--workers", "1", "--json", str(out)]
    assert bench_policy_loads.main(argv) == 0
    report = json.loads(out.read_text())
    assert [row["load"] for row in report["loads"]] == [0.3, 0.64]
    light, heavy = report["loads"]
    assert heavy["offered_tokens_per_s"] > light["offered_tokens_per_s"]
    for row in report["loads"]:
        assert set(row["policies"]) == set(bench_policy_loads.POLICIES)
        for figures in row["policies"].values():
            assert figures["goodput_tokens_per_s"] <= row["offered_tokens_per_s"] + 1e-9
            assert seconds(figures["p99_s"]) >= row["p99_floor_s"] - 1e-9
            assert math.isfinite(figures["p50_s"])


def test_bench_policy_loads_refuses_a_nonpositive_load() -> None:
    with pytest.raises(SystemExit):
        bench_policy_loads.main(["--loads", "0"])


def test_bench_slo_refuses_a_negative_count_of_loads_above_the_edge(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_slo.main(["--above-edge", "-1"])
    assert "--above-edge must be >= 0, got -1" in capsys.readouterr().err


def test_bench_slo_writes_the_issue_fields_and_the_hindsight_search_beats_the_grid_windows(tmp_path: Path) -> None:
    out = tmp_path / "slo.json"
    argv = ["--quick", "--minutes", "3", "--no-servegen", "--slo-ttft-ms", "1000", "--slo-itl-ms", "100"]
    assert bench_slo.main([*argv, "--workers", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["slo"] == {"ttft_p99_s": 1.0, "itl_p99_s": 0.1}
    policies = {"adaptive", "best_static", "engine_defaults", "starting_window", "per_step_itl"}
    assert set(report["capacity"]) == policies
    assert report["engine_defaults_window"] == {"targetBatchSize": 1, "hardCap": 256, "maxWaitMs": 0,
                                                "tailMarkRatio": 2.0, "maxPrefillTokens": 2048, "generation": 0}  # fmt: skip
    for policy in policies:
        figures = report["at_capacity"][policy]
        assert {"ttft_p99_s", "itl_p99_s", "goodput_requests_per_s", "slo_attainment"} <= set(figures)
        if report["capacity"][policy] > 0:
            assert figures["unfinished"] == 0
    # The engine defaults are one of the quick grid's windows: the search in hindsight is at least as good.
    assert report["capacity"]["best_static"] >= report["capacity"]["engine_defaults"]
    assert report["step_cost_change"]["intervals_to_recover"] >= 0
    assert report["steady_load"]["decisions_per_hour"] >= 0

    # The same cell with only the policies that observe: adaptive's figures are the full run's, and the
    # two loads above its edge (the quick grid's 0.02 apart) ran as well.
    alone = tmp_path / "adaptive.json"
    argv_alone = [*argv, "--adaptive-only", "--above-edge", "2", "--workers", "1", "--json", str(alone)]
    assert bench_slo.main(argv_alone) == 0
    again = json.loads(alone.read_text())
    assert set(again["capacity"]) == {"adaptive"}
    assert again["capacity"]["adaptive"] == report["capacity"]["adaptive"]
    assert again["at_capacity"]["adaptive"] == report["at_capacity"]["adaptive"]
    edge = again["capacity"]["adaptive"]
    above = again["cells"]["azure 1000ms/100ms"]["policies"]["adaptive"]["above_edge"]
    assert [a["multiplier"] for a in above] == [pytest.approx(edge + 0.02), pytest.approx(edge + 0.04)]
    assert all(isinstance(a["meets"], bool) for a in above)
    assert report["cells"]["azure 1000ms/100ms"]["policies"]["adaptive"]["above_edge"] == []
    assert again["step_cost_change"] == report["step_cost_change"]
    assert again["targets"]["per_cell"] == {}  # nothing to compare with: no target is reported missed


@pytest.mark.parametrize(
    ("ran", "sources"),
    [
        (["azure"], {"azure": None}),
        (["azure", "servegen_drift"], {"azure": "servegen_drift", "servegen_drift": "azure"}),
        (
            ["azure", "servegen_drift", "servegen_steady"],
            {"azure": "servegen_drift", "servegen_drift": "servegen_steady", "servegen_steady": "servegen_drift"},
        ),
    ],
)
def test_tuned_elsewhere_comes_from_another_day_of_the_model_when_one_ran(
    ran: list[str], sources: dict[str, str | None]
) -> None:
    assert bench_slo.elsewhere_sources(ran) == sources
