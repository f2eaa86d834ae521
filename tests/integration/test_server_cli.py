"""``batchpilot-runtime serve`` flags: environment variables, lanes, and errors that name the flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from batchpilot_runtime.cli.args import env_name
from batchpilot_runtime.cli.main import build_parser, main
from batchpilot_runtime.cli.serve import config_from_args
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.server.config import parse_lane
from batchpilot_runtime.server.listen import load_admin_token


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_defaults_give_a_valid_config() -> None:
    config = config_from_args(parse())
    assert config.model_name == "batchpilot-tiny"
    assert (config.window.target_batch_size, config.window.hard_cap, config.window.generation) == (8, 16, 0)
    assert config.kv_cache_tokens is None
    assert config.lanes == ()
    assert config.engine_stall_timeout_s == 120.0


def test_every_flag_has_an_environment_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token = tmp_path / "token"
    env = {
        "MODEL_NAME": "chat",
        "PRESET": "small",
        "HOST": "0.0.0.0",
        "PORT": "9000",
        "ADMIN_PORT": "9001",
        "ADMIN_TOKEN_FILE": str(token),
        "KV_CACHE_TOKENS": "4096",
        "TARGET_BATCH_SIZE": "3",
        "HARD_CAP": "5",
        "MAX_WAIT_MS": "7",
        "TAIL_MARK_RATIO": "3.5",
        "BATCHING": "static",
        "MAX_QUEUE": "11",
        "SEED": "42",
        "MAX_PREFILL_TOKENS": "256",
        "MAX_MODEL_LEN": "1024",
        "LANE": "critical:target=1,cap=2,wait=0,reserved=1",
        "DRAIN_TIMEOUT_S": "9",
        "ENGINE_STALL_TIMEOUT_S": "45",
        "LOG_LEVEL": "debug",
        "DEVICE": "cpu",
        "THREADS": "1",
        "BATCH_INVARIANT": "1",
        "STEP_LOG": str(tmp_path / "steps.jsonl"),
    }
    for key, value in env.items():
        monkeypatch.setenv(f"BATCHPILOT_{key}", value)
    config = config_from_args(parse())
    assert config.model_name == "chat"
    assert config.preset == "small"
    assert (config.host, config.port, config.admin_port) == ("0.0.0.0", 9000, 9001)
    assert config.admin_token_file == token
    assert config.kv_cache_tokens == 4096
    assert config.window == Window(target_batch_size=3, hard_cap=5, max_wait_ms=7, tail_mark_ratio=3.5)
    assert config.batching == "static"
    assert (config.max_queue, config.seed, config.max_prefill_tokens, config.max_model_len) == (11, 42, 256, 1024)
    assert [lane.name for lane in config.lanes] == ["critical"]
    assert config.drain_timeout_s == 9.0
    assert config.engine_stall_timeout_s == 45.0
    assert config.device == "cpu"
    assert config.threads == 1
    assert config.batch_invariant is True
    assert config.step_log == tmp_path / "steps.jsonl"
    # A flag on the command line wins over its variable.
    assert config_from_args(parse("--hard-cap", "6")).window.hard_cap == 6


def test_env_name() -> None:
    assert env_name("--hard-cap") == "BATCHPILOT_HARD_CAP"


def test_lanes_take_defaults_from_the_main_window() -> None:
    window = Window(target_batch_size=8, hard_cap=16, max_wait_ms=20, tail_mark_ratio=2.5)
    lane = parse_lane("critical:target=2,cap=4,wait=5,reserved=2", window)
    assert lane.window == Window(target_batch_size=2, hard_cap=4, max_wait_ms=5, tail_mark_ratio=2.5)
    assert lane.reserved_slots == 2
    assert parse_lane("bulk:cap=32", window).window.target_batch_size == 8
    assert parse_lane("small:cap=2", window).window.target_batch_size == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target-batch-size", "32", "--hard-cap", "16"], "hardCap"),
        (["--lane", "critical:target=9,cap=4"], "--lane critical"),
        (["--lane", "critical:colour=red"], "unknown field 'colour'"),
        (["--lane", "critical:cap=x"], "cap='x' is not a number"),
        (["--lane", "nocolon"], "expected NAME:"),
        (["--lane", "default:cap=2"], "'default' is the main window"),
        (["--lane", "a:cap=2", "--lane", "a:cap=3"], "given twice: a"),
        (["--drain-timeout-s", "0"], "--drain-timeout-s"),
        (["--engine-stall-timeout-s", "0"], "--engine-stall-timeout-s must be a finite number > 0, got 0.0"),
        (["--engine-stall-timeout-s", "-5"], "--engine-stall-timeout-s"),
        (["--engine-stall-timeout-s", "inf"], "--engine-stall-timeout-s must be a finite number > 0, got inf"),
        (["--engine-stall-timeout-s", "nan"], "--engine-stall-timeout-s"),
        (["--step-log", "/nonexistent-dir/steps.jsonl"], "--step-log: no directory '/nonexistent-dir'"),
    ],
)
def test_bad_settings_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args(parse(*argv))


def test_cli_reports_bad_settings_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--target-batch-size", "32", "--hard-cap", "16"]) == 2
    assert "hardCap" in capsys.readouterr().err


def test_threads_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--threads", "0")
    assert "--threads" in capsys.readouterr().err


def test_bad_number_in_an_environment_variable_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHPILOT_HARD_CAP", "many")
    with pytest.raises(SystemExit):
        parse()


def test_admin_token_from_a_file_or_generated_privately(tmp_path: Path) -> None:
    given = tmp_path / "token"
    given.write_text("s3cret\n")
    assert load_admin_token(given) == ("s3cret", given)
    token, path = load_admin_token(None)
    assert len(token) >= 32
    assert path.read_text().strip() == token
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_admin_token(empty)
