"""The demo's settings: its profiles are valid BatchProfiles, both phases replay the same arrivals
with the surge at its factor, bad durations name the setting, and runtimes never share more torch
threads than the host has cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchpilot_operator.api.profile import parse_manifest
from batchpilot_operator.demo.children import threads_per_runtime
from batchpilot_operator.demo.settings import (
    SURGE_END_FRACTION,
    SURGE_START_FRACTION,
    DemoSettings,
    Surge,
    default_models,
    duration_from_env,
    plan_arrivals,
    warp_arrival,
)
from batchpilot_runtime.replay.trace import TraceRequest


@pytest.mark.parametrize("mode", ["static", "adaptive"])
def test_demo_profiles_are_valid_batch_profiles(mode: str) -> None:
    for model in default_models():
        _, name, spec = parse_manifest(model.profile_manifest(mode))
        assert name == model.name
        assert spec.tuning.mode.value == mode
        assert spec.window == model.window
        assert spec.slo.inter_token_p99_ms == model.slo_itl_p99_ms
    chat = next(m for m in default_models() if m.name == "chat")
    # chat starts on engine defaults with a budget, under both SLOs, and the operator may move the budget.
    assert chat.window.max_prefill_tokens is not None and chat.slo_itl_p99_ms is not None
    assert chat.window_label == "engine defaults"
    _, _, spec = parse_manifest(chat.profile_manifest(mode))
    assert spec.tuning.bounds.max_prefill_tokens.contains(chat.window.max_prefill_tokens)
    assert spec.tuning.bounds.max_prefill_tokens.min < chat.window.max_prefill_tokens


def test_both_phases_replay_the_same_arrivals_at_each_models_rate() -> None:
    settings = DemoSettings(duration_s=60.0, out_dir=Path("unused"), live=False)
    first, second = plan_arrivals(settings), plan_arrivals(settings)
    assert [a.requests for a in first] == [a.requests for a in second]
    for arrivals, model in zip(first, default_models(), strict=True):
        assert len(arrivals.requests) == round(model.arrival_rate_per_s * 30.0)
        assert arrivals.requests[0].arrival_s == 0.0
        assert arrivals.requests[-1].arrival_s == pytest.approx(30.0)
        assert max(r.output_tokens for r in arrivals.requests) <= model.max_output_tokens
        assert [r.arrival_s for r in arrivals.requests] == sorted(r.arrival_s for r in arrivals.requests)


def test_the_surge_is_in_both_phases_arrivals_at_its_factor() -> None:
    """On an even trace (one request a second) the surge's stretch holds ``factor`` times the
    arrivals per second of the rest, the same in both phases, and the phase keeps its length."""
    even = [TraceRequest(arrival_s=float(i), prompt_tokens=2000, output_tokens=10) for i in range(2000)]
    settings = DemoSettings(duration_s=120.0, out_dir=Path("unused"), live=False)
    first, second = plan_arrivals(settings, even), plan_arrivals(settings, even)
    assert [a.requests for a in first] == [a.requests for a in second]
    chat = next(a for a in first if a.model == "chat")
    model = next(m for m in default_models() if m.name == "chat")
    assert chat.surge == Surge(SURGE_START_FRACTION * 60.0, SURGE_END_FRACTION * 60.0, model.surge_factor)
    assert model.surge_factor >= 2.0
    times = [r.arrival_s for r in chat.requests]
    assert len(times) == round(model.arrival_rate_per_s * 60.0)
    assert times[0] == 0.0 and times[-1] == pytest.approx(60.0)
    inside = sum(1 for t in times if chat.surge.start_s <= t < chat.surge.end_s)
    outside = len(times) - inside
    inside_rate = inside / (chat.surge.end_s - chat.surge.start_s)
    outside_rate = outside / (60.0 - (chat.surge.end_s - chat.surge.start_s))
    assert inside_rate / outside_rate == pytest.approx(model.surge_factor, rel=0.05)
    # Prompts are the trace's at the model's token scale, clamped: long enough for the budget to matter.
    assert {r.prompt_tokens for r in chat.requests} == {min(model.max_prompt_tokens, round(2000 * model.token_scale))}
    bulk = next(a for a in first if a.model == "bulk")
    assert bulk.surge is None
    assert "surge x" in chat.describe() and "surge" not in bulk.describe()


def test_warping_keeps_the_order_and_the_ends_of_the_phase() -> None:
    surge = Surge(10.0, 20.0, 3.0)
    assert warp_arrival(5.0, surge) == 5.0
    assert warp_arrival(10.0 + 30.0, surge) == pytest.approx(20.0)
    assert warp_arrival(10.0 + 15.0, surge) == pytest.approx(15.0)
    assert warp_arrival(60.0, surge) == pytest.approx(40.0)
    points = [warp_arrival(0.5 * i, surge) for i in range(200)]
    assert points == sorted(points)


def test_bad_durations_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="--duration"):
        DemoSettings(duration_s=5.0, out_dir=Path("unused"), live=False)
    monkeypatch.setenv("BATCHPILOT_DEMO_DURATION", "three minutes")
    with pytest.raises(ValueError, match="BATCHPILOT_DEMO_DURATION"):
        duration_from_env()
    monkeypatch.setenv("BATCHPILOT_DEMO_DURATION", "90")
    assert duration_from_env() == 90.0


@pytest.mark.parametrize(("runtimes", "cpus", "threads"), [(2, 2, 1), (2, 16, 8), (3, 2, 1), (1, None, 1), (0, 4, 4)])
def test_runtimes_never_share_more_threads_than_cores(runtimes: int, cpus: int | None, threads: int) -> None:
    assert threads_per_runtime(runtimes, cpus) == threads
