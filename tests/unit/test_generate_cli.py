"""`batchpilot-runtime generate`: offline batch generation from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot_runtime.cli.main import main


def test_generate_prints_completions_and_throughput(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    code = main(["generate", "third", "--prompts-file", str(prompts), "--max-tokens", "5", "--threads", "1", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["prompt"] for row in report["completions"]] == ["third", "first prompt", "second prompt"]
    assert all(row["tokens"] == 5 and row["finish_reason"] == "length" for row in report["completions"])
    assert report["summary"]["generated_tokens"] == 15
    assert report["summary"]["tokens_per_s"] > 0


def test_generate_text_output_is_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for _ in range(2):
        assert main(["generate", "hello", "--max-tokens", "4", "--threads", "1"]) == 0
        runs.append(capsys.readouterr().out.splitlines()[:2])
    assert runs[0] == runs[1]
    assert runs[0][0].startswith("--- 'hello' (4 tokens, length)")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate"], "no prompts"),
        (["generate", "x", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "x", "--target-batch-size", "8", "--hard-cap", "4"], "hardCap"),
    ],
)
def test_generate_refuses_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err
