"""The demo reads the operator's decisions back from its output: local mode's text and JSON lines
parse into the model, the direction, the window with its budget, and the reason."""

from __future__ import annotations

import io
import json

import pytest

from batchpilot_operator.api.profile import parse_manifest
from batchpilot_operator.control.controller import ProfileRecord, ProfileRef
from batchpilot_operator.demo.decisions import ParsedDecision, parse_decision_line
from batchpilot_operator.demo.settings import default_models
from batchpilot_operator.frontends.local import print_decision
from batchpilot_operator.tuning.policy import Decision, PolicyState
from batchpilot_runtime.contract.window import Window


def test_local_mode_decision_lines_are_read_and_other_lines_are_not() -> None:
    models = ["chat", "bulk"]
    line = (
        "14:27:04 demo/chat model=chat mode=adaptive down: target=14 cap=16 wait=200ms tail=2x gen=2 - "
        "P99 587 ms over SLO 500 ms (1.17x the SLO): lowering wait and target."
    )
    parsed = parse_decision_line(line, models)
    assert parsed is not None
    assert (parsed.model, parsed.direction) == ("chat", "down")
    assert parsed.window == "target=14 cap=16 wait=200ms tail=2x gen=2"
    assert parsed.reason == "P99 587 ms over SLO 500 ms (1.17x the SLO): lowering wait and target."
    assert parse_decision_line("14:27:04 local mode: 2 profile(s), 2 runtime(s)", models) is None
    assert parse_decision_line("14:27:04 demo/chat Warning PushFailed: pod chat-0: refused: down", models) is None
    assert parse_decision_line(line.replace("model=chat", "model=other"), models) is None
    as_json = parse_decision_line('{"model": "bulk", "direction": "up", "reason": "headroom"}', models)
    assert as_json == ParsedDecision("bulk", "up", "headroom", None)
    assert parsed.budget is None  # no budget=N: whole prompts


def test_the_budget_is_read_from_decision_lines() -> None:
    line = (
        "14:27:04 demo/chat model=chat mode=adaptive down: target=1 cap=256 wait=0ms tail=2x budget=384 gen=3 - "
        "lowering the prefill budget to 384 tokens (inter-token P99 61 ms over its 40 ms target)"
    )
    parsed = parse_decision_line(line, ["chat"])
    assert parsed is not None and parsed.budget == 384
    assert parsed.reason.startswith("lowering the prefill budget to 384 tokens")
    as_json = parse_decision_line(
        json.dumps(
            {
                "model": "chat",
                "direction": "down",
                "reason": "over",
                "window": {"targetBatchSize": 1, "hardCap": 256, "maxWaitMs": 0, "maxPrefillTokens": 96},
            }
        ),
        ["chat"],
    )
    assert as_json is not None and as_json.budget == 96
    assert as_json.window is not None and "budget=96" in as_json.window


@pytest.mark.parametrize("output", ["text", "json"])
def test_local_mode_decision_lines_parse_back_in_both_outputs(output: str) -> None:
    model = default_models()[0]
    _, name, spec = parse_manifest(model.profile_manifest("adaptive"))
    record = ProfileRecord(ref=ProfileRef("demo", name), generation=1, spec=spec, error=None)
    window = Window(target_batch_size=14, hard_cap=16, max_wait_ms=200, tail_mark_ratio=2.5, generation=2)
    reason = "P99 587 ms over SLO 500 ms (1.17x the SLO): lowering wait and target."
    out = io.StringIO()
    print_decision(out, output)(record, Decision(window, "down", reason, PolicyState()))
    (line,) = out.getvalue().splitlines()
    if output == "json":
        assert json.loads(line)["window"]["maxWaitMs"] == 200
    parsed = parse_decision_line(line, [model.name])
    assert parsed is not None
    assert (parsed.model, parsed.direction, parsed.reason) == (model.name, "down", reason)
    assert parsed.window is not None
    assert parsed.window.startswith("target=14 cap=16 wait=200ms tail=2.5x")
