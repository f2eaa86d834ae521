"""Batch-friendliness: the curve, the knee and the class from step time per batch size."""

from __future__ import annotations

from batchpilot_operator.api.profile import Friendliness
from batchpilot_operator.tuning.friendliness import measure, merge_curve
from batchpilot_runtime.replay.cost_model import A100_LLAMA2_7B, StepComposition


def test_a_linear_gain_has_no_knee_and_is_high() -> None:
    # Step time flat: throughput doubles with every doubling of the batch.
    estimate = measure({1: 0.01, 2: 0.01, 4: 0.01, 8: 0.01})
    assert estimate.knee_batch_size is None
    assert estimate.measured_class == Friendliness.HIGH
    assert [b for b, _ in estimate.curve] == [1, 2, 4, 8]


def test_the_knee_is_where_throughput_stops_growing() -> None:
    estimate = measure({1: 0.01, 2: 0.01, 4: 0.01, 8: 0.01, 16: 0.02, 32: 0.04})
    assert estimate.knee_batch_size == 8
    status = estimate.to_status()
    assert status.knee_batch_size == 8
    assert status.curve[0].tokens_per_second == 100.0


def test_a_model_that_gains_nothing_is_low() -> None:
    estimate = measure({1: 0.01, 2: 0.02, 4: 0.04})
    assert estimate.measured_class == Friendliness.LOW
    assert estimate.knee_batch_size == 1


def test_too_few_points_say_nothing() -> None:
    estimate = measure({4: 0.01, 8: float("nan")})
    assert estimate.measured_class is None
    assert estimate.knee_batch_size is None


def test_the_published_gpu_profile_is_batch_friendly() -> None:
    # Decode steps at 1k context per sequence, as the runtime's step histogram would show them.
    steps = {b: A100_LLAMA2_7B.step_seconds(StepComposition(0, b, b * 1000)) for b in (1, 2, 4, 8, 16, 32, 64)}
    estimate = measure(steps)
    assert estimate.measured_class in (Friendliness.HIGH, Friendliness.MEDIUM)


def test_merge_curve_accumulates_and_smooths() -> None:
    curve = merge_curve((), {1: 0.01, 4: 0.02})
    curve = merge_curve(curve, {4: 0.03, 8: 0.05, 16: float("nan")}, weight=0.5)
    assert dict(curve) == {1: 0.01, 4: 0.025, 8: 0.05}
