"""Local mode's ``--status-file`` read back at start: what a restart adopts, and what it refuses."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_operator.api.manifests import load_profiles
from batchpilot_operator.cli.main import main
from batchpilot_operator.control.controller import Controller, ProfileRef, Settings
from batchpilot_operator.frontends.local import LocalSink, add_profiles, read_status_file
from batchpilot_operator.io.push import AdminClient
from batchpilot_runtime.contract.window import Window
from tests.support.factories import make_manifest, make_spec_dict

NOW_S = 1_750_000_000.0
TUNED = {"targetBatchSize": 4, "hardCap": 12, "maxWaitMs": 20, "tailMarkRatio": 2.0, "generation": 5}
POLICY = {
    "version": 1,
    "observedGeneration": 2,
    "lastChangeTime": "2025-06-15T15:03:20.000000Z",  # 200 s before NOW_S
    "kvCapCeiling": 12,
    "headroomStreak": 3,
}


def saved_entry(spec: Any, **extra: Any) -> dict[str, Any]:
    """A status file entry as local mode writes it: the status of generation 2, and the spec it was for."""
    return {"observedGeneration": 2, "window": TUNED, "policy": POLICY, "spec": spec, **extra}


def write_profiles(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(make_manifest(spec, name="chat", namespace="ml")))
    return path


@pytest.fixture
async def admin() -> AsyncIterator[AdminClient]:
    client = AdminClient(timeout_s=1.0)
    yield client
    await client.aclose()


def adopt(tmp_path: Path, admin: AdminClient, spec: dict[str, Any], saved: dict[str, Any]) -> tuple[Controller, str]:
    """``spec`` loaded as local mode loads it, adopted with the ``saved`` status file entries: the controller
    and what was printed."""
    out = io.StringIO()
    sink = LocalSink(out, tmp_path / "status.json", saved)
    controller = Controller(Settings(), None, admin, sink, match_by_model=True, wall_clock=lambda: NOW_S)
    add_profiles(controller, load_profiles(write_profiles(tmp_path / "p.yaml", spec)), sink, out)
    return controller, out.getvalue()


def test_no_status_file_or_none_yet_is_a_first_start(tmp_path: Path) -> None:
    assert read_status_file(None) == {}
    assert read_status_file(tmp_path / "status.json") == {}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"ml/chat": {"window": ', "cannot be read as JSON (Expecting value: line 1 column 24 (char 23))"),
        ('[{"window": {}}]', "not a status file"),
        ('{"ml/chat": 3}', "not a status file"),
    ],
)
def test_a_status_file_that_is_not_one_is_an_error_naming_it(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "status.json"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        read_status_file(path)
    assert str(error.value).startswith(f"--status-file {path}: {problem}")
    assert str(error.value).endswith("move it away to start afresh")


def test_the_command_refuses_a_broken_status_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles = write_profiles(tmp_path / "p.yaml", make_spec_dict())
    status_file = tmp_path / "status.json"
    status_file.write_text("not json")
    code = main(["local", "--profiles", str(profiles), "--status-file", str(status_file),
                 "--runtime", "model=chat,url=http://127.0.0.1:1,admin=http://127.0.0.1:1"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"batchpilot-operator local: error: --status-file {status_file}: cannot be read as JSON")
    assert "Traceback" not in err
    assert status_file.read_text() == "not json"  # left for the user to look at


async def test_the_same_spec_resumes_its_window_generation_and_policy(tmp_path: Path, admin: AdminClient) -> None:
    spec = make_spec_dict(tuning={"cooldownSeconds": 300})
    controller, printed = adopt(tmp_path, admin, spec, {"ml/chat": saved_entry(spec)})
    record = controller.profiles["ml/chat"]
    assert record.generation == 2
    assert record.loop.window == Window.model_validate(TUNED)
    assert record.memory.policy_state.last_change_s == NOW_S - 200
    assert (record.memory.policy_state.kv_cap_ceiling, record.memory.policy_state.headroom_streak) == (12, 3)
    assert printed.endswith("ml/chat resumed from the status file: target=4 cap=12 wait=20ms tail=2x gen=5\n")


async def test_an_entry_without_a_spec_counts_as_written_for_this_one(tmp_path: Path, admin: AdminClient) -> None:
    spec = make_spec_dict()
    entry = {k: v for k, v in saved_entry(spec).items() if k != "spec"}
    controller, _ = adopt(tmp_path, admin, spec, {"ml/chat": entry})
    record = controller.profiles["ml/chat"]
    assert (record.generation, record.loop.window) == (2, Window.model_validate(TUNED))


async def test_a_changed_spec_window_is_applied_as_a_change_under_a_running_operator(
    tmp_path: Path, admin: AdminClient
) -> None:
    old = make_spec_dict(tuning={"cooldownSeconds": 300})
    new = make_spec_dict(window={"targetBatchSize": 6, "hardCap": 24, "maxWaitMs": 30}, tuning={"cooldownSeconds": 300})
    controller, printed = adopt(tmp_path, admin, new, {"ml/chat": saved_entry(old)})
    record = controller.profiles["ml/chat"]
    assert record.generation == 3
    # The new starting window, numbered past the one in force; the memory carried over (the ceiling and
    # the cooldown kept, the streaks measured against the old spec reset).
    assert record.loop.window == Window.model_validate(
        {"targetBatchSize": 6, "hardCap": 24, "maxWaitMs": 30, "generation": 6}
    )
    state = record.memory.policy_state
    assert (state.last_change_s, state.kv_cap_ceiling, state.headroom_streak) == (NOW_S - 200, 12, 0)
    assert "ml/chat spec changed since the status file was written: generation 3\n" in printed


async def test_a_change_elsewhere_in_the_spec_keeps_the_tuned_window(tmp_path: Path, admin: AdminClient) -> None:
    old = make_spec_dict(tuning={"cooldownSeconds": 300})
    new = make_spec_dict(slo={"p99Ms": 800}, tuning={"cooldownSeconds": 300})
    controller, _ = adopt(tmp_path, admin, new, {"ml/chat": saved_entry(old)})
    record = controller.profiles["ml/chat"]
    assert (record.generation, record.loop.window) == (3, Window.model_validate(TUNED))
    assert record.memory.policy_state.headroom_streak == 0


async def test_the_file_keeps_each_spec_and_the_entries_of_profiles_not_loaded(tmp_path: Path) -> None:
    spec = make_spec_dict()
    other = {"observedGeneration": 4, "spec": {"model": "other"}}
    sink = LocalSink(io.StringIO(), tmp_path / "status.json", {"ml/chat": saved_entry(spec), "ml/other": other})
    # A new window is written through at once (ahead of its push), not after the tick.
    await sink.patch_status(ProfileRef("ml", "chat"), {"window": {"generation": 6}})
    written = json.loads((tmp_path / "status.json").read_text())
    assert written["ml/other"] == other
    assert written["ml/chat"] == saved_entry(spec, window={**TUNED, "generation": 6})
    assert sink.status["ml/chat"] == {k: v for k, v in written["ml/chat"].items() if k != "spec"}
