"""``batchpilot-operator simulate`` end to end on a small trace file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot_operator.cli.main import main


def write_trace(path: Path, n: int = 120) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        lines.append(f"2023-11-16 18:15:{i // 4:02d}.{(i % 4) * 25:02d}00000,{50 + (i * 37) % 300},{1 + (i * 11) % 30}")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_profile(path: Path) -> Path:
    path.write_text(
        """apiVersion: batchpilot.dev/v1alpha1
kind: BatchProfile
metadata: {name: chat}
spec:
  model: chat
  selector: {matchLabels: {app: chat}}
  batchFriendliness: high
  window: {targetBatchSize: 2, hardCap: 4, maxWaitMs: 10}
  slo: {latencyMetric: ttft, p99Ms: 300}
  tuning: {intervalSeconds: 5, cooldownSeconds: 5}
"""
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["adaptive", "static", "aimd", "large_fixed"])
def test_simulate_writes_json_and_plot(tmp_path: Path, policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    profile = write_profile(tmp_path / "profile.yaml")
    out_json = tmp_path / "out.json"
    out_png = tmp_path / "out.png"
    code = main(
        [
            "simulate",
            "--trace",
            str(trace),
            "--profile",
            str(profile),
            "--cost-profile",
            "a100-llama2-7b",
            "--policy",
            policy,
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert code == 0
    report = json.loads(out_json.read_text())
    assert report["requests"] == 120
    assert report["policy"] == policy
    assert report["rejected"] == 0
    assert report["goodput_tokens_per_s"] <= report["throughput_tokens_per_s"]
    assert out_png.stat().st_size > 1000
    assert "goodput" in capsys.readouterr().out


def test_simulate_refuses_bad_scaling_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    assert main(["simulate", "--trace", str(trace), "--time-scale", "0"]) == 2
    assert "--time-scale" in capsys.readouterr().err


def test_simulate_refuses_an_unknown_cost_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    assert main(["simulate", "--trace", str(trace), "--cost-profile", "no-such-gpu"]) == 2
    assert "no-such-gpu" in capsys.readouterr().err


def test_simulate_refuses_a_deep_profile_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The simulator reads its --profile through the same bounded reader as validate: no RecursionError.
    trace = write_trace(tmp_path / "trace.csv")
    profile = tmp_path / "deep.yaml"
    profile.write_text("a: " + "[" * 500 + "]" * 500 + "\n")
    assert main(["simulate", "--trace", str(trace), "--profile", str(profile)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"batchpilot-operator simulate: error: {profile}: refused: nested deeper than 100 levels")
