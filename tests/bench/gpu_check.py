"""One prepared device check: bf16 against an fp32 reference, then decode tokens/s by batch size.

On CUDA (the real check):   python tests/bench/gpu_check.py --out gpu_check.json
On a CPU it runs a reduced form (tiny preset, few batch sizes) to prove the script works:
                            python tests/bench/gpu_check.py --out /tmp/gpu_check.json --quick

Correctness: the same random weights in fp32 and in the run dtype; prefill logits compared,
teacher-forced top-1 agreement over a greedy continuation, and whether batched greedy decoding
gives the solo tokens in each mode. Throughput: decode steps over a paged cache at each batch
size, timed with device synchronisation; tokens/s = batch * steps / seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchpilot_runtime.model.batch import ForwardBatch
from batchpilot_runtime.model.config import config_from_name, describe
from batchpilot_runtime.model.device import pick_device
from batchpilot_runtime.model.kv_cache import PagedKVCache
from batchpilot_runtime.model.model import LlamaModel

BLOCK = 16


@dataclass(frozen=True)
class Seq:
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool = True


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tables_for(batch: int, tokens: int) -> list[tuple[int, ...]]:
    per_seq = -(-tokens // BLOCK)
    return [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]


def greedy(model: LlamaModel, prompts: list[list[int]], steps: int, device: torch.device) -> list[list[int]]:
    """Greedy decode of all prompts together (prefill in one step, then one token per step)."""
    tables = tables_for(len(prompts), max(map(len, prompts)) + steps)
    kv = PagedKVCache(model.config, len(prompts) * len(tables[0]), BLOCK, device, model.dtype)
    seqs = [Seq(tuple(p), 0, tables[i]) for i, p in enumerate(prompts)]
    positions = [len(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        logits = model(ForwardBatch.build(seqs, BLOCK, device), kv)
        tokens = logits.argmax(-1).tolist()
        for i, token in enumerate(tokens):
            out[i].append(token)
        seqs = [Seq((tokens[i],), positions[i], tables[i]) for i in range(len(prompts))]
        positions = [p + 1 for p in positions]
    return out


def correctness(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    config = config_from_name(args.preset)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(16, 96))] for _ in range(args.num_prompts)]
    reference = LlamaModel.random(config, seed=args.seed, device=device, dtype=torch.float32, batch_invariant=True)
    fp32_tokens = [greedy(reference, [p], args.greedy_steps, device)[0] for p in prompts]
    result: dict[str, Any] = {"dtype": str(dtype), "num_prompts": len(prompts), "greedy_steps": args.greedy_steps}
    max_abs, max_rel, agree, total = 0.0, 0.0, 0, 0
    for invariant in (False, True):
        model = LlamaModel.random(config, seed=args.seed, device=device, dtype=dtype, batch_invariant=invariant)
        if not invariant:
            for prompt, continuation in zip(prompts, fp32_tokens, strict=True):
                full = torch.tensor(prompt + continuation, device=device)
                ref_logits = reference.forward_dense(full)
                run_logits = model.forward_dense(full)
                diff = (run_logits - ref_logits).abs()
                max_abs = max(max_abs, float(diff.max()))
                max_rel = max(max_rel, float(diff.max() / ref_logits.abs().max()))
                # teacher-forced: does the run dtype pick the fp32 token at each generated position?
                span = slice(len(prompt) - 1, len(prompt) - 1 + len(continuation))
                agree += int((run_logits[span].argmax(-1) == ref_logits[span].argmax(-1)).sum())
                total += len(continuation)
        alone = [greedy(model, [p], args.greedy_steps, device)[0] for p in prompts]
        together = greedy(model, prompts, args.greedy_steps, device)
        same = sum(a == b for a, b in zip(alone, together, strict=True))
        result[f"batched_equals_alone_invariant_{invariant}"] = f"{same}/{len(prompts)} requests"
        if invariant or dtype == torch.float32:
            matches = sum(a == b for a, b in zip(alone, fp32_tokens, strict=True))
            result[f"greedy_equals_fp32_invariant_{invariant}"] = f"{matches}/{len(prompts)} requests"
    result["logits_max_abs_diff_vs_fp32"] = max_abs
    result["logits_max_rel_diff_vs_fp32"] = max_rel
    result["teacher_forced_top1_agreement"] = agree / max(total, 1)
    return result


def throughput(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, invariant: bool) -> list[Any]:
    config = config_from_name(args.preset)
    model = LlamaModel.random(config, seed=args.seed, device=device, dtype=dtype, batch_invariant=invariant)
    rows = []
    for batch in args.batch_sizes:
        tables = tables_for(batch, args.context + args.decode_steps + 1)
        kv = PagedKVCache(config, batch * len(tables[0]), BLOCK, device, dtype)
        rng = random.Random(batch)
        # prefill in chunks of up to prefill_chunk tokens per step, as the engine would
        per_step = max(1, args.prefill_chunk // args.context)
        for first in range(0, batch, per_step):
            members = range(first, min(batch, first + per_step))
            prompt_seqs = [Seq(tuple(rng.randrange(256) for _ in range(args.context)), 0, tables[i]) for i in members]
            model(ForwardBatch.build(prompt_seqs, BLOCK, device), kv)
        seqs = [Seq((1,), args.context, tables[i]) for i in range(batch)]
        timings = []
        for step in range(args.decode_steps + args.warmup_steps):
            sync(device)
            started = time.perf_counter()
            built = ForwardBatch.build(seqs, BLOCK, device)
            logits = model(built, kv)
            tokens = logits.argmax(-1).tolist()  # the engine syncs here too
            elapsed = time.perf_counter() - started
            if step >= args.warmup_steps:
                timings.append(elapsed)
            seqs = [Seq((tokens[i],), s.start_pos + 1, s.block_table) for i, s in enumerate(seqs)]
        step_s = sorted(timings)[len(timings) // 2]
        row = {
            "batch_size": batch,
            "context_tokens": args.context,
            "step_ms_median": step_s * 1e3,
            "tokens_per_s": batch / step_s,
            "batch_invariant": invariant,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del kv
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--preset", default=None, help="model preset (default: small on CUDA, tiny with --quick)")
    parser.add_argument("--quick", action="store_true", help="reduced run (CPU smoke test)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch-sizes", default=None, help="comma list (default 1,2,4,...,256)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per sequence before decoding")
    parser.add_argument("--decode-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device, dtype = pick_device(args.device, args.dtype)
    quick = args.quick or device.type != "cuda"
    args.preset = args.preset or ("tiny" if quick else "small")
    default_sizes = "1,4" if quick else "1,2,4,8,16,32,64,128,256"
    args.batch_sizes = [int(b) for b in (args.batch_sizes or default_sizes).split(",")]
    args.context = args.context or (32 if quick else 256)
    args.decode_steps = args.decode_steps or (4 if quick else 32)
    args.warmup_steps = 1 if quick else 3
    args.prefill_chunk = 512 if quick else 8192
    args.num_prompts = 3 if quick else 16
    args.greedy_steps = 6 if quick else 48
    if device.type == "cpu":
        torch.set_num_threads(1)

    started = time.time()
    print(f"device={device} dtype={dtype} preset={args.preset}", flush=True)
    with torch.no_grad():
        check = correctness(args, device, dtype)
        print(json.dumps(check, indent=2), flush=True)
        decode = throughput(args, device, dtype, invariant=False)  # the default kernels, on every device
        invariant_decode = throughput(args, device, dtype, invariant=True)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "preset": args.preset,
        "model": describe(config_from_name(args.preset)),
        "quick": quick,
        "correctness": check,
        "decode": decode,
        "decode_batch_invariant": invariant_decode,
        "wall_s": time.time() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
