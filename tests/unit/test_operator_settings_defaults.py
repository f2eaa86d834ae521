"""The operator's defaults are written once: ``run``'s flags default to :class:`RunOptions`, whose control-loop
fields (and ``local``'s scrape interval) default to the loop's :class:`Settings`."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from batchpilot_operator.cli.main import build_parser
from batchpilot_operator.control.settings import DEFAULT_SETTINGS, Settings
from batchpilot_operator.frontends.run_options import RunOptions

# RunOptions fields the loop's Settings hold too (the rest are kopf's, or the operator's own token).
LOOP_FIELDS = ("tick_s", "interval_override_s", "scrape_interval_s", "stuck_after_s", "resync_s")


@pytest.fixture
def parser(monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The command line as it parses with no BATCHPILOT_* variable set (they replace the defaults)."""
    for name in [n for n in os.environ if n.startswith("BATCHPILOT_")]:
        monkeypatch.delenv(name)
    return build_parser()


def run_option_of(flag_dest: str) -> str | None:
    """The RunOptions field a ``run`` flag sets: the same name, or with ``_s`` for seconds."""
    names = {f.name for f in dataclasses.fields(RunOptions)}
    return next((name for name in (flag_dest, f"{flag_dest}_s") if name in names), None)


def test_every_run_flag_defaults_to_its_run_option(parser: argparse.ArgumentParser) -> None:
    args = vars(parser.parse_args(["run"]))
    defaults = RunOptions()
    compared = {dest: field for dest in args if (field := run_option_of(dest)) is not None}
    assert {dest: args[dest] for dest in compared} == {dest: getattr(defaults, f) for dest, f in compared.items()}
    # Every flag with a default of its own (not a list, not a switch) is among them.
    assert set(compared) >= {
        "scrape_interval", "query_timeout", "metrics_port", "liveness", "peering", "peering_name",
        "peering_lifetime", "tick", "interval_override", "watch_check", "push_timeout", "resync",
    }  # fmt: skip


def test_the_run_options_the_loop_shares_default_to_its_settings() -> None:
    assert {name: getattr(RunOptions(), name) for name in LOOP_FIELDS} == {
        name: getattr(Settings(), name) for name in LOOP_FIELDS
    }


def test_local_scrapes_at_the_loops_default_interval(parser: argparse.ArgumentParser) -> None:
    args = parser.parse_args(["local", "--profiles", "profiles.yaml"])
    assert args.scrape_interval == DEFAULT_SETTINGS.scrape_interval_s
