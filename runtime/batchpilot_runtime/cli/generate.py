"""``batchpilot-runtime generate``: offline batch generation through the engine.

Every prompt is queued at once and the engine runs to completion under the given
window, so this is also the quickest way to see the batching at work on a machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchpilot_runtime.cli.args import dtype_name

if TYPE_CHECKING:
    from batchpilot_runtime.contract.window import Window
    from batchpilot_runtime.engine.engine import Engine


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "generate",
        help="generate completions for prompts offline (batched) and print them with tokens/s",
        description=(
            "Generate completions for prompts given as arguments or in a file (one per line), "
            "all queued at once and batched by the engine; prints each completion and the throughput."
        ),
    )
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    parser.add_argument("--prompts-file", type=Path, help="a file with one prompt per line (blank lines skipped)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="tiny", help="model preset with seeded random weights (default: tiny)")
    source.add_argument(
        "--checkpoint",
        help="a named model (smollm2-135m-instruct), a Llama GGUF file, or a Hugging Face Llama safetensors directory",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default: 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed, and the sampling seed of each prompt")
    parser.add_argument(
        "--stop-at-eos", action="store_true", help="stop a completion at the tokenizer's end tokens (EOS, end of turn)"
    )
    parser.add_argument("--kv-cache-tokens", type=int, help="KV-cache capacity in tokens (default: engine default)")
    parser.add_argument("--target-batch-size", type=int, default=32, help="window targetBatchSize (default: 32)")
    parser.add_argument("--hard-cap", type=int, default=64, help="window hardCap (default: 64)")
    parser.add_argument("--max-wait-ms", type=int, default=0, help="window maxWaitMs (default: 0)")
    parser.add_argument("--batching", choices=("continuous", "static"), default="continuous")
    parser.add_argument("--max-prefill-tokens", type=int, help="chunked-prefill budget per step (default: none)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument(
        "--dtype", type=dtype_name, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU)"
    )
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batch-invariant kernels: each completion bitwise as if its prompt ran alone, at a cost in speed "
        "(default: off, the fastest kernels; env BATCHPILOT_BATCH_INVARIANT=1 turns it on)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.set_defaults(handler=_cmd_generate)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file is not None:
        text = args.prompts_file.read_text(encoding="utf-8")
        prompts.extend(line for line in text.splitlines() if line.strip())
    if not prompts:
        raise ValueError("no prompts: give PROMPT arguments or --prompts-file")
    return prompts


def _build_engine(args: argparse.Namespace, prompt_count: int) -> tuple[Engine, Window]:
    """Checks the flags the parser cannot, sets torch's threads and builds the engine."""
    import torch
    from pydantic import ValidationError

    from batchpilot_runtime.contract.window import Window
    from batchpilot_runtime.engine.engine import Engine
    from batchpilot_runtime.model.sources import resolve_checkpoint

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        window = Window(target_batch_size=args.target_batch_size, hard_cap=args.hard_cap, max_wait_ms=args.max_wait_ms)
    except ValidationError as error:
        raise ValueError(f"invalid window: {error.errors()[0]['msg']}") from None
    engine = Engine.build(
        model_name=resolve_checkpoint(args.checkpoint).name if args.checkpoint else args.preset,
        preset=args.preset,
        checkpoint=args.checkpoint,
        kv_cache_tokens=args.kv_cache_tokens,
        window=window,
        batching=args.batching,
        max_queue=max(prompt_count, 1),
        max_prefill_tokens_per_step=args.max_prefill_tokens,
        seed=args.seed,
        dtype=args.dtype,
        batch_invariant=args.batch_invariant,
    )
    return engine, window


def _add_prompts(engine: Engine, args: argparse.Namespace, prompts: list[str]) -> tuple[dict[str, list[int]], int]:
    """Adds prompt ``i`` as request ``p{i}``; returns an empty token list per request and the prompt tokens."""
    from batchpilot_runtime.engine.types import GenerationRequest

    tokenizer: Any = engine.tokenizer
    stop_ids = tuple(tokenizer.stop_token_ids) if args.stop_at_eos else ()
    tokens: dict[str, list[int]] = {}
    prompt_tokens = 0
    for index, prompt in enumerate(prompts):
        request_id = f"p{index}"
        token_ids = list(tokenizer.encode(prompt))
        prompt_tokens += len(token_ids)
        engine.add_request(
            GenerationRequest(
                request_id=request_id,
                prompt_token_ids=token_ids,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed + index if args.temperature > 0 else None,
                stop_token_ids=stop_ids,
            )
        )
        tokens[request_id] = []
    return tokens, prompt_tokens


def _run_until_done(engine: Engine, tokens: dict[str, list[int]]) -> tuple[dict[str, str], float]:
    """Steps the engine until every request finished, appending output tokens to ``tokens``.

    Returns each request's finish reason and the seconds spent stepping.
    """
    finish: dict[str, str] = {}
    start_s = time.perf_counter()
    while engine.has_unfinished:
        for event in engine.step():
            if event.token_id is not None and event.finish_reason != "stop":
                tokens[event.request_id].append(event.token_id)
            if event.finish_reason is not None:
                finish[event.request_id] = event.finish_reason
    return finish, time.perf_counter() - start_s


def _cmd_generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    engine, window = _build_engine(args, len(prompts))
    tokenizer: Any = engine.tokenizer
    tokens, prompt_tokens = _add_prompts(engine, args, prompts)
    finish, elapsed_s = _run_until_done(engine, tokens)
    generated = sum(len(t) for t in tokens.values())
    tokens_per_s = generated / elapsed_s if elapsed_s > 0 else 0.0
    completions = [
        {
            "prompt": prompt,
            "completion": tokenizer.decode(tokens[f"p{i}"]),
            "tokens": len(tokens[f"p{i}"]),
            "finish_reason": finish.get(f"p{i}"),
        }
        for i, prompt in enumerate(prompts)
    ]
    summary = {
        "requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "seconds": round(elapsed_s, 4),
        "tokens_per_s": round(tokens_per_s, 2),
        "steps": engine.steps_run,
        "device": str(engine.device),
        "window": window.describe(),
        "batching": args.batching,
        "batch_invariant": engine.model.batch_invariant,
    }
    if args.json:
        json.dump({"completions": completions, "summary": summary}, sys.stdout, indent=2)
        print()
    else:
        for row in completions:
            print(f"--- {row['prompt']!r} ({row['tokens']} tokens, {row['finish_reason']})")
            print(row["completion"])
        print(
            f"{len(prompts)} prompts, {generated} tokens generated in {elapsed_s:.2f} s "
            f"({tokens_per_s:.1f} tokens/s, {engine.steps_run} steps, {engine.device}, {window.describe()})"
        )
    return 0
