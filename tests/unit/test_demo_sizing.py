"""The demo sizes its chat prompts to the host: a slower host gets shorter prompts and a smaller
starting budget together, so that the surge's prompt tokens keep the same share of what the host
prefills, and the run says what it measured and how to replay it at the same size."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from batchpilot_operator.api.profile import parse_manifest
from batchpilot_operator.demo import sizing
from batchpilot_operator.demo.children import DemoError
from batchpilot_operator.demo.settings import DemoSettings, default_models, plan_arrivals
from batchpilot_operator.demo.sizing import (
    MIN_TOKEN_SCALE,
    REFERENCE_STEP_S,
    Sizing,
    models_to_size,
    size_to_host,
    sized,
    token_scale_for,
)


@pytest.mark.parametrize(
    ("step_s", "scale"),
    [
        (REFERENCE_STEP_S / 2, 1.0),  # a faster host keeps the trace's lengths
        (REFERENCE_STEP_S, 1.0),
        (REFERENCE_STEP_S * 1.4, 1.0),  # within an idle host's spread
        (REFERENCE_STEP_S * 2.25, 0.8),  # two busy loops: 1.5 ** (-1 / 1.6) = 0.776, to the nearest 0.05
        (REFERENCE_STEP_S * 4, 0.55),  # (4 / 1.5) ** (-1 / 1.6) = 0.542: prefill costs grow faster than lengths
        (REFERENCE_STEP_S * 6, 0.4),  # 0.420
        (REFERENCE_STEP_S * 100, MIN_TOKEN_SCALE),
    ],
)
def test_the_scale_follows_the_reference_step_within_its_bounds(step_s: float, scale: float) -> None:
    assert token_scale_for(step_s) == scale


@pytest.mark.parametrize("step_s", [0.0, -1.0, math.nan])
def test_a_step_time_that_is_not_positive_is_refused(step_s: float) -> None:
    with pytest.raises(ValueError, match="reference step"):
        token_scale_for(step_s)


def test_sizing_scales_prompts_budget_and_bound_together_and_nothing_else() -> None:
    chat, bulk = default_models()
    half = sized(chat, 0.5)
    assert half.token_scale == chat.token_scale * 0.5
    assert half.max_prompt_tokens == chat.max_prompt_tokens // 2
    assert chat.window.max_prefill_tokens is not None
    assert half.window.max_prefill_tokens == chat.window.max_prefill_tokens // 2
    assert half.bounds["maxPrefillTokens"] == {"min": 64, "max": chat.bounds["maxPrefillTokens"]["max"] / 2}
    # The static window is still the engine defaults at the trace's (scaled) token scale.
    assert half.window.model_copy(update={"max_prefill_tokens": None}) == chat.window.model_copy(
        update={"max_prefill_tokens": None}
    )
    assert (half.arrival_rate_per_s, half.slo_p99_ms, half.slo_itl_p99_ms) == (
        chat.arrival_rate_per_s,
        chat.slo_p99_ms,
        chat.slo_itl_p99_ms,
    )
    assert sized(bulk, 0.5) == bulk  # not sized to the host
    assert sized(chat, 1.0) == chat
    # The scaled profile is still a valid BatchProfile (the start within the bounds).
    parse_manifest(half.profile_manifest("adaptive"))


def test_a_given_scale_is_used_without_measuring(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def measure(preset: str, threads: int, processes: int) -> float:
        raise AssertionError("measured although --token-scale was given")

    monkeypatch.setattr(sizing, "measure_on_host", measure)
    settings, done = size_to_host(DemoSettings(duration_s=40, out_dir=tmp_path, live=False, token_scale=0.5))
    assert done == Sizing(0.5, None, ("chat",))
    assert "x0.5 (--token-scale)" in done.describe()
    chat = next(m for m in settings.models if m.name == "chat")
    assert chat.max_prompt_tokens == default_models()[0].max_prompt_tokens // 2
    # The arrivals follow: the same requests, their prompts at half the length.
    full = {a.model: a for a in plan_arrivals(DemoSettings(duration_s=40, out_dir=tmp_path, live=False))}
    half = {a.model: a for a in plan_arrivals(settings)}
    assert [r.arrival_s for r in half["chat"].requests] == [r.arrival_s for r in full["chat"].requests]
    assert max(r.prompt_tokens for r in half["chat"].requests) <= chat.max_prompt_tokens
    assert sum(r.prompt_tokens for r in half["chat"].requests) < 0.6 * sum(
        r.prompt_tokens for r in full["chat"].requests
    )
    assert half["bulk"].requests == full["bulk"].requests


def test_the_measured_step_sets_the_scale(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sizing, "measure_on_host", lambda preset, threads, processes: REFERENCE_STEP_S * 6)
    settings, done = size_to_host(DemoSettings(duration_s=40, out_dir=tmp_path, live=False))
    assert done.scale == settings.token_scale == 0.4 and done.step_s == REFERENCE_STEP_S * 6
    assert f"took {REFERENCE_STEP_S * 6000:.1f} ms here" in done.describe()


def test_another_preset_is_not_sized(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The reference time is the tiny preset's: another preset's step says nothing against it."""
    monkeypatch.setattr(sizing, "measure_on_host", lambda preset, threads, processes: pytest.fail("measured"))
    settings = DemoSettings(duration_s=40, out_dir=tmp_path, live=False, preset_override="small")
    resized, done = size_to_host(settings)
    assert done.sized == () and resized == settings
    assert models_to_size(settings) == []  # so the demo does not announce a timing it skips


def test_the_default_demo_sizes_its_chat_model_only(tmp_path: Path) -> None:
    settings = DemoSettings(duration_s=40, out_dir=tmp_path, live=False)
    assert [m.name for m in models_to_size(settings)] == [m.name for m in default_models() if m.size_to_host]
    assert len(models_to_size(settings)) == 1


def test_the_reference_step_runs_here_in_each_runtimes_place() -> None:
    """The measurement itself: real prefill steps of the tiny preset in two runtime processes, a positive time."""
    step_s = sizing.measure_on_host("tiny", 1, 2)
    assert math.isfinite(step_s) and step_s > 0


def test_a_failed_timing_names_the_command_and_quotes_its_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('no preset huge'); sys.exit(2)"]
    monkeypatch.setattr(sizing, "time_step_command", lambda preset, threads: failing)
    with pytest.raises(DemoError, match=r"timing a prefill step failed \(exit code 2\).*\n.*no preset huge"):
        sizing.measure_on_host("huge", 1, 2)


def test_the_timing_command_asks_the_runtime_for_the_reference_step() -> None:
    command = sizing.time_step_command("tiny", 3)
    assert command[1:4] == ["-m", "batchpilot_runtime.cli.main", "time-step"]
    flags = dict(zip(command[4::2], command[5::2], strict=True))
    assert flags == {
        "--preset": "tiny",
        "--threads": "3",
        "--prompt-tokens": str(sizing.REFERENCE_PROMPT_TOKENS),
        "--decodes": str(sizing.REFERENCE_DECODES),
        "--repeats": str(sizing.REPEATS),
    }


@pytest.mark.parametrize("scale", [0.0, 1.5, -0.5])
def test_a_token_scale_out_of_range_is_refused(scale: float, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--token-scale"):
        DemoSettings(duration_s=40, out_dir=tmp_path, live=False, token_scale=scale)
