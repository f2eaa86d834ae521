"""``run_command``, the error reporting both command lines share: a mistake the user can fix is one
line on stderr and exit status 2, Ctrl-C is 130, and a bug keeps its traceback."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from batchpilot_operator.cli import main as operator_cli
from batchpilot_runtime.cli import main as runtime_cli
from batchpilot_runtime.cli.command import INTERRUPTED, USAGE_ERROR, run_command


def parser_raising(error: BaseException | None) -> argparse.ArgumentParser:
    """A ``tool`` whose one subcommand ``go`` raises ``error`` (or exits 7 when there is none)."""

    def go(args: argparse.Namespace) -> int:
        if error is not None:
            raise error
        return 7

    parser = argparse.ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("go").set_defaults(handler=go)
    return parser


def test_the_handlers_exit_status_is_the_commands() -> None:
    assert run_command(parser_raising(None), ["go"]) == 7


@pytest.mark.parametrize(
    "error", [FileNotFoundError(2, "No such file or directory", "p.yaml"), ValueError("hardCap (4) < target (8)")]
)
def test_a_user_error_is_one_line_naming_the_command(error: Exception, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(parser_raising(error), ["go"]) == USAGE_ERROR == 2
    assert capsys.readouterr().err == f"tool go: error: {error}\n"


def test_extra_user_errors_are_reported_the_same_way(capsys: pytest.CaptureFixture[str]) -> None:
    error = yaml.YAMLError("mapping values are not allowed here")
    assert run_command(parser_raising(error), ["go"], user_errors=(yaml.YAMLError,)) == 2
    assert capsys.readouterr().err == "tool go: error: mapping values are not allowed here\n"
    with pytest.raises(yaml.YAMLError):
        run_command(parser_raising(error), ["go"])


def test_ctrl_c_is_130_and_silent(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(parser_raising(KeyboardInterrupt()), ["go"]) == INTERRUPTED == 130
    assert capsys.readouterr().err == ""


def test_a_bug_keeps_its_traceback() -> None:
    with pytest.raises(KeyError, match="window"):
        run_command(parser_raising(KeyError("window")), ["go"])


def test_both_command_lines_report_through_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-folder" / "crd.yaml"
    assert operator_cli.main(["crd", "-o", str(missing)]) == 2
    assert capsys.readouterr().err.startswith(
        f"batchpilot-operator crd: error: [Errno 2] No such file or directory: '{missing}'"
    )
    assert runtime_cli.main(["generate"]) == 2
    assert capsys.readouterr().err.startswith("batchpilot-runtime generate: error: ")
