"""The canary rule: which pods try a new window, whether they did as well as the others, and when it ends.

Pure and clock-injected, like the policy. The loop that pushes and reads the pods is
:mod:`batchpilot_operator.control.canary`.

The rule, per SLO objective (the P99 of ``slo.latencyMetric`` under ``p99Ms``, the inter-token P99 under
``interTokenP99Ms``), on the worst pod of each group (a pod with fewer than ``min_samples`` requests in
the rate window is left out: its P99 is noise):

- the canary pods break the objective and the baseline pods meet it (or there are none): **fail**;
- both break it and the canary is worse than the baseline by more than :data:`MARGIN`: **fail**;
- otherwise the objective passes. No canary figure for an objective is **no data**, which is not a pass.

A fail rolls the canary back at once. A pass counts only once the metrics' rate window lies wholly after
the canary started (earlier figures mix the old window into the canary's); ``intervals`` counted passes
promote it. ``intervals`` evaluations in a row without data roll it back.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from batchpilot_operator.api.profile import SLO
from batchpilot_operator.tuning.observations import Observations
from batchpilot_runtime.contract.window import Window

# The runtime's latency buckets grow by a factor 1.2 (contract.metric_names.LATENCY_BUCKETS_S): a P99
# interpolated inside one bucket is only known to within that factor, so two groups closer than one
# bucket are not told apart. Both over the SLO and the canary more than one bucket worse: it made it worse.
MARGIN = 1.2
MIN_SAMPLES = 20  # as the policy (tuning.config.PolicyConfig.min_samples): fewer requests, no P99

Outcome = Literal["pass", "fail", "noData"]
State = Literal["running", "promoted", "rolledBack"]


@dataclass(frozen=True)
class Verdict:
    """One interval's comparison of the canary pods with the baseline pods."""

    outcome: Outcome
    reason: str


@dataclass(frozen=True)
class CanaryRun:
    """A canary in progress: ``window`` on ``pods`` (pod keys), ``previous`` on the others."""

    window: Window
    previous: Window
    pods: tuple[str, ...]
    started_s: float
    passes: int = 0  # counted passes (rate window after the start)
    dry: int = 0  # evaluations in a row without the canary pods' data


def canary_count(ready: int, share: float) -> int:
    """How many of ``ready`` pods run a new window first: ``share`` of them rounded down, at least one,
    and never all of them when there are two or more."""
    if ready <= 0:
        return 0
    wanted = max(1, math.floor(share * ready + 1e-9))
    return wanted if ready == 1 else min(wanted, ready - 1)


def choose_pods(profile_key: str, pod_keys: Sequence[str], share: float) -> tuple[str, ...]:
    """The canary pods: the first :func:`canary_count` of ``pod_keys`` ordered by a hash of the profile and
    the pod, so the same pods are chosen for the same profile every time (and differ between profiles, so
    one pod is not every profile's canary)."""

    def rank(pod: str) -> str:
        return hashlib.sha256(f"{profile_key}\x00{pod}".encode()).hexdigest()

    ordered = sorted(set(pod_keys), key=lambda pod: (rank(pod), pod))
    return tuple(sorted(ordered[: canary_count(len(ordered), share)]))


Reader = Callable[[Observations], tuple[float, bool]]


def _objectives(slo: SLO) -> list[tuple[str, float, Reader]]:
    """(name, target in ms, the pod's P99 in seconds and whether it is over the top bucket) per objective."""
    objectives: list[tuple[str, float, Reader]] = []
    if slo.p99_ms is not None:
        objectives.append((f"{slo.latency_metric.value} P99", slo.p99_ms, lambda o: (o.p99_s, o.p99_saturated)))
    if slo.inter_token_p99_ms is not None:
        objectives.append(("inter-token P99", slo.inter_token_p99_ms, lambda o: (o.itl_p99_s, o.itl_p99_saturated)))
    return objectives


