"""The policy fed 200 intervals of P99 (and inter-token P99) noise around its targets.

Open loop on purpose: the noise does not depend on the window, so every move the policy makes is
a reaction to noise, and what is left to check is that the reactions stay few and do not flap.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from batchpilot_operator.api.profile import BatchProfileSpec
from batchpilot_operator.tuning.observations import NAN
from batchpilot_operator.tuning.policy import PolicyState, decide
from batchpilot_runtime.contract.window import Window
from tests.support.factories import make_observations, make_policy_spec

INTERVALS = 200
INTERVAL_S = 15
COOLDOWN_S = 30
FLAP_INTERVALS = 10  # two reversals of one field this close together are a flap


def _spec(with_gaps: bool) -> BatchProfileSpec:
    return make_policy_spec(
        window={"hardCap": 32, "maxPrefillTokens": 2048},
        slo={"interTokenP99Ms": 100} if with_gaps else {},
        tuning={"intervalSeconds": INTERVAL_S, "cooldownSeconds": COOLDOWN_S},
    )


def _run(
    median: float, sigma: float, seed: int, with_gaps: bool, tokens_per_s: float
) -> tuple[int, list[tuple[int, int, int, int]]]:
    spec = _spec(with_gaps)
    window = Window.from_fields(spec.window, generation=1)
    state = PolicyState()
    rng = random.Random(seed)
    windows = [(window.target_batch_size, window.hard_cap, window.max_wait_ms, window.max_prefill_tokens or 0)]
    decisions = 0
    for i in range(INTERVALS):
        p99_s = median * math.exp(rng.gauss(0.0, sigma))
        obs = make_observations(
            p99_s,
            queue_depth=float(rng.choice([0, 1, 2, 3])),
            arrival_rate_per_s=20.0 + rng.gauss(0.0, 2.0),
            tokens_per_s=tokens_per_s,
            mean_batch_size=8.0 + rng.gauss(0.0, 1.0),
            itl_p99_s=0.1 * math.exp(rng.gauss(0.0, sigma)) if with_gaps else NAN,
            step_s_by_batch={8: 0.02, 16: 0.03},
        )
        decision = decide(spec, window, obs, state, float(i * INTERVAL_S))
        state, window = decision.state, decision.window
        decisions += decision.changed
        windows.append((window.target_batch_size, window.hard_cap, window.max_wait_ms, window.max_prefill_tokens or 0))
    return decisions, windows


def _flaps(values: list[int]) -> int:
    moves = [(i, b > a) for i, (a, b) in enumerate(itertools.pairwise(values)) if b != a]
    reversals = [moves[j][0] for j in range(1, len(moves)) if moves[j][1] != moves[j - 1][1]]
    return sum(1 for a, b in itertools.pairwise(reversals) if b - a <= FLAP_INTERVALS)


@pytest.mark.parametrize("median", [0.9, 1.0, 1.1])
@pytest.mark.parametrize("sigma", [0.1, 0.3])
@pytest.mark.parametrize("with_gaps", [False, True], ids=["ttft", "ttft+gaps"])
@pytest.mark.parametrize("tokens_per_s", [40.0, 200.0], ids=["idle-engine", "busy-engine"])
def test_noise_around_the_slo_gives_few_decisions_and_no_flapping_field(
    median: float, sigma: float, with_gaps: bool, tokens_per_s: float
) -> None:
    for seed in range(3):
        decisions, windows = _run(median, sigma, seed, with_gaps, tokens_per_s)
        assert decisions <= INTERVALS * INTERVAL_S // COOLDOWN_S
        assert decisions / (INTERVALS * INTERVAL_S / 3600) <= 60  # the steady-load bound
        for index, name in enumerate(("targetBatchSize", "hardCap", "maxWaitMs", "maxPrefillTokens")):
            assert _flaps([w[index] for w in windows]) == 0, (name, seed, [w[index] for w in windows])
