"""The restart path's decisions, pure: whether a recommendation is worth a restart and the budget allows one,
and the container args that carry it. No I/O, no clock: ``now_s`` is given.

Why these thresholds (spec.restart's defaults): a restart of a large vLLM pod costs minutes of capacity and
its prefix cache, so a change must be large (``minChange``, 25 % of ``--max-num-seqs`` or
``--max-num-batched-tokens``: the policy moves by at most 50 % a step, so 25 % is at least half a step,
well past its hysteresis) and must persist (``stableIntervals``, 3: a recommendation that flips direction
starts over, so a flapping policy never restarts on its own). While the SLO is broken the tail is already
being paid for, so one interval is enough. The budget bounds all of it, whatever the policy does: at most
``maxPerDay`` restarts in any 24 hours, ``minIntervalSeconds`` apart, starting only inside ``allowedHours``.

After a restart, once the workload has rolled out, its SLO is watched for ``stableIntervals`` intervals: a
restart made while the SLO was met that breaks it is rolled back to the args before it (:func:`judge`).
The rollback is the one restart outside minIntervalSeconds and allowedHours (it restores a known state, and
waiting would keep the SLO broken); there is at most one per restart, so at most 2 x maxPerDay a day, and
the change rolled back is not tried again for a day.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchpilot_operator.control.status import ConditionFact

DAY_S = 86_400.0

# The flags that carry a window, per engine (vLLM: vllm/engine/arg_utils.py; SGLang: sglang/srt/server_args.py).
VLLM_FLAGS = ("--max-num-seqs", "--max-num-batched-tokens")
SGLANG_FLAGS = ("--max-running-requests", "--chunked-prefill-size")
# llama.cpp's llama-server (common/arg.cpp, tools/server/server.cpp): the cap is its slot count, the per-step
# budget the tokens of one llama_decode() call (decodes first, then prompt chunks); both only at start-up.
LLAMACPP_FLAGS = ("--parallel", "--batch-size")
# Its parser takes each flag under a short name too (and no --flag=N form: a value is the next arg).
LLAMACPP_ALIASES = {
    "-np": "--parallel",
    "-b": "--batch-size",
    "-ub": "--ubatch-size",
    "-c": "--ctx-size",
    "-kvu": "--kv-unified",
    "-no-kvu": "--no-kv-unified",
}
# server.cpp: --parallel -1 (its default, "auto") runs 4 slots over one unified KV cache.
LLAMACPP_AUTO_SLOTS = 4
# common/common.h: n_ubatch's default, the physical batch one llama_decode() call is computed in.
LLAMACPP_DEFAULT_UBATCH = 512


@dataclass(frozen=True)
class Budget:
    """spec.restart's budget in seconds; ``hours`` as (start, end) minutes past midnight UTC, end excluded."""

    max_per_day: int
    min_interval_s: float
    hours: tuple[int, int] | None = None
    min_change: float = 0.25
    stable_intervals: int = 3


@dataclass(frozen=True)
class Verdict:
    """``restart``: patch the workload now. ``streak``/``trend``: carried to the next evaluation."""

    restart: bool
    reason: str
    next_allowed_s: float
    streak: int = 0
    trend: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Watch:
    """A restart under judgement: the flags before and after it, whether the SLO was met when it was made,
    and how many rolled-out intervals are left to judge."""

    previous: dict[str, int]
    applied: dict[str, int]
    slo_met_before: bool
    intervals_left: int
    trend: tuple[tuple[str, int], ...] = ()  # the restart's moves, as decide() saw them


@dataclass(frozen=True)
class Rejected:
    """A change rolled back: the same move from the same args is not tried again before ``until_s``."""

    running: dict[str, int]
    trend: tuple[tuple[str, int], ...]
    until_s: float


@dataclass
class RestartBook:
    """What the restart path keeps of a profile between ticks (control/restart.py writes it)."""

    history: list[float] | None = None  # restart times (epoch s) of the last day; None until read from status
    applied: dict[str, int] | None = None  # the flags last written to the workload's args
    running: dict[str, int] = field(default_factory=dict)  # what the workload's args carry now
    streak: int = 0
    trend: tuple[tuple[str, int], ...] = ()
    reverted_at: float | None = None  # when the args were found without the applied flags
    synced: ConditionFact | None = None  # the Synced condition's fact in restart mode
    status: dict[str, Any] | None = None  # status.restart as written next
    evaluation: int = -1  # the profile's evaluation count the last verdict was for
    verdict: Verdict | None = None
    watch: Watch | None = None  # the last restart, while its SLO is judged
    rejected: Rejected | None = None  # the last change rolled back


