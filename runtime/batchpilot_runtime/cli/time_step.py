"""``batchpilot-runtime time-step``: how long one prefill step takes on this host right now.

It builds the engine as ``serve`` does (``Engine.build`` on a preset), starts ``--decodes``
requests decoding, then times ``--repeats`` steps that each prefill one prompt of
``--prompt-tokens`` tokens beside those decodes, and prints the median seconds as JSON
(``{"median_step_s": ...}``). The operator's demo runs it, as many at once as it will run
runtimes, to size its prompts to the host without loading torch itself (``demo/sizing.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from batchpilot_runtime.cli.args import positive_int

# Enough KV for the decodes and one prompt at a time of the default's length, several times over.
KV_CACHE_TOKENS = 16384
DECODE_PROMPT_TOKENS = 16


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "time-step",
        help="time a prefill step beside decodes on this host (median seconds, as JSON)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default: 1)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=1024, help="the timed prompt's length")
    parser.add_argument("--decodes", type=positive_int, default=16, help="requests decoding beside it")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed steps; the median is printed")
    parser.set_defaults(handler=_run)


def median_prefill_step_s(*, preset: str, threads: int, prompt_tokens: int, decodes: int, repeats: int) -> float:
    """Median seconds of ``repeats`` steps that each prefill a ``prompt_tokens`` prompt beside
    ``decodes`` decoding requests, on one torch pool of ``threads`` threads."""
    import torch

    from batchpilot_runtime.contract.window import Window
    from batchpilot_runtime.engine.engine import Engine
    from batchpilot_runtime.engine.types import GenerationRequest

    torch.set_num_threads(threads)
    window = Window(
        target_batch_size=1,
        hard_cap=decodes + 1,
        max_wait_ms=0,
        tail_mark_ratio=2.0,
        max_prefill_tokens=prompt_tokens,
    )
    engine = Engine.build(model_name="sizing", window=window, preset=preset, kv_cache_tokens=KV_CACHE_TOKENS)
    for i in range(decodes):
        prompt = [1 + i] * DECODE_PROMPT_TOKENS
        engine.add_request(GenerationRequest(f"decode-{i}", prompt, max_tokens=10 * repeats + 10))
    for _ in range(3):  # prefill the decodes and warm the kernels up
        engine.step()
    times = []
    for n in range(repeats):
        engine.add_request(GenerationRequest(f"prompt-{n}", [2] * prompt_tokens, max_tokens=1))
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
        engine.step()
    return statistics.median(times)


def _run(args: argparse.Namespace) -> int:
    step_s = median_prefill_step_s(
        preset=args.preset,
        threads=args.threads,
        prompt_tokens=args.prompt_tokens,
        decodes=args.decodes,
        repeats=args.repeats,
    )
    sys.stdout.write(json.dumps({"median_step_s": step_s}) + "\n")
    return 0
