"""Controllers the simulator can run in closed loop: the policy and the baselines it is judged against."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.tuning.observations import Observations, known
from batchpilot_operator.tuning.policy import DEFAULT_CONFIG, Decision, PolicyConfig, PolicyState, decide, slo_over
from batchpilot_runtime.contract.window import Window

LARGE_FIXED_WINDOW = Window(target_batch_size=256, hard_cap=256, max_wait_ms=200, tail_mark_ratio=2.0)


@dataclass
class StaticController:
    """Never changes the window (the operator's static mode, and every grid-search candidate)."""

    name: str = "static"

    def on_interval(self, now_s: float, observations: Observations, window: Window) -> Window | None:
        return None


@dataclass
class AdaptiveController:
    """The tuning policy (:func:`batchpilot_operator.tuning.policy.decide`), as the operator runs it."""

    spec: BatchProfileSpec
    config: PolicyConfig = DEFAULT_CONFIG
    state: PolicyState = field(default_factory=PolicyState)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)
    name: str = "adaptive"

    def on_interval(self, now_s: float, observations: Observations, window: Window) -> Window | None:
        decision = decide(self.spec, window, observations, self.state, now_s, self.config)
        self.state = decision.state
        if decision.changed:
            self.decisions.append((now_s, decision))
            return decision.window
        return None


@dataclass
class AimdController:
    """Additive-increase/multiplicative-decrease of the batch size on SLO misses.

    The classic adaptive-batching baseline (Clipper, Crankshaw et al., NSDI 2017: "additively
    increase the batch size by a fixed amount until the latency exceeds the objective, then
    multiplicatively reduce it"): the batch size sets target and cap together; the wait stays
    the spec's. Same guards as the policy against acting on no data, so the baseline is not
    handicapped by reacting to noise; no cooldown beyond one interval.
    """

    spec: BatchProfileSpec
    additive: int = 4
    backoff: float = 0.9
    min_samples: int = 20
    name: str = "aimd"

    def on_interval(self, now_s: float, observations: Observations, window: Window) -> Window | None:
        obs = observations
        if not known(obs.samples) or obs.samples < self.min_samples:
            return None
        over = slo_over(self.spec, obs)
        if over is None:
            return None
        bounds = self.spec.tuning.bounds
        batch = window.hard_cap
        batch = math.floor(batch * self.backoff) if over else batch + self.additive
        lo = max(bounds.hard_cap.min, bounds.target_batch_size.min)
        hi = min(bounds.hard_cap.max, bounds.target_batch_size.max)
        batch = max(lo, min(hi, batch))
        if batch == window.hard_cap and batch == window.target_batch_size:
            return None
        return window.model_copy(update={"target_batch_size": batch, "hard_cap": batch})
