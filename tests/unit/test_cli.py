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


def test_validate_prints_the_window_derived_for_a_profile_without_one(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    derived = tmp_path / "derived.yaml"
    derived.write_text(
        "apiVersion: batchpilot.dev/v1alpha1\nkind: BatchProfile\nmetadata: {name: d}\n"
        "spec:\n  model: m\n  selector: {matchLabels: {a: b}}\n"
        "  stepCosts: {fixedMs: 11.3, prefillUsPerToken: 61, source: calibrate on a100}\n"
        "  slo: {p99Ms: 1000, interTokenP99Ms: 100}\n"
    )
    assert operator_cli.main(["validate", str(derived)]) == 0
    out = capsys.readouterr().out
    assert "d: ok" in out
    assert "starting window target 1, cap 128, wait 0 ms, tail-mark ratio 2, budget 798, derived from" in out
    assert "spec.stepCosts (fixed 11.3 ms, 61 us per prompt token, calibrate on a100) and the SLO" in out


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


THREE_ERRORS = """\
apiVersion: batchpilot.dev/v1alpha1
kind: BatchProfile
metadata: {name: three}
spec:
  model: m
  selector: {matchLabels: {a: b}}
  window: {targetBatchSize: 8, hardCap: 16, maxWaitMs: 900}
  slo: {p99Ms: -1}
  lanes:
    - {name: c, window: {targetBatchSize: 1, hardCap: 2, maxWaitMs: 0}}
    - {name: c, window: {targetBatchSize: 1, hardCap: 2, maxWaitMs: 0}}
"""


def test_validate_prints_every_error_of_a_file_in_one_run(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    # One field error and two cross-field errors: each used to need its own pass.
    bad = tmp_path / "three.yaml"
    bad.write_text(THREE_ERRORS)
    assert operator_cli.main(["validate", str(bad)]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "INVALID" in line]
    assert len(lines) == 3, lines
    assert "spec.slo.p99Ms: Input should be greater than 0" in lines[0]
    assert "window.maxWaitMs must lie within tuning.bounds (maxWaitMs bounds are 0..500)" in lines[1]
    assert "lanes[1].name 'c' repeats lanes[0].name; lane names must be unique" in lines[2]


def test_validate_fails_on_a_folder_without_profiles(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "deployment.yaml").write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n")
    assert operator_cli.main(["validate", str(tmp_path / "empty"), str(tmp_path / "other")]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'empty'}: no BatchProfile found" in out
    assert f"{tmp_path / 'other'}: no BatchProfile found" in out


def test_validate_accepts_partial_bounds_and_warns_of_unused_settings(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    profile = tmp_path / "partial.yaml"
    profile.write_text(
        "apiVersion: batchpilot.dev/v1alpha1\nkind: BatchProfile\nmetadata: {name: partial}\n"
        "spec:\n  model: m\n  selector: {matchLabels: {a: b}}\n"
        "  window: {targetBatchSize: 8, hardCap: 16, maxWaitMs: 200}\n  slo: {p99Ms: 800}\n"
        "  tuning: {bounds: {maxWaitMs: {max: 1000}}}\n"
    )
    assert operator_cli.main(["validate", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "default/partial: ok" in out
    assert "warning: window.maxWaitMs (200) is above what the policy ever chooses (0.1 x slo.p99Ms = 80 ms)" in out
    assert "warning: tuning.bounds.maxWaitMs.max (1000)" in out


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


# validate run in a child that reports how much its peak resident size (KiB on Linux) grew during main(),
# once everything validate imports is loaded.
VALIDATE_AND_MEASURE = """
import resource, sys
import batchpilot_operator.api.manifests, batchpilot_operator.tuning.unused
from batchpilot_operator.cli.main import main
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
status = main(["validate", *sys.argv[1:]])
print("maxrss_growth_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
sys.exit(status)
"""


def _laughs(levels: int) -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def _write_hostile(path: Path, kind: str) -> None:
    if kind == "deep":
        path.write_text("a: " + "[" * 500 + "]" * 500 + "\n")  # issue #32's file
    elif kind == "laughs":
        path.write_text("apiVersion: batchpilot.dev/v1alpha1\nkind: BatchProfile\n" + _laughs(9))
    elif kind == "cycle":
        path.write_text("kind: BatchProfile\nspec: &s {lanes: [*s]}\n")
    else:
        with path.open("wb") as stream:
            stream.truncate(100 * 1024 * 1024)  # sparse: 100 MB to stat, nothing on disk


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("deep", "refused: nested deeper than 100 levels (aliases expanded)"),
        ("laughs", "refused: more than 100000 nodes (aliases expanded)"),
        ("cycle", "refused: alias *s is inside the node it names (a cycle)"),
        ("huge", "too large: 104857600 bytes, over the limit of 3145728 bytes"),
    ],
)
def test_validate_refuses_hostile_yaml_naming_the_file_in_bounded_memory(
    tmp_path: Path, kind: str, problem: str
) -> None:
    hostile = tmp_path / f"{kind}.yaml"
    _write_hostile(hostile, kind)
    result = subprocess.run(
        [sys.executable, "-c", VALIDATE_AND_MEASURE, str(hostile)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (1, "")
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{hostile}: ?: INVALID: {problem}")
    assert lines[-1].startswith("maxrss_growth_kib ")
    assert int(lines[-1].split()[1]) * 1024 < 16 * 1024 * 1024


def test_validate_reports_metadata_and_spec_problems_together(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.yaml"
    metadata = "metadata: {name: Bad_Name!, namespace: Not A Namespace, labels: [app]}"
    bad.write_text(THREE_ERRORS.replace("metadata: {name: three}", metadata))
    assert operator_cli.main(["validate", str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": INVALID: ")[1].split(":")[0] for line in lines] == [
        "metadata.name",
        "metadata.namespace",
        "metadata.labels",
        "spec.slo.p99Ms",
        "spec",
        "spec",
    ]
    assert all(line.startswith(f"{bad}: ?: INVALID: ") for line in lines)
    assert lines[0].endswith(': Invalid value: "Bad_Name!": a lowercase RFC 1123 subdomain must consist of lower '
                             "case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric "
                             "character (e.g. 'example.com', regex used for validation is "
                             r"'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")  # fmt: skip
    assert lines[2].endswith("metadata.labels: must be a map of string keys to string values, got a list")


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
