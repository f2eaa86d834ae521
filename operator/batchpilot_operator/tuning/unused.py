"""Settings of a valid BatchProfile that the tuning policy will never use, as warnings.

A profile can be valid and still ask for something the policy never does: a wait above the
share of the latency SLO the policy allows itself, a cap above the ceiling of the declared
batch-friendliness, bounds in static mode. ``validate`` prints these as warnings (exit 0)
so that a user does not wait for a retune that cannot come. Each rule reads the same
constant the policy does, so the warning and the behaviour cannot drift apart. Pure, no I/O.
"""

from __future__ import annotations

from batchpilot_operator.api.profile import BatchProfileSpec, Friendliness, TuningMode
from batchpilot_operator.tuning.config import DEFAULT_CONFIG, PolicyConfig
from batchpilot_operator.tuning.friendliness import CLASS_CAP_CEILING


def unused_settings(spec: BatchProfileSpec, config: PolicyConfig = DEFAULT_CONFIG) -> list[str]:
    """One sentence per setting the policy will never use, naming the field (empty when none)."""
    if spec.mode == TuningMode.STATIC:
        return _static_bounds(spec)
    return [*_wait_over_slo_share(spec, config), *_cap_over_class_ceiling(spec), *_sizes_and_budget(spec)]


def _given(spec: BatchProfileSpec, field: str, end: str) -> bool:
    """Whether ``tuning.bounds.<field>.<end>`` was written in the profile (not a default)."""
    bounds = spec.tuning.bounds
    if field not in bounds.model_fields_set:
        return False
    return end in getattr(bounds, field).model_fields_set


def _static_bounds(spec: BatchProfileSpec) -> list[str]:
    if "bounds" not in spec.tuning.model_fields_set:
        return []
    return ["tuning.bounds is never used in static mode: the operator pushes spec.window as it is"]


def _wait_over_slo_share(spec: BatchProfileSpec, config: PolicyConfig) -> list[str]:
    """The policy keeps the wait at or under ``wait_slo_fraction`` of ``slo.p99Ms`` (see ``fill_wait``)."""
    if spec.slo.p99_ms is None:
        return []
    most_ms = config.wait_slo_fraction * spec.slo.p99_ms
    share = f"{config.wait_slo_fraction:g} x slo.p99Ms = {most_ms:g} ms"
    wait_bounds = spec.tuning.bounds.max_wait_ms
    # Past the lower bound the policy's share does not apply: the bound wins.
    highest_ms = max(most_ms, wait_bounds.min)
    warnings = []
    if spec.window.max_wait_ms > highest_ms:
        warnings.append(
            f"window.maxWaitMs ({spec.window.max_wait_ms}) is above what the policy ever chooses ({share}): "
            "it holds only until a retune lowers it"
        )
    if _given(spec, "max_wait_ms", "max") and wait_bounds.max > highest_ms:
        warnings.append(
            f"tuning.bounds.maxWaitMs.max ({wait_bounds.max}) is above what the policy ever chooses ({share})"
        )
    return warnings


def _cap_over_class_ceiling(spec: BatchProfileSpec) -> list[str]:
    """A declared (not measured) friendliness class caps hardCap at its ceiling (see ``cap_ceiling``)."""
    friendliness = spec.batch_friendliness
    if friendliness == Friendliness.AUTO:
        return []
    ceiling = CLASS_CAP_CEILING[friendliness]
    cap_bounds = spec.tuning.bounds.hard_cap
    if not _given(spec, "hard_cap", "max") or cap_bounds.max <= max(ceiling, cap_bounds.min):
        return []
    return [
        f"tuning.bounds.hardCap.max ({cap_bounds.max}) is above {ceiling}, the most the policy raises the cap "
        f"to for batchFriendliness {friendliness.value}"
    ]


def _sizes_and_budget(spec: BatchProfileSpec) -> list[str]:
    bounds = spec.tuning.bounds
    warnings = []
    if _given(spec, "target_batch_size", "max") and bounds.target_batch_size.max > bounds.hard_cap.max:
        warnings.append(
            f"tuning.bounds.targetBatchSize.max ({bounds.target_batch_size.max}) is above "
            f"tuning.bounds.hardCap.max ({bounds.hard_cap.max}): the target never exceeds the cap"
        )
    if spec.slo.inter_token_p99_ms is None and "max_prefill_tokens" in bounds.model_fields_set:
        warnings.append(
            "tuning.bounds.maxPrefillTokens is never used without slo.interTokenP99Ms: "
            "the policy moves the prefill budget only for an inter-token objective"
        )
    return warnings
