"""A window in each engine's own settings. Pure: no I/O.

Only two window fields have a counterpart in vLLM, SGLang and llama-server (DESIGN.md, "What decides the
tail under continuous batching"): the cap on running sequences and the per-step prompt-token
budget. targetBatchSize, maxWaitMs and tailMarkRatio have none: an iteration-level engine admits
whatever fits at every step, so they hold only in front of it (batchpilot-gate).

- vLLM: ``--max-num-seqs`` and ``--max-num-batched-tokens`` (``vllm/engine/arg_utils.py``),
  start-up flags only.
- SGLang: ``max_running_requests`` and ``chunked_prefill_size`` (``python/sglang/srt/server_args.py``),
  the keys a ``POST /set_internal_state {"server_args": {...}}`` would name.
- llama.cpp's llama-server: ``--parallel`` (its slots) and ``--batch-size`` (tokens per ``llama_decode()``
  call, decodes and prompt chunks together) (``common/arg.cpp``), start-up flags only; restart_plan's
  :func:`~batchpilot_operator.control.restart_plan.llamacpp_rewrite_args` keeps each slot's context.
"""

from __future__ import annotations

from batchpilot_operator.api.kinds import EngineKind
from batchpilot_runtime.contract.window import Window


def vllm_args(window: Window) -> dict[str, int]:
    """The vLLM flags that carry ``window`` (the prefill budget only when the window sets one)."""
    args = {"--max-num-seqs": window.hard_cap}
    if window.max_prefill_tokens is not None:
        args["--max-num-batched-tokens"] = window.max_prefill_tokens
    return args


def sglang_server_args(window: Window) -> dict[str, int]:
    """The SGLang server arguments that carry ``window`` (the prefill budget only when the window sets one)."""
    args = {"max_running_requests": window.hard_cap}
    if window.max_prefill_tokens is not None:
        args["chunked_prefill_size"] = window.max_prefill_tokens
    return args


def llamacpp_flags(window: Window) -> dict[str, int]:
    """The llama-server flags that carry ``window`` (the prefill budget only when the window sets one)."""
    args = {"--parallel": window.hard_cap}
    if window.max_prefill_tokens is not None:
        args["--batch-size"] = window.max_prefill_tokens
    return args


def engine_settings(engine: str, window: Window) -> dict[str, int]:
    """``window`` as ``engine`` spells it; empty for batchpilot, which takes the window itself."""
    if engine == EngineKind.VLLM:
        return vllm_args(window)
    if engine == EngineKind.SGLANG:
        return sglang_server_args(window)
    if engine == EngineKind.LLAMACPP:
        return llamacpp_flags(window)
    return {}


def describe_settings(settings: dict[str, int]) -> str:
    """``--max-num-seqs 64 --max-num-batched-tokens 1024`` or ``max_running_requests=64 ...``, for a text line."""
    return " ".join(f"{k} {v}" if k.startswith("--") else f"{k}={v}" for k, v in settings.items())