def worst_ms(pods: Mapping[str, Observations], read: Reader, min_samples: float = MIN_SAMPLES) -> float | None:
    """The highest P99 in ms among the pods with enough samples (inf: over the top bucket), None without any."""
    values: list[float] = []
    for obs in pods.values():
        if not math.isfinite(obs.samples) or obs.samples < min_samples:
            continue
        value_s, saturated = read(obs)
        if saturated:
            values.append(math.inf)
        elif math.isfinite(value_s):
            values.append(value_s * 1000.0)
    return max(values, default=None)


def _ms(value: float) -> str:
    return "over the top bucket" if math.isinf(value) else f"{value:.0f} ms"


def judge(
    slo: SLO,
    canary: Mapping[str, Observations],
    baseline: Mapping[str, Observations],
    *,
    min_samples: float = MIN_SAMPLES,
    margin: float = MARGIN,
) -> Verdict:
    """Compare the canary pods with the baseline pods on every objective of ``slo`` (see the module)."""
    failures: list[str] = []
    passes: list[str] = []
    missing: list[str] = []
    for name, target_ms, read in _objectives(slo):
        worst_canary = worst_ms(canary, read, min_samples)
        if worst_canary is None:
            missing.append(name)
            continue
        worst_baseline = worst_ms(baseline, read, min_samples)
        if worst_canary <= target_ms:
            passes.append(f"{name} {_ms(worst_canary)} within {target_ms:g} ms")
        elif worst_baseline is None:
            failures.append(
                f"canary {name} {_ms(worst_canary)} breaks the SLO's {target_ms:g} ms (no other pod's figure)"
            )
        elif worst_baseline <= target_ms:
            failures.append(
                f"canary {name} {_ms(worst_canary)} breaks the SLO's {target_ms:g} ms, "
                f"which the other pods meet ({_ms(worst_baseline)})"
            )
        elif worst_canary > worst_baseline * margin:
            failures.append(
                f"canary {name} {_ms(worst_canary)} is more than {margin:g}x the other pods' "
                f"{_ms(worst_baseline)}, both over the SLO's {target_ms:g} ms"
            )
        else:
            passes.append(
                f"{name} {_ms(worst_canary)} within {margin:g}x the other pods' {_ms(worst_baseline)} "
                f"(both over {target_ms:g} ms)"
            )
    if failures:
        return Verdict("fail", "; ".join(failures))
    if missing:
        return Verdict(
            "noData", f"no canary figure for {', '.join(missing)} (no canary pod with {min_samples:g} requests)"
        )
    return Verdict("pass", "; ".join(passes))


@dataclass(frozen=True)
class Step:
    """What one evaluation made of a run: the run as it goes on, and the state and reason to report."""

    run: CanaryRun
    state: State
    reason: str


def advance(run: CanaryRun, verdict: Verdict, *, intervals: int, now_s: float, rate_window_s: float) -> Step:
    """The run after one interval's ``verdict``: a fail rolls back; a pass counts once the rate window
    (``rate_window_s``, ending now) lies after the start, and ``intervals`` of them promote; ``intervals``
    evaluations in a row without data roll back."""
    if verdict.outcome == "fail":
        return Step(run, "rolledBack", verdict.reason)
    if verdict.outcome == "noData":
        dry = replace(run, dry=run.dry + 1)
        if dry.dry >= intervals:
            return Step(dry, "rolledBack", f"{verdict.reason}, {dry.dry} intervals in a row: no data is not a pass")
        return Step(dry, "running", verdict.reason)
    if now_s - run.started_s < rate_window_s:
        return Step(
            replace(run, dry=0),
            "running",
            f"{verdict.reason}; not counted: the {rate_window_s:g} s rate window still reaches before the start",
        )
    counted = replace(run, passes=run.passes + 1, dry=0)
    if counted.passes >= intervals:
        return Step(counted, "promoted", f"passed {counted.passes} intervals: {verdict.reason}")
    return Step(counted, "running", f"passed {counted.passes} of {intervals} intervals: {verdict.reason}")
