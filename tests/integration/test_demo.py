"""The demo in its short mode, end to end: real runtimes, the operator in local mode, the report.

One run serves every check on its output (it takes a minute or more on a loaded machine).
The child-process handling the demo relies on is checked on its own, with tiny scripts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchpilot_operator.demo.answers import CHAT_CHECKPOINT, QUESTIONS
from batchpilot_operator.demo.children import Child, DemoError, wait_until

DEMO_TIMEOUT_S = 600


def run_demo(out_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BATCHPILOT_DEMO_DURATION"}
    return subprocess.run(
        [sys.executable, "-m", "batchpilot_operator.cli.main", "demo", "--out", str(out_dir), "--no-live", *extra],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out_dir = tmp_path_factory.mktemp("demo")
    result = run_demo(out_dir, "--duration", "40", "--preset", "tiny")
    assert result.returncode == 0, f"demo failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result, out_dir


@pytest.fixture(scope="module")
def report(demo: tuple[subprocess.CompletedProcess[str], Path]) -> dict[str, Any]:
    _, out_dir = demo
    data: dict[str, Any] = json.loads((out_dir / "report.json").read_text())
    return data


@pytest.mark.slow
def test_last_line_names_the_html_report_with_embedded_figures(
    demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, out_dir = demo
    last = result.stdout.rstrip("\n").splitlines()[-1]
    assert last == f"report: {out_dir / 'report.html'}"
    html = (out_dir / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == 5
    assert "<img" in html and 'src="http' not in html  # self-contained: nothing fetched


@pytest.mark.slow
def test_both_phases_ran_on_the_same_arrivals(report: dict[str, Any]) -> None:
    assert [p["mode"] for p in report["phases"]] == ["static", "adaptive"]
    arrivals = {m["name"]: m["requests"] for m in report["models"]}
    assert set(arrivals) == {"chat", "bulk"}
    for phase in report["phases"]:
        sent = {r["model"]: r["load"]["sent"] for r in phase["models"]}
        assert sent == arrivals
        for result in phase["models"]:
            assert result["series"]["t_s"], f"{phase['mode']} {result['model']}: no time series"
            assert result["p99_ms"] is not None


@pytest.mark.slow
def test_no_request_was_lost(report: dict[str, Any]) -> None:
    for phase in report["phases"]:
        for result in phase["models"]:
            load = result["load"]
            where = f"{phase['mode']} {result['model']}"
            assert load["accepted"] == load["completed"] + load["errors"], where
            assert load["sent"] == load["accepted"] + load["rejected"], where
            # The runtime counted the same completions the client saw.
            assert result["runtime_outcomes"].get("completed", 0) == load["completed"], where
    lost_rows = [r for r in report["comparison"] if r["figure"] == "Lost requests"]
    assert lost_rows and all(r["static"] == 0 and r["adaptive"] == 0 for r in lost_rows)


@pytest.mark.slow
def test_the_operator_decided_in_both_phases(report: dict[str, Any]) -> None:
    static, adaptive = report["phases"]
    assert static["decisions"], "the static-mode operator printed no decision"
    assert all(d["direction"] == "hold" for d in static["decisions"])
    assert {d["model"] for d in adaptive["decisions"]} == {"chat", "bulk"}
    for result in static["models"]:
        # The static operator pushes the spec's window (a new generation) but never other fields.
        start = {k: v for k, v in result["window_start"].items() if k != "generation"}
        end = {k: v for k, v in result["window_end"].items() if k != "generation"}
        assert start == end, "static mode changed a window"
        assert result["decisions"] == 0


@pytest.mark.slow
def test_the_report_has_both_tails_the_budget_and_the_surge(report: dict[str, Any]) -> None:
    """chat runs under two SLOs on engine defaults with a prompt-token budget, with a surge in its
    arrivals: the report has its inter-token series and the budget over time in both phases.
    Whether adaptive beats static depends on the machine, so only the record is checked here."""
    models = {m["name"]: m for m in report["models"]}
    chat = models["chat"]
    assert chat["slo_itl_p99_ms"] is not None and chat["window_label"] == "engine defaults"
    assert "budget" in chat["window"] and chat["surge"].startswith("surge x")
    start, end = chat["surge_s"]
    assert 0 < start < end < report["run"]["phase_replay_s"]
    assert models["bulk"]["surge_s"] is None
    static, adaptive = report["phases"]
    for phase in (static, adaptive):
        result = next(r for r in phase["models"] if r["model"] == "chat")
        series = result["series"]
        assert len(series["itl_p99_ms"]) == len(series["t_s"]) == len(series["max_prefill_tokens"])
        assert any(v is not None for v in series["itl_p99_ms"]), phase["mode"]
        assert result["itl_p99_ms"] is not None and result["itl_slo_met_share"] is not None
        assert all(b is not None and b >= 1 for b in series["max_prefill_tokens"]), phase["mode"]
    # The static phase holds the starting budget throughout.
    static_chat = next(r for r in static["models"] if r["model"] == "chat")
    assert set(static_chat["series"]["max_prefill_tokens"]) == {static_chat["window_start"]["max_prefill_tokens"]}
    assert any(row["figure"] == "Inter-token P99" and row["model"] == "chat" for row in report["comparison"])
    # A decision's budget is the one its window names.
    for decision in adaptive["decisions"]:
        if decision["model"] == "chat" and decision["window"]:
            assert (decision["budget"] is not None) == ("budget=" in decision["window"])


@pytest.mark.slow
def test_the_real_chat_model_answered_before_the_replay(
    demo: tuple[subprocess.CompletedProcess[str], Path], report: dict[str, Any]
) -> None:
    result, out_dir = demo
    answers = report["answers"]
    assert [a["question"] for a in answers] == list(QUESTIONS)
    assert all(a["model"] == CHAT_CHECKPOINT and a["completion_tokens"] > 0 for a in answers)
    assert "Paris" in answers[0]["answer"]
    lines = result.stdout.splitlines()
    first_answer = lines.index(f"  Q: {QUESTIONS[0]}")
    assert first_answer < min(i for i, line in enumerate(lines) if line.startswith("runtime chat:"))
    assert 'id="answers"' in (out_dir / "report.html").read_text()


@pytest.mark.slow
def test_children_are_gone(demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, out_dir = demo
    pids = [json.loads(p.read_text())["pid"] for p in (out_dir / "run").glob("*.ready.json")]
    assert len(pids) == 3  # the real chat model's runtime, then the two of the replay
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_a_runtime_that_cannot_start_is_named_with_its_log(tmp_path: Path) -> None:
    result = run_demo(tmp_path, "--duration", "20", "--preset", "no-such-preset")
    assert result.returncode == 1
    assert (
        "runtime chat (preset no-such-preset)" in result.stderr
        or "runtime bulk (preset no-such-preset)" in result.stderr
    )
    assert "no-such-preset" in result.stderr and "last lines of" in result.stderr
    assert "report:" not in result.stdout


async def test_a_child_that_exits_is_named_with_the_end_of_its_log(tmp_path: Path) -> None:
    script = "import sys; print('loading weights'); print('boom: no such preset', file=sys.stderr); sys.exit(3)"
    child = Child("runtime chat", [sys.executable, "-c", script], tmp_path / "chat.log")
    await child.start()

    async def never() -> bool:
        return False

    with pytest.raises(DemoError) as caught:
        await wait_until(child, never, timeout_s=60.0, what="become ready", poll_s=0.05)
    message = str(caught.value)
    assert message.startswith("runtime chat exited unexpectedly (exit code 3)")
    assert "loading weights" in message and "boom: no such preset" in message
    await child.stop()


async def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
    )
    lines: list[str] = []
    child = Child("stubborn", [sys.executable, "-c", script], tmp_path / "stubborn.log", on_line=lines.append)
    await child.start()

    async def up() -> bool:
        return lines == ["up"]

    await wait_until(child, up, timeout_s=60.0, what="start", poll_s=0.05)
    await child.stop(timeout_s=0.5)
    assert child.returncode == -9
    assert (tmp_path / "stubborn.log").read_text() == "up\n"
    child.check_alive()  # an exit after stop() is expected: no error
