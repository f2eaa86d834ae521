"""How long the demo's chat prompts are on this host.

The chat model's surge shows the budget's effect only when a step that prefills the engine
default's budget takes several times the inter-token SLO, while the surge's prompt tokens stay
within what the host prefills at a budget that meets it. Both depend on how fast this host runs a
prefill step right now (its cores, and whatever else runs on them). So before the replay the demo
has the runtime time a reference step (``batchpilot-runtime time-step``, so that the operator
never loads torch), a 1024-token prompt prefilled beside 16 decodes on the replay's preset and
thread count, in as many processes at once as it runs runtimes (one process alone misses the
contention: beside two busy loops on 2 cores it timed the step as fast as on an idle host, two at
once 1.7-2.25x slower), and on a host much slower than the reference machine scales the chat
model's tokens (prompt lengths, its starting budget and the budget's bound together), down to
``MIN_TOKEN_SCALE``. Measured on the development machine: idle, at full length, the budget took
the static window's inter-token P99 from 97-122 ms to 40-63 ms; at a load average of about 7, at
half the lengths, from 423 to 55 ms with the TTFT P99 from 2.4 s to 305 ms.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

from batchpilot_operator.demo.children import DemoError, threads_per_runtime
from batchpilot_operator.demo.settings import DemoModel, DemoSettings

# The reference step's median on the development machine (2 cores, idle, two processes of one
# torch thread each): 38-49 ms.
REFERENCE_STEP_S = 0.045
REFERENCE_PRESET = "tiny"
FULL_LENGTH_SLOWDOWN = 1.5
MIN_TOKEN_SCALE = 0.25
# How a prefill step's time grows with its prompt's length on the tiny preset: one prompt of 512,
# 1024 and 2048 tokens beside 30 decodes took 13, 42 and 126 ms (2.0^1.6 = 3.0 per doubling).
PREFILL_COST_EXPONENT = 1.6
REFERENCE_PROMPT_TOKENS = 1024
REFERENCE_DECODES = 16
REPEATS = 5


def time_step_command(preset: str, threads: int) -> list[str]:
    """``batchpilot-runtime time-step`` for the reference step, in this interpreter (as the runtimes run)."""
    return [
        sys.executable,
        "-m",
        "batchpilot_runtime.cli.main",
        "time-step",
        "--preset",
        preset,
        "--threads",
        str(threads),
        "--prompt-tokens",
        str(REFERENCE_PROMPT_TOKENS),
        "--decodes",
        str(REFERENCE_DECODES),
        "--repeats",
        str(REPEATS),
    ]


def _step_s_reported(process: subprocess.Popen[str], command: Sequence[str]) -> float:
    """The median step time a ``time-step`` process printed; a DemoError quoting its stderr otherwise."""
    stdout, stderr = process.communicate()
    try:
        if process.returncode != 0:
            raise ValueError(f"exit code {process.returncode}")
        step_s = float(json.loads(stdout.strip().splitlines()[-1])["median_step_s"])
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise DemoError(f"timing a prefill step failed ({error}): {shlex.join(command)}\n{stderr[-2000:]}") from None
    return step_s


def measure_on_host(preset: str, threads: int, processes: int) -> float:
    """The slowest of ``processes`` reference steps timed at once, each by its own runtime process
    (``batchpilot-runtime time-step``), as the runtimes will run."""
    command = time_step_command(preset, threads)
    started = [
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    try:
        return max(_step_s_reported(process, command) for process in started)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()


def token_scale_for(step_s: float) -> float:
    """The chat model's token scale for a reference step of ``step_s`` here, to 0.05.

    Up to ``FULL_LENGTH_SLOWDOWN`` times the reference time the trace's lengths stay (an idle
    host's timing varies by about a fifth). With two busy loops beside the demo on the 2-core
    development machine the step timed 1.7-2.25x the reference. There, at full length the static
    window's inter-token P99 stood at 126 ms against the 40 ms target and the adaptive one's no
    better; at 0.95 of the lengths (what a 2x dead band gave at 2.25x) 122 -> 66 ms; at 0.8 (what
    1.5x gives) 67 -> 43 ms; at 0.6-0.65 the static window met the target outright (36-38 ms) and
    the budget had nothing to do (a runtime is not busy all the time, so it loses less to the loops
    than two processes that are). Past the dead band, lengths shrink so that a step prefilling the
    same share of the (scaled) budget costs what it costs at that slowdown: a prompt's step cost
    grows as its length to the ``PREFILL_COST_EXPONENT`` (attention is quadratic in it)."""
    if not step_s > 0:
        raise ValueError(f"reference step: expected a positive time, got {step_s!r} s")
    slowdown = step_s / (FULL_LENGTH_SLOWDOWN * REFERENCE_STEP_S)
    scale = min(1.0, max(MIN_TOKEN_SCALE, float(slowdown ** (-1.0 / PREFILL_COST_EXPONENT))))
    return round(round(scale * 20) / 20, 2)


def sized(model: DemoModel, scale: float) -> DemoModel:
    """``model`` with its prompt lengths, starting budget and budget bound scaled by ``scale``."""
    if not model.size_to_host or scale == 1.0:
        return model
    budget = model.window.max_prefill_tokens
    bounds = dict(model.bounds)
    if "maxPrefillTokens" in bounds:
        top = bounds["maxPrefillTokens"]
        bounds["maxPrefillTokens"] = {"min": top["min"], "max": max(top["min"], round(top["max"] * scale))}
    return replace(
        model,
        token_scale=model.token_scale * scale,
        max_prompt_tokens=max(1, round(model.max_prompt_tokens * scale)),
        window=model.window
        if budget is None
        else model.window.model_copy(update={"max_prefill_tokens": round(budget * scale)}),
        bounds=bounds,
    )


@dataclass(frozen=True)
class Sizing:
    """What the demo measured here and the token scale it chose, for the console and the report."""

    scale: float
    step_s: float | None  # None: not measured (--token-scale given, or no model sized to the host)
    sized: tuple[str, ...]  # the models it scaled

    def describe(self) -> str:
        if not self.sized:
            return "no model sized to the host"
        names = ", ".join(self.sized)
        if self.step_s is None:
            return f"{names} tokens x{self.scale:g} (--token-scale)"
        return (
            f"{names} tokens x{self.scale:g}: a {REFERENCE_PROMPT_TOKENS}-token prefill step beside "
            f"{REFERENCE_DECODES} decodes took {self.step_s * 1000:.1f} ms here (in each runtime's place at once), "
            f"{REFERENCE_STEP_S * 1000:g} ms on the reference machine"
        )


def models_to_size(settings: DemoSettings) -> list[DemoModel]:
    """The models whose tokens follow this host's speed: those that ask for it, on the reference
    preset (the reference time is that preset's)."""
    return [m for m in settings.effective_models() if m.size_to_host and m.preset == REFERENCE_PRESET]


def size_to_host(settings: DemoSettings) -> tuple[DemoSettings, Sizing]:
    """``settings`` with the models that ask for it sized to this host (measured unless
    ``settings.token_scale`` is given), and what was done."""
    models = settings.effective_models()
    wanted = models_to_size(settings)
    if not wanted:
        return settings, Sizing(1.0, None, ())
    step_s: float | None = None
    scale = settings.token_scale
    if scale is None:
        step_s = measure_on_host(REFERENCE_PRESET, threads_per_runtime(len(models), os.cpu_count()), len(models))
        scale = token_scale_for(step_s)
    resized = tuple(sized(m, scale) if m in wanted else m for m in models)
    return replace(settings, models=resized, preset_override=None, token_scale=scale), Sizing(
        scale, step_s, tuple(m.name for m in wanted)
    )
