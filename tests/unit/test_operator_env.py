"""`run` and `local` take every flag from BATCHPILOT_<FLAG> as well; a flag on the command line wins."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from batchpilot_operator.cli import main as operator_cli
from batchpilot_operator.cli.env import env_name


def parse(*argv: str) -> argparse.Namespace:
    return operator_cli.build_parser().parse_args(list(argv))


def subparser(name: str) -> argparse.ArgumentParser:
    parser = operator_cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen: argparse.ArgumentParser = sub.choices[name]
    return chosen


@pytest.mark.parametrize("command", ["run", "local"])
def test_help_names_the_variable_of_every_flag(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags = [a for a in subparser(command)._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert len(flags) > 5
    with pytest.raises(SystemExit):
        operator_cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for action in flags:
        assert f"[env {env_name(action)}]" in text, action.option_strings
    assert "a flag on the command line wins" in text


def test_every_kind_of_flag_comes_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHPILOT_PROMETHEUS_URL", "http://prometheus.monitoring.svc:9090")
    monkeypatch.setenv("BATCHPILOT_QUERY_TIMEOUT", "7.5")
    monkeypatch.setenv("BATCHPILOT_METRICS_PORT", "9191")
    monkeypatch.setenv("BATCHPILOT_ADMIN_TOKEN_FILE", "/var/run/token")
    monkeypatch.setenv("BATCHPILOT_NAMESPACE", "team-a; team-b;")
    monkeypatch.setenv("BATCHPILOT_POD_LABEL", "app=llm;tier=gpu")
    monkeypatch.setenv("BATCHPILOT_PEERING", "required")
    monkeypatch.setenv("BATCHPILOT_VERBOSE", "true")
    args = parse("run")
    assert args.prometheus_url == "http://prometheus.monitoring.svc:9090"
    assert args.query_timeout == 7.5
    assert args.metrics_port == 9191
    assert args.admin_token_file == Path("/var/run/token")
    assert args.namespace == ["team-a", "team-b"]
    assert args.pod_label == ["app=llm", "tier=gpu"]
    assert args.peering == "required"
    assert args.verbose is True
    # Flags not set either way keep their own defaults.
    assert (args.scrape_interval, args.tick, args.all_namespaces) == (15.0, 1.0, False)


def test_a_flag_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHPILOT_PROMETHEUS_URL", "http://from-env:9090")
    monkeypatch.setenv("BATCHPILOT_NAMESPACE", "from-env")
    monkeypatch.setenv("BATCHPILOT_VERBOSE", "false")
    args = parse("run", "--prometheus-url", "http://from-flag:9090", "-n", "x", "-n", "y", "--verbose")
    assert (args.prometheus_url, args.namespace, args.verbose) == ("http://from-flag:9090", ["x", "y"], True)


def test_a_flag_wins_over_the_variable_of_its_exclusive_partner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHPILOT_NAMESPACE", "team-a")
    args = parse("run", "-A")
    assert (args.all_namespaces, args.namespace) == (True, [])
    monkeypatch.delenv("BATCHPILOT_NAMESPACE")
    monkeypatch.setenv("BATCHPILOT_ALL_NAMESPACES", "1")
    args = parse("run", "-n", "team-b")
    assert (args.all_namespaces, args.namespace) == (False, ["team-b"])


def test_two_exclusive_variables_are_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHPILOT_NAMESPACE", "team-a")
    monkeypatch.setenv("BATCHPILOT_ALL_NAMESPACES", "yes")
    with pytest.raises(SystemExit) as exit_info:
        parse("run")
    assert exit_info.value.code == 2
    assert "BATCHPILOT_NAMESPACE and BATCHPILOT_ALL_NAMESPACES exclude each other" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("BATCHPILOT_QUERY_TIMEOUT", "soon", "BATCHPILOT_QUERY_TIMEOUT='soon': not a valid value for --query-timeout"),
        ("BATCHPILOT_PEERING", "sometimes", "BATCHPILOT_PEERING='sometimes': must be one of auto, off, required"),
        ("BATCHPILOT_VERBOSE", "loud", "BATCHPILOT_VERBOSE='loud': expected true or false"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_info:
        parse("run")
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_required_flag_may_come_from_its_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse("local")  # --profiles is required
    monkeypatch.setenv("BATCHPILOT_PROFILES", str(tmp_path))
    monkeypatch.setenv(
        "BATCHPILOT_RUNTIME",
        "model=a,url=http://a:8080,admin=http://a:8081;model=b,url=http://b:8080,admin=http://b:8081",
    )
    monkeypatch.setenv("BATCHPILOT_OUTPUT", "json")
    args = parse("local")
    assert args.profiles == tmp_path
    assert args.runtime == [
        "model=a,url=http://a:8080,admin=http://a:8081",
        "model=b,url=http://b:8080,admin=http://b:8081",
    ]
    assert args.output == "json"


def test_one_shot_commands_read_no_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A BATCHPILOT_OUTPUT meant for `local` must not make `crd` write a file named "json".
    monkeypatch.setenv("BATCHPILOT_OUTPUT", "json")
    assert parse("crd").output is None
    assert operator_cli.main(["crd"]) == 0
    assert capsys.readouterr().out.startswith("# Generated by")
