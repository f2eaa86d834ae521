"""bench_runtime's command line and report: its flags, each system's summary line and figures, the
JSON result with its targets, and the plot."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.model.config import describe
from batchpilot_runtime.model.kernels import BATCH_INVARIANT_ENV
from batchpilot_runtime.model.model import LlamaModel
from batchpilot_runtime.replay.trace import DEFAULT_TRACE_PATH, TraceScaling
from tests.bench.runtime_workload import Job, Outcome, ReplayClock

SYSTEMS = ("continuous", "static", "sequential", "hf_static")
# An outside reference, run only when asked: llama.cpp through llama-cpp-python (not a dependency:
# it builds llama.cpp from source), on the same GGUF file with its own quantized kernels.
REFERENCE_SYSTEMS = ("llama_cpp",)
# bench_runtime's docstring's first line, which --help shows.
DESCRIPTION = "Runtime benchmark: the Azure conversation trace replayed through four ways of serving it."


# -- the command line --------------------------------------------------------------------------


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """The requests: which slice of the trace, how it is scaled, the model that serves them."""
    parser.add_argument("--quick", action="store_true", help="a smaller replay that finishes in < 3 minutes here")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE_PATH, help="Azure-format trace CSV")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="small", help="model preset with seeded random weights (default: small)")
    source.add_argument(
        "--checkpoint", help="a named model (smollm2-135m-instruct), a Llama GGUF file or a safetensors directory"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and prompt seed")
    parser.add_argument("--requests", type=int, help="requests taken from the trace (default 128; quick 32)")
    parser.add_argument("--start-s", type=float, default=0.0, help="where the slice starts in the original trace")
    parser.add_argument(
        "--rate",
        type=float,
        default=32.0,
        help="mean arrival rate after time scaling, req/s (default 32: above every system's capacity here, so\n"
        "tokens/s measures capacity; at 8 continuous batching nearly keeps up and reports the offered load)",
    )
    parser.add_argument("--token-scale", type=float, default=0.1, help="prompt/output length scale (default 0.1)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="clamp on scaled prompts (default 1024)")
    parser.add_argument("--max-output-tokens", type=int, default=256, help="clamp on scaled outputs (default 256)")


def _add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """batchpilot's window, budget and KV, and the kernels and dtype of every system."""
    parser.add_argument("--target-batch-size", type=int, default=16, help="window targetBatchSize (default 16)")
    parser.add_argument("--hard-cap", type=int, default=32, help="window hardCap (default 32)")
    parser.add_argument("--max-wait-ms", type=int, default=100, help="window maxWaitMs (default 100)")
    parser.add_argument("--max-prefill-tokens", type=int, help="chunked-prefill budget for batchpilot (default none)")
    parser.add_argument("--kv-cache-tokens", type=int, default=32_768, help="batchpilot KV capacity (default 32768)")
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batchpilot's batch-invariant kernels (token-exact batching, slower; default: off, the fastest\n"
        f"kernels, unless {BATCH_INVARIANT_ENV}=1)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of batchpilot's model and of transformers' (default float32, the runtime's CPU default;\n"
        "bfloat16 is several times faster in GEMMs on CPUs with AVX-512 bf16 or AMX)",
    )


def _add_replay_flags(parser: argparse.ArgumentParser) -> None:
    """The replay's clock and warm-up, the systems run, and where the results go."""
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="replay clock: this thread's CPU time with idle gaps skipped (default; immune to other load on a\n"
        "shared machine), or wall time (a dedicated machine)",
    )
    parser.add_argument(
        "--clock-scale",
        type=float,
        default=1.0,
        help="multiply the CPU clock by this (default 1): 0.8 replays as if on a host 1.25x as fast. Static\n"
        "batches close by the window rule on that clock, so this shows how much a ratio owes to where\n"
        "HF's batches happen to close on this host",
    )
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before the timed systems, one untimed continuous replay of the same requests (and one untimed\n"
        "generate for HF), so that no system pays the process's first large allocations for the others\n"
        "(default: on)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every system (default 1)")
    parser.add_argument("--overhead-seqs", type=int, default=64, help="running sequences of the overhead run")
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS + REFERENCE_SYSTEMS,
        default=list(SYSTEMS),
        help="systems to run; llama_cpp (an outside reference, with a GGUF --checkpoint) only when named",
    )
    parser.add_argument("--json", type=Path, default=Path("out/bench/runtime.json"), help="output JSON path")
    parser.add_argument("--plot", type=Path, default=Path("out/bench/runtime.png"), help="output PNG path")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter)
    _add_workload_flags(parser)
    _add_serving_flags(parser)
    _add_replay_flags(parser)
    args = parser.parse_args(argv)
    try:
        ReplayClock(args.clock, args.clock_scale)  # the clock's own rule, checked before anything loads
    except ValueError as exc:
        parser.error(f"--clock-scale: {exc}")
    if args.requests is None:
        args.requests = 32 if args.quick else 128
    return args


