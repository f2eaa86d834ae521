"""Factories shared by the tests: BatchProfile specs and manifests, runtime windows and lanes, and
the observations the policy reads, each with stated defaults.

A test passes only what its case is about; what it leaves out is the default written here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from batchpilot_operator import API_VERSION, KIND
from batchpilot_operator.api.profile import BatchProfileSpec, parse_spec
from batchpilot_operator.tuning.observations import NAN, Observations
from batchpilot_runtime.contract.admin_api import LaneWindow
from batchpilot_runtime.contract.window import Window


def make_spec_dict(model: str = "chat", **sections: Any) -> dict[str, Any]:
    """A BatchProfile spec as a manifest writes it (camelCase): ``model`` on pods labelled ``app=<model>``,
    window 8/16/40 ms, P99 500 ms, and no cooldown (the first tick may already change the window).

    Each keyword replaces the whole section it names (``tuning={...}`` drops ``cooldownSeconds: 0``);
    a section given as None is left out (``tuning=None``: the spec a user writes with no tuning at all)."""
    spec: dict[str, Any] = {
        "model": model,
        "selector": {"matchLabels": {"app": model}},
        "window": {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 40},
        "slo": {"p99Ms": 500},
        "tuning": {"cooldownSeconds": 0},
    }
    spec.update(sections)
    return {name: value for name, value in spec.items() if value is not None}


def make_spec(model: str = "chat", **sections: Any) -> BatchProfileSpec:
    """:func:`make_spec_dict`, validated into the type the operator's core takes."""
    return parse_spec(make_spec_dict(model, **sections))


def make_manifest(spec: Mapping[str, Any], *, name: str = "p", namespace: str | None = None) -> dict[str, Any]:
    """A BatchProfile object around ``spec``, named ``name``, with no namespace unless one is given."""
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": dict(spec)}


POLICY_SECTIONS: dict[str, Any] = {
    "batchFriendliness": "high",
    "window": {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 20},
    "slo": {"p99Ms": 1000},
    "tuning": {"intervalSeconds": 15, "cooldownSeconds": 30, "maxStepFraction": 0.5},
}


def make_policy_spec(**sections: Any) -> BatchProfileSpec:
    """The profile the policy's tests tune: batch-friendliness high, window 8/16/20 ms, P99 1 s,
    15 s intervals, a 30 s cooldown and steps of at most half a field.

    Unlike :func:`make_spec`, a section given as a mapping is merged into the default one
    (``window={"hardCap": 32}`` keeps target 8 and wait 20 ms); any other value replaces it."""
    merged = dict(POLICY_SECTIONS)
    for name, value in sections.items():
        default = merged.get(name)
        merged[name] = {**default, **value} if isinstance(default, dict) and isinstance(value, dict) else value
    return make_spec(**merged)


def make_observations(p99_s: float = 0.5, **others: Any) -> Observations:
    """An interval as the policy reads it: first-token P99 ``p99_s`` (P50 a third of it, P99.9 1.2x;
    NaN when it is), 500 samples, no queue, 20 arrivals/s, batches of 8, 30 % KV use, no preemptions
    and no tail marks; ``others`` sets any other field of :class:`Observations`."""
    fields: dict[str, Any] = {
        "p50_s": p99_s / 3 if math.isfinite(p99_s) else NAN,
        "p99_s": p99_s,
        "p999_s": p99_s * 1.2 if math.isfinite(p99_s) else NAN,
        "samples": 500.0,
        "queue_depth": 0.0,
        "arrival_rate_per_s": 20.0,
        "mean_batch_size": 8.0,
        "kv_usage_ratio": 0.3,
        "preemptions_per_s": 0.0,
        "tail_marked_share": 0.0,
    }
    fields.update(others)
    return Observations(**fields)


def make_window_dict(
    *,
    target: int = 8,
    cap: int = 16,
    wait_ms: int = 20,
    ratio: float = 2.0,
    generation: int = 0,
    prefill: int | None = None,
) -> dict[str, Any]:
    """A runtime window as the admin API carries it (camelCase), not validated, so that a test may
    send a bad one: target 8, hard cap 16, 20 ms wait, tail-mark ratio 2, generation 0, and a prefill
    budget only when ``prefill`` is given."""
    fields: dict[str, Any] = {
        "targetBatchSize": target,
        "hardCap": cap,
        "maxWaitMs": wait_ms,
        "tailMarkRatio": ratio,
        "generation": generation,
    }
    if prefill is not None:
        fields["maxPrefillTokens"] = prefill
    return fields


def make_window(**fields: Any) -> Window:
    """:func:`make_window_dict` (the same keywords and defaults), validated into a :class:`Window`."""
    return Window.model_validate(make_window_dict(**fields))


def make_lane(
    name: str = "critical", *, target: int = 1, cap: int = 2, wait_ms: int = 0, reserved: int = 1
) -> LaneWindow:
    """A lane ``name`` with window 1/2/0 ms and one reserved slot: a request in it is admitted at once."""
    return LaneWindow(name=name, window=make_window(target=target, cap=cap, wait_ms=wait_ms), reserved_slots=reserved)
