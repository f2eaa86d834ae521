"""``serve --step-log``: the observer that writes each step, the reader, and ``calibrate --from-step-log``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from batchpilot_runtime.cli.main import main
from batchpilot_runtime.replay.cost_model import CostModel, StepComposition, load_cost_model
from batchpilot_runtime.scheduling.types import StepStats
from batchpilot_runtime.server.step_log import StepLogError, StepLogObserver, read_step_log


class Recorder:
    """An EngineObserver that keeps every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_step(self, stats: StepStats, step_seconds: float, forward_seconds: float) -> None:
        self.calls.append(("step", step_seconds))

    def on_admitted(self, lane: str, queue_wait_s: float) -> None:
        self.calls.append(("admitted", lane))

    def on_first_token(self, lane: str, ttft_s: float) -> None:
        self.calls.append(("first_token", lane))

    def on_request_finished(self, timings: Any, outcome: str) -> None:
        self.calls.append(("finished", outcome))

    def on_tokens(self, lane: str, inter_token_gaps_s: Sequence[float]) -> None:
        self.calls.append(("tokens", len(inter_token_gaps_s)))

    def on_window(self, state: Any) -> None:
        self.calls.append(("window", state))


def stats(batch: int, prefill_seqs: int, prefill_tokens: int, kv_tokens: int) -> StepStats:
    return StepStats(batch_size=batch, num_prefill_seqs=prefill_seqs, num_decode_seqs=batch - prefill_seqs,
                     num_prefill_tokens=prefill_tokens, admissions={}, admitted_requests=0, tail_marked=0,
                     preempted=0, queue_depth=0, running=batch, kv_usage_ratio=0.1, window_generation=0,
                     kv_tokens=kv_tokens)  # fmt: skip


def test_every_step_that_ran_is_one_line_and_every_event_reaches_the_metrics(tmp_path: Path) -> None:
    inner = Recorder()
    log = StepLogObserver(inner, tmp_path / "steps.jsonl")
    log.on_step(stats(3, 1, 64, 400), 0.12, 0.1)
    log.on_step(stats(0, 0, 0, 0), 0.001, 0.0)  # nothing ran: the metrics see it, the log does not
    log.on_admitted("default", 0.5)
    log.on_first_token("default", 0.7)
    log.on_tokens("default", [0.1, 0.2])
    log.on_request_finished(None, "completed")
    log.on_window("state")
    log.close()
    log.on_step(stats(1, 0, 0, 10), 0.05, 0.04)  # after the runtime stopped: nothing written, nothing raised
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(lines) == 1
    assert {k: lines[0][k] for k in ("seconds", "prefill_tokens", "decode_seqs", "kv_tokens", "batch_size")} == {
        "seconds": 0.12, "prefill_tokens": 64, "decode_seqs": 2, "kv_tokens": 400, "batch_size": 3}  # fmt: skip
    assert [name for name, _ in inner.calls] == ["step", "step", "admitted", "first_token", "tokens", "finished",
                                                "window", "step"]  # fmt: skip
    assert read_step_log(tmp_path / "steps.jsonl") == [(StepComposition(64, 2, 400), 0.12)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"seconds": 0.1, "prefill_tokens": 1, "decode_seqs": 0}', "missing field 'kv_tokens'"),
        ('{"seconds": 0, "prefill_tokens": 1, "decode_seqs": 0, "kv_tokens": 1}', "seconds must be a number > 0"),
        ('{"seconds": 0.1, "prefill_tokens": -1, "decode_seqs": 0, "kv_tokens": 1}', "prefill_tokens must be"),
        ('{"seconds": 0.1, "prefill_tokens": 1.5, "decode_seqs": 0, "kv_tokens": 1}', "prefill_tokens must be"),
        ("not json", "Expecting value"),
    ],
)
def test_a_bad_line_is_named_by_file_and_number(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "steps.jsonl"
    good = '{"seconds": 0.1, "prefill_tokens": 1, "decode_seqs": 0, "kv_tokens": 1}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(StepLogError, match=f"steps.jsonl:3: .*{message}"):
        read_step_log(path)
    path.write_text("\n")
    with pytest.raises(StepLogError, match="no steps"):
        read_step_log(path)


def test_calibrate_from_a_step_log_recovers_the_costs_that_made_it(tmp_path: Path) -> None:
    truth = CostModel("truth", fixed_s=0.06, per_prefill_token_s=0.0018, per_decode_seq_s=0.0006,
                      per_kv_token_s=2.2e-5)  # fmt: skip
    log = tmp_path / "steps.jsonl"
    with log.open("w") as out:
        for prefill in (0, 16, 64):
            for decodes in (0, 1, 4, 12):
                for context in (16, 300, 900):
                    if prefill == decodes == 0:
                        continue
                    composition = StepComposition(prefill, decodes, decodes * context + prefill)
                    out.write(json.dumps({"seconds": truth.step_seconds(composition), "prefill_tokens": prefill,
                                          "decode_seqs": decodes, "kv_tokens": composition.kv_tokens}) + "\n")  # fmt: skip
    assert main(["calibrate", "--from-step-log", str(log), "-o", str(tmp_path / "fit.json")]) == 0
    fitted = load_cost_model(tmp_path / "fit.json")
    for field in ("fixed_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s"):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6)
    assert fitted.name == "steps" and "33 steps of steps.jsonl" in fitted.source


def test_calibrate_names_an_unreadable_step_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.jsonl").write_text('{"seconds": -1}\n')
    assert main(["calibrate", "--from-step-log", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
