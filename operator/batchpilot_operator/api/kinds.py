"""The enumerations a BatchProfile's fields take, and the tuning mode each engine defaults to.

Part of the BatchProfile models (``batchpilot_operator.api.profile`` re-exports them).
"""

from __future__ import annotations

from enum import StrEnum


class Friendliness(StrEnum):
    """How much a model gains from larger batches."""

    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"
    AUTO = "auto"


# How far each class lets the cap go (the bounds still apply on top).
CLASS_CAP_CEILING: dict[Friendliness, int] = {
    Friendliness.HIGH: 4096,
    Friendliness.MEDIUM: 128,
    Friendliness.LOW: 32,
}


class LatencyMetric(StrEnum):
    TTFT = "ttft"
    QUEUE_WAIT = "queueWait"
    E2E = "e2e"


class TuningMode(StrEnum):
    ADAPTIVE = "adaptive"
    RECOMMEND = "recommend"
    STATIC = "static"
    RESTART = "restart"  # restart-only engines: patch the workload's args within spec.restart's budget


# Modes whose window in force is not the policy's: it only recommends (and in restart mode, the restart
# path applies the recommendation when the budget allows).
RECOMMENDING = (TuningMode.RECOMMEND, TuningMode.RESTART)


class EngineKind(StrEnum):
    """The serving engine of a profile's pods: whose metric names the operator reads, and how a window
    reaches the engine (live through an admin API, or only by a restart with new flags)."""

    BATCHPILOT = "batchpilot"
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"  # llama.cpp's llama-server behind batchpilot-gate


# Engines a profile only recommends for unless it asks for more: vLLM, whose knobs need a restart, and
# llama-server, whose --parallel and --batch-size need one too (its cap and wait can still move live
# through the gate in front of it, in tuning.mode adaptive or static).
RECOMMEND_BY_DEFAULT_ENGINES = frozenset({EngineKind.VLLM, EngineKind.LLAMACPP})


def default_mode(engine: EngineKind) -> TuningMode:
    """The mode of a profile that names none: recommend where applying a window costs a restart."""
    return TuningMode.RECOMMEND if engine in RECOMMEND_BY_DEFAULT_ENGINES else TuningMode.ADAPTIVE