# -- reporting -----------------------------------------------------------------------------------


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    ttft = np.array([o.first_token_s - o.arrival_s for o in outcomes])
    e2e = np.array([o.finished_s - o.arrival_s for o in outcomes])
    start_s = min(o.arrival_s for o in outcomes)
    end_s = max(o.finished_s for o in outcomes)
    tokens = sum(o.output_tokens for o in outcomes)
    return {
        "tokens_per_s": tokens / (end_s - start_s),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "e2e_p50_s": float(np.percentile(e2e, 50)),
        "e2e_p99_s": float(np.percentile(e2e, 99)),
        "makespan_s": end_s - start_s,
        "requests": len(outcomes),
        "output_tokens": tokens,
    }


def plot(result: dict[str, Any], e2e_by_system: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["systems"])
    systems = result["systems"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    axes[0].bar(names, [systems[n]["tokens_per_s"] for n in names], color=colors[: len(names)])
    axes[0].set_title("throughput (output tokens/s)")
    width = 0.25
    xs = np.arange(len(names))
    for offset, key in enumerate(("ttft_p50_s", "ttft_p99_s", "e2e_p99_s")):
        axes[1].bar(xs + (offset - 1) * width, [systems[n][key] for n in names], width, label=key)
    axes[1].set_xticks(xs, names)
    axes[1].set_yscale("log")
    axes[1].set_title("latency (s)")
    axes[1].legend()
    for color, name in zip(colors, names, strict=False):
        values = np.sort(np.array(e2e_by_system[name]))
        axes[2].plot(values, np.arange(1, len(values) + 1) / len(values), label=name, color=color)
    axes[2].set_xscale("log")
    axes[2].set_xlabel("end-to-end latency (s)")
    axes[2].set_title("end-to-end latency CDF")
    axes[2].legend()
    config = result["config"]
    fig.suptitle(
        f"batchpilot runtime vs transformers generate — {config['preset']} on {config['device']}, "
        f"{config['requests']} requests, {config['scaling_description']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_workload(
    args: argparse.Namespace,
    model: LlamaModel,
    model_name: str,
    jobs: Sequence[Job],
    scaling: TraceScaling,
    window: Window,
) -> None:
    """What every system is about to serve: the model, the replayed requests, the window and the clock."""
    config = model.config
    prompt_tokens = [len(j.prompt) for j in jobs]
    output_tokens = [j.output_tokens for j in jobs]
    print(
        f"model: {model_name} ({config.num_parameters / 1e6:.1f} M parameters), cpu {args.dtype}, {args.threads} thread(s), "
        f"batch-invariant {'on' if model.batch_invariant else 'off'}"
    )
    print(f"trace: {args.trace.name}, {len(jobs)} requests, scaling: {scaling.describe()}")
    print(
        f"  -> {len(jobs) / max(jobs[-1].arrival_s, 1e-9):.2f} req/s over {jobs[-1].arrival_s:.1f} s; "
        f"prompt tokens mean {np.mean(prompt_tokens):.0f} (max {max(prompt_tokens)}), "
        f"output tokens mean {np.mean(output_tokens):.1f} (max {max(output_tokens)})"
    )
    scaled = f" x{args.clock_scale:g}" if args.clock_scale != 1.0 else ""
    print(f"window: {window.describe()}; replay clock: {args.clock}{scaled}")


def print_system(name: str, summary: dict[str, Any]) -> None:
    print(
        f"{name:>10}: {summary['tokens_per_s']:7.1f} tok/s  TTFT p50 {summary['ttft_p50_s']:6.2f} s "
        f"p99 {summary['ttft_p99_s']:6.2f} s  e2e p99 {summary['e2e_p99_s']:6.2f} s  "
        f"(makespan {summary['makespan_s']:.1f} s, ran {summary['wall_s']:.0f} s)",
        flush=True,
    )


def token_agreement(tokens_by_system: dict[str, dict[int, list[int]]]) -> dict[str, float]:
    """Each system's share of requests whose tokens equal continuous batching's (none without it)."""
    reference = tokens_by_system.get("continuous")
    agreement = {}
    if reference is not None:
        for name, tokens in tokens_by_system.items():
            if name != "continuous":
                same = sum(tokens[i] == reference[i] for i in reference)
                agreement[name] = same / len(reference)
    return agreement


def print_overhead(overhead: dict[str, Any]) -> None:
    print(
        f"overhead at {overhead['running_sequences']} running sequences: "
        f"{100 * overhead['fraction_cpu']:.1f} % of step CPU time outside the forward "
        f"({overhead['step_ms_cpu']:.1f} ms/step; wall: {100 * overhead['fraction_wall']:.1f} % "
        f"of {overhead['step_ms_wall']:.1f} ms)"
    )


def build_result(
    args: argparse.Namespace,
    model: LlamaModel,
    model_name: str,
    jobs: Sequence[Job],
    scaling: TraceScaling,
    window: Window,
    figures: dict[str, Any],
) -> dict[str, Any]:
    """The JSON result: ``figures`` (systems, overhead, token agreement, batching) and the run's config;
    its targets empty until :func:`add_comparisons`."""
    overhead = figures["overhead"]
    return {
        "systems": figures["systems"],
        "scheduler_overhead_fraction": overhead["fraction_cpu"],
        "overhead": overhead,
        "token_agreement_with_continuous": figures["agreement"],
        "batching": figures["extra"],
        "config": {
            "preset": model_name,
            "checkpoint": args.checkpoint,
            "model": describe(model.config),
            "device": "cpu",
            "dtype": args.dtype,
            "threads": args.threads,
            "clock": args.clock,
            "clock_scale": args.clock_scale,
            "warmup": args.warmup,
            "batch_invariant": model.batch_invariant,
            "requests": len(jobs),
            "trace": str(args.trace.name),
            "scaling": scaling.as_dict(),
            "scaling_description": scaling.describe(),
            "arrival_rate_per_s": args.rate,
            "window": window.model_dump(by_alias=True),
            "max_prefill_tokens": args.max_prefill_tokens,
            "kv_cache_tokens": args.kv_cache_tokens,
            "quick": args.quick,
            "command": " ".join(sys.argv),
            "torch": torch.__version__,
        },
        "targets": {},
    }


def add_comparisons(result: dict[str, Any]) -> None:
    """The targets against transformers and the ratios to the outside reference, written into
    ``result`` and printed, for the systems that ran."""
    systems, overhead = result["systems"], result["overhead"]
    if "continuous" in systems and "hf_static" in systems:
        ratio = systems["continuous"]["tokens_per_s"] / systems["hf_static"]["tokens_per_s"]
        result["targets"] = {
            "continuous_over_hf_static_tokens_per_s": ratio,
            "throughput_3x_met": ratio >= 3.0,
            "e2e_p99_no_worse_met": systems["continuous"]["e2e_p99_s"] <= systems["hf_static"]["e2e_p99_s"],
            "overhead_10pct_met": overhead["fraction_cpu"] <= 0.10,
        }
        print(f"continuous / hf_static tokens/s: {ratio:.2f}x; targets: {result['targets']}")
    if "llama_cpp" in systems:
        outside: dict[str, Any] = {"system": "llama.cpp via llama-cpp-python, one request at a time, quantized GGUF"}
        for name in ("continuous", "sequential"):
            if name in systems:
                outside[f"{name}_over_llama_cpp_tokens_per_s"] = (
                    systems[name]["tokens_per_s"] / systems["llama_cpp"]["tokens_per_s"]
                )
        result["outside_reference"] = outside
        print(f"outside reference: {outside}")
