"""``tests/bench/bench_live.py --tiny``, run as the docs run it: a two-probe search per policy against live
runtimes (the tiny preset), the simulator beside every probe, and the report other tools read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_tiny_search_writes_each_policys_capacity_as_its_probes_found_it(tmp_path: Path) -> None:
    out = tmp_path / "live.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests/bench/bench_live.py"), "--tiny", "--traces", "azure", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    (cell,) = report["cells"]
    assert (cell["engine"], cell["trace"]) == ("batchpilot", "azure")
    assert cell["slo"]["ttft_p99_ms"] > 0 and cell["slo"]["itl_p99_ms"] > 0 and "served alone" in cell["slo_reason"]
    assert (
        set(cell["live"]) == set(cell["simulated"]) - {"best_static_window"} == {"defaults", "best_static", "adaptive"}
    )
    for policy in ("defaults", "adaptive"):
        probes = [p for p in cell["probes"] if p["policy"] == policy]
        # The grid holds two loads: the heavier first, the lighter only when the heavier missed.
        assert [p["multiplier"] for p in probes] in ([0.2], [0.2, 0.1]), probes
        met = [p["multiplier"] for p in probes if p["meets"]]
        assert cell["live"][policy] == max(met, default=0.0)
        for probe in probes:
            assert probe["requests"] > 0 and probe["simulated"]["ttft_p99_s"] is not None
            assert probe["error"]["compared"] is not probe["stopped_early"]
            assert probe["meets"] is (probe["completed"] == probe["requests"] and not probe["stopped_early"]
                                      and probe["ttft_p99_s"] <= cell["slo"]["ttft_p99_ms"] / 1000
                                      and probe["itl_p99_s"] <= cell["slo"]["itl_p99_ms"] / 1000)  # fmt: skip
    adaptive = [p for p in cell["probes"] if p["policy"] == "adaptive"]
    assert all("decisions" in p["extra"]["operator"] for p in adaptive), adaptive
    assert cell["sim_error"]["probes"] == len(cell["probes"])
    assert out.with_name("live-batchpilot-azure.png").stat().st_size > 0