def in_hours(hours: tuple[int, int] | None, now_s: float) -> bool:
    if hours is None:
        return True
    start, end = hours
    minute = int((now_s % DAY_S) // 60)
    return start <= minute < end if start < end else (minute >= start or minute < end)


def next_in_hours(hours: tuple[int, int] | None, from_s: float) -> float:
    """The earliest time at or after ``from_s`` inside ``hours``."""
    if in_hours(hours, from_s):
        return from_s
    assert hours is not None
    day_start = from_s - from_s % DAY_S
    start = day_start + hours[0] * 60
    return start if start >= from_s else start + DAY_S


def next_allowed(budget: Budget, history: Sequence[float], now_s: float) -> float:
    """The earliest time at or after ``now_s`` the budget allows a restart, given past restart times.

    Each rule only loosens as time passes (until the next restart), so the latest of their earliest times is
    the answer, moved into the allowed hours."""
    recent = sorted(t for t in history if now_s - DAY_S < t <= now_s)
    earliest = now_s
    if recent:
        earliest = max(earliest, recent[-1] + budget.min_interval_s)
    if len(recent) >= budget.max_per_day:
        # The window is (t - 1 day, t]: the restart that must drop out leaves it one day after it happened.
        earliest = max(earliest, recent[len(recent) - budget.max_per_day] + DAY_S)
    return next_in_hours(budget.hours, earliest)


def relative_change(running: int | None, wanted: int) -> float:
    """|wanted - running| / running; infinite when the args do not set the flag (the engine's default)."""
    if running is None or running <= 0:
        return math.inf
    return abs(wanted - running) / running


def worth(running: Mapping[str, int], wanted: Mapping[str, int], min_change: float) -> dict[str, int]:
    """Each flag's direction (+1, -1) where ``wanted`` moves it by ``min_change`` or more; empty: not worth it."""
    return {
        flag: 1 if running.get(flag) is None or value > running[flag] else -1
        for flag, value in wanted.items()
        if relative_change(running.get(flag), value) >= min_change
    }


def _describe(running: Mapping[str, int], wanted: Mapping[str, int]) -> str:
    return ", ".join(f"{flag} {running.get(flag, 'unset')} -> {value}" for flag, value in wanted.items())


def decide(
    budget: Budget,
    history: Sequence[float],
    now_s: float,
    running: Mapping[str, int],
    wanted: Mapping[str, int],
    *,
    streak: int,
    trend: tuple[tuple[str, int], ...],
    slo_over: bool,
    rejected: Rejected | None = None,
) -> Verdict:
    """Restart now or not: the change must be worth it, held long enough (or the SLO broken), allowed, and not
    the one just rolled back."""
    allowed_at = next_allowed(budget, history, now_s)
    moves = worth(running, wanted, budget.min_change)
    if not moves:
        return Verdict(False, "the recommendation is within minChange of what the workload runs", allowed_at)
    new_trend = tuple(sorted(moves.items()))
    held = streak + 1 if new_trend == trend else 1
    change = _describe(running, {flag: wanted[flag] for flag in moves})
    if _is_rejected(rejected, now_s, running, new_trend):
        assert rejected is not None
        reason = f"{change}: the same change was rolled back after it broke the SLO; not tried again yet"
        return Verdict(False, reason, max(allowed_at, rejected.until_s))
    if held < budget.stable_intervals and not slo_over:
        reason = f"{change}: held {held} of {budget.stable_intervals} intervals before a restart"
        return Verdict(False, reason, allowed_at, held, new_trend)
    if allowed_at > now_s:
        return Verdict(
            False, f"{change}: the restart budget allows the next restart later", allowed_at, held, new_trend
        )
    why = "the SLO is broken" if slo_over and held < budget.stable_intervals else f"held {held} intervals"
    return Verdict(True, f"{change} ({why})", allowed_at, 0, ())


def _is_rejected(
    rejected: Rejected | None, now_s: float, running: Mapping[str, int], trend: tuple[tuple[str, int], ...]
) -> bool:
    return (
        rejected is not None and now_s < rejected.until_s and dict(running) == rejected.running
        and trend == rejected.trend
    )  # fmt: skip


def judge(watch: Watch, slo_over: bool | None) -> tuple[str, Watch | None]:
    """One rolled-out interval after a restart: ``rollback`` when the SLO, met when the restart was made, is
    broken now; else ``watch`` (the watch, one interval shorter) or, once none is left, ``keep``."""
    if slo_over is True and watch.slo_met_before:
        return "rollback", None
    left = watch.intervals_left - 1
    return ("keep", None) if left <= 0 else ("watch", dataclasses.replace(watch, intervals_left=left))


def rolled_out(workload: Mapping[str, Any]) -> bool:
    """Whether the workload's controller has rolled its current template out to every replica (Deployment and
    StatefulSet status alike); a workload without status has not."""
    meta, spec, status = (workload.get(k) or {} for k in ("metadata", "spec", "status"))
    generation, observed = meta.get("generation"), status.get("observedGeneration")
    if not isinstance(generation, int) or not isinstance(observed, int) or observed < generation:
        return False
    replicas = spec.get("replicas", 1)
    available = status.get("availableReplicas", status.get("readyReplicas", 0))
    return bool(status.get("updatedReplicas", 0) >= replicas and available >= replicas)


# ---- container args -----------------------------------------------------------------------------------


def _flag_name(arg: str, aliases: Mapping[str, str] | None = None) -> str:
    """``--max_num_seqs=8`` -> ``--max-num-seqs``: vLLM's, SGLang's and llama.cpp's parsers take underscores for
    dashes; a short name in ``aliases`` (``-np``) -> its long one."""
    name = arg.partition("=")[0]
    name = "--" + name[2:].replace("_", "-") if name.startswith("--") else name
    return aliases.get(name, name) if aliases else name


def read_flags(args: Sequence[str], flags: Sequence[str], aliases: Mapping[str, str] | None = None) -> dict[str, int]:
    """The integer value of each of ``flags`` in ``args`` (``--flag N`` or ``--flag=N``; the last one wins,
    as with argparse), by its long name. A flag whose value is not an integer raises ValueError naming it."""
    found: dict[str, int] = {}
    for index, arg in enumerate(args):
        name = _flag_name(arg, aliases)
        if name not in flags:
            continue
        if "=" in arg:
            text = arg.partition("=")[2]
        elif index + 1 < len(args):
            text = args[index + 1]
        else:
            raise ValueError(f"{name} has no value in the container's args")
        try:
            found[name] = int(text)
        except ValueError:
            raise ValueError(f"{name} {text!r} in the container's args is not an integer") from None
    return found


def rewrite_args(
    args: Sequence[str], settings: Mapping[str, int], aliases: Mapping[str, str] | None = None
) -> list[str]:
    """``args`` with each flag of ``settings`` set to its value: in place and in its own form (``--flag N`` or
    ``--flag=N``, a short name of ``aliases`` kept) where present, any repeat of it dropped, appended as
    ``--flag N`` where absent. Every other arg stays as it was, in order."""
    out: list[str] = []
    done: set[str] = set()
    index = 0
    while index < len(args):
        arg = args[index]
        name = _flag_name(arg, aliases)
        if name not in settings:
            out.append(arg)
            index += 1
            continue
        spelled = arg.partition("=")[0]
        step = 1 if "=" in arg else 2
        if name not in done:
            out.extend([f"{spelled}={settings[name]}"] if step == 1 else [spelled, str(settings[name])])
            done.add(name)
        index += step
    for name, value in settings.items():
        if name not in done:
            out.extend([name, str(value)])
    return out


def llamacpp_rewrite_args(args: Sequence[str], wanted: Mapping[str, int]) -> list[str]:
    """llama-server's ``args`` carrying ``wanted`` (``--parallel``, ``--batch-size``), each slot keeping its context.

    - ``--parallel N``: without a unified KV cache llama-server splits ``--ctx-size`` evenly across its slots,
      so ``--ctx-size`` becomes (context per slot now) x N. With ``--kv-unified`` every slot may use the whole
      pool and ``--ctx-size`` stays. Args without ``--parallel`` (or ``-1``) run "auto": 4 slots over a unified
      cache, which an explicit ``--parallel`` turns off, so ``--kv-unified`` is added to keep it.
    - ``--batch-size B``: ``--ubatch-size`` (512 unless set) is lowered to B where it is larger, since one
      ubatch cannot exceed the batch.

    ValueError when the slots' context cannot be kept: a split cache whose ``--ctx-size`` is unset or 0 (the
    model's own length, which the args do not say).
    """
    flags = ("--parallel", "--ctx-size", "--ubatch-size")
    running = read_flags(args, flags, LLAMACPP_ALIASES)
    settings = dict(wanted)
    auto = running.get("--parallel", -1) < 0
    kv_flags = [n for a in args if (n := _flag_name(a, LLAMACPP_ALIASES)) in ("--kv-unified", "--no-kv-unified")]
    unified = kv_flags[-1] == "--kv-unified" if kv_flags else auto  # the last one wins, as in its parser
    keep_unified = auto and not kv_flags and "--parallel" in wanted
    if "--parallel" in wanted and not unified:
        ctx = running.get("--ctx-size", 0)
        if ctx <= 0:
            raise ValueError(
                "--ctx-size is unset or 0 (the model's own length) with a KV cache split across --parallel slots: "
                "set --ctx-size in the args (or --kv-unified) so that each slot's context can be kept"
            )
        slots = running.get("--parallel", LLAMACPP_AUTO_SLOTS)
        settings["--ctx-size"] = ctx // slots * wanted["--parallel"]
    if "--batch-size" in wanted:
        ubatch = running.get("--ubatch-size", LLAMACPP_DEFAULT_UBATCH)
        if ubatch > wanted["--batch-size"] or "--ubatch-size" in running:
            settings["--ubatch-size"] = min(ubatch, wanted["--batch-size"])
    out = rewrite_args(args, settings, LLAMACPP_ALIASES)
    return [*out, "--kv-unified"] if keep_unified else out
