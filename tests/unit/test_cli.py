import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from batchpilot_operator.api.crd import render_crd
from batchpilot_operator.cli import main as operator_cli
from batchpilot_runtime.cli import main as runtime_cli

ROOT = Path(__file__).resolve().parents[2]


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return sorted(action.choices)
    return []


@pytest.mark.parametrize(
    ("main", "parser"),
    [(operator_cli.main, operator_cli.build_parser()), (runtime_cli.main, runtime_cli.build_parser())],
    ids=["operator", "runtime"],
)
def test_every_subcommand_has_help(main, parser, capsys) -> None:  # type: ignore[no-untyped-def]
    commands = _subcommands(parser)
    assert commands
    for command in [None, *commands]:
        argv = ["--help"] if command is None else [command, "--help"]
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage:")
        if command is not None:
            assert command in out


def test_crd_command_prints_the_generated_crd(capsys) -> None:  # type: ignore[no-untyped-def]
    assert operator_cli.main(["crd"]) == 0
    assert capsys.readouterr().out == render_crd()


def test_validate_accepts_the_examples(capsys) -> None:  # type: ignore[no-untyped-def]
    assert operator_cli.main(["validate", str(ROOT / "deploy" / "examples")]) == 0
    out = capsys.readouterr().out
    assert "chat-assistant: ok" in out


def test_validate_names_the_bad_field(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: batchpilot.dev/v1alpha1\nkind: BatchProfile\nmetadata: {name: bad}\n"
        "spec:\n  model: m\n  selector: {matchLabels: {a: b}}\n"
        "  window: {targetBatchSize: 16, hardCap: 8, maxWaitMs: 0}\n  slo: {p99Ms: 100}\n"
    )
    assert operator_cli.main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and "targetBatchSize" in out and "hardCap" in out


def test_validate_reports_unreadable_yaml_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("spec: [unclosed\n")
    result = subprocess.run(
        [sys.executable, "-m", "batchpilot_operator.cli.main", "validate", str(bad)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode in (1, 2)
    assert "Traceback" not in result.stderr
    assert "broken.yaml" in result.stdout + result.stderr


def test_runtime_metrics_lists_the_contract(capsys) -> None:  # type: ignore[no-untyped-def]
    assert runtime_cli.main(["metrics"]) == 0
    out = capsys.readouterr().out
    assert "batchpilot_queue_wait_seconds" in out


def test_a_feature_without_its_extra_names_the_extra_to_install() -> None:
    from batchpilot_operator.cli.extras import MissingExtraError, require_extra

    with pytest.raises(MissingExtraError, match=r"pip install 'batchpilot\[report\]'") as caught:
        require_extra("batchpilot_no_such_module", "report", "simulate --plot")
    assert "simulate --plot" in str(caught.value)
    require_extra("json", "report", "anything")  # present: no error
