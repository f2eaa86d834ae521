"""Side by side on one GGUF: the batchpilot runtime and llama.cpp's llama-server, over HTTP.

    .venv/bin/python tests/bench/bench_llamacpp.py --quick

Three servers, each started fresh for each load (llama-server keeps every slot's prompt in its cache,
so a warm server would answer a replayed prompt from it), alone on the machine, with the same thread
count (``--threads``, default 1):

1. ``runtime``: ``batchpilot-runtime serve --checkpoint smollm2-135m-instruct --threads N`` at its
   defaults (window cap 16, whole prompts per step), fp32 weights dequantized from the GGUF;
2. ``llama_default``: ``llama-server -m <the GGUF> --threads N`` at its defaults (4 slots sharing a
   unified KV cache of the model's trained context, batch 2048 / ubatch 512), Q4_1 kernels;
3. ``llama_window``: llama-server with the runtime's window: its cap as ``--parallel`` (``--cap``) and
   its per-step prompt budget as ``--batch-size``/``--ubatch-size`` (``--budget``; the runtime's default
   is whole prompts, so the default budget is the longest prompt of the loads), ``--ctx-size`` the cap
   times ``--slot-ctx``.

Two loads, each the same requests for every server (``batchpilot-runtime loadgen``, open loop, the
shared Azure conversation trace, prompts synthesized from ``--seed``, greedy, ``ignore_eos`` so that
every answer has the trace's length): ``replay`` (prompts up to 256 tokens, answers up to 64) and
``decode`` (short prompts, up to 32 tokens; long answers, up to 256). Per server and load: output
tokens/s, first-token P50/P99, inter-token P50/P99, end-to-end P99, and llama-server's own counters.

Writes ``out/bench/llamacpp.json`` and ``out/bench/llamacpp.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a script, the repository's root (where the tests package is) is not on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.llama_server_process import (
    llama_server,
    llama_server_args,
    llama_server_binary,
    llamacpp_metrics,
    smollm2_gguf,
)
from tests.integration.runtime_process import runtime_process

SYSTEMS = ("runtime", "llama_default", "llama_window")
OUT_DIR = Path("out/bench")


@dataclass(frozen=True)
class Load:
    name: str
    flags: tuple[str, ...]  # loadgen's trace flags


def loads(quick: bool, seed: int) -> list[Load]:
    replay_limit, decode_limit = (30, 12) if quick else (60, 24)
    common = ("--seed", str(seed))
    return [
        Load(
            "replay",
            (
                "--rate",
                "0.5",
                "--limit",
                str(replay_limit),
                "--max-prompt-tokens",
                "256",
                "--max-output-tokens",
                "64",
                *common,
            ),
        ),
        Load(
            "decode",
            (
                "--rate",
                "0.25",
                "--limit",
                str(decode_limit),
                "--max-prompt-tokens",
                "32",
                "--max-output-tokens",
                "256",
                *common,
            ),
        ),
    ]


@contextmanager
def serving(system: str, workdir: Path, args: argparse.Namespace) -> Iterator[tuple[str, dict[str, Any]]]:
    """A freshly started server: its URL and how it was started."""
    threads = str(args.threads)
    if system == "runtime":
        flags = ("--checkpoint", "smollm2-135m-instruct", "--threads", threads)
        with runtime_process(workdir, *flags, model_name="smollm2", timeout_s=300.0) as runtime:
            yield runtime.info.serve_url, {"command": ["batchpilot-runtime", "serve", *flags]}
        return
    if system == "llama_default":
        server_args = ["--metrics", "--threads", threads]
    else:
        server_args = llama_server_args(
            parallel=args.cap, ctx_size=args.cap * args.slot_ctx, threads=args.threads, batch_size=args.budget
        )
    with llama_server(workdir, server_args, name=system) as server:
        started = {"command": ["llama-server", "-m", smollm2_gguf().name, *server_args]}
        yield server.url, started
        started["llamacpp_metrics"] = llamacpp_metrics(server.url)


def run_loadgen(url: str, load: Load, json_path: Path) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "batchpilot_runtime.cli.main",
        "loadgen",
        "--endpoint",
        url,
        "--no-progress",
        "--timeout-s",
        "600",
        "--json",
        str(json_path),
        *load.flags,
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    summary: dict[str, Any] = json.loads(json_path.read_text())
    return summary


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "completed": summary["outcomes"]["completed"],
        "requests": summary["requests_sent"],
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "ttft_p50_s": summary["ttft"]["p50_s"],
        "ttft_p99_s": summary["ttft"]["p99_s"],
        "itl_p50_s": summary["inter_token"]["p50_s"],
        "itl_p99_s": summary["inter_token"]["p99_s"],
        "e2e_p99_s": summary["e2e"]["p99_s"],
    }


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| load | server | output tokens/s | first token P50 / P99 (s) | inter-token P50 / P99 (ms) | end-to-end P99 (s) |",
        "|---|---|---|---|---|---|",
    ]
    for load, by_system in results.items():
        for system, row in by_system.items():
            f = row["figures"]
            lines.append(
                f"| {load} | {system} | {f['output_tokens_per_s']:.1f} | {f['ttft_p50_s']:.2f} / {f['ttft_p99_s']:.2f} "
                f"| {1000 * f['itl_p50_s']:.0f} / {1000 * f['itl_p99_s']:.0f} | {f['e2e_p99_s']:.1f} |"
            )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("output_tokens_per_s", "output tokens/s", 1.0),
        ("ttft_p99_s", "first token P99 (s)", 1.0),
        ("itl_p99_s", "inter-token P99 (ms)", 1000.0),
        ("e2e_p99_s", "end-to-end P99 (s)", 1.0),
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    load_names = list(results)
    width = 0.8 / len(SYSTEMS)
    for axis, (key, label, scale) in zip(axes, panels, strict=True):
        for position, system in enumerate(SYSTEMS):
            values = [scale * (results[load][system]["figures"][key] or 0.0) for load in load_names]
            axis.bar([i + position * width for i in range(len(load_names))], values, width, label=system)
        axis.set_xticks([i + width for i in range(len(load_names))], load_names)
        axis.set_title(label)
    axes[0].legend(fontsize=8)
    figure.suptitle("SmolLM2-135M-Instruct Q4_1, same requests: batchpilot runtime vs llama-server")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="fewer requests per load (17 minutes in all on a busy 2-core host)"
    )
    parser.add_argument("--threads", type=int, default=1, help="threads of every server")
    parser.add_argument("--cap", type=int, default=16, help="the window's cap: the runtime's default hard cap")
    parser.add_argument("--budget", type=int, default=256, help="the window's prompt tokens per step")
    parser.add_argument("--slot-ctx", type=int, default=1024, help="llama_window's context per slot")
    parser.add_argument("--seed", type=int, default=7, help="seed of the synthesized prompts")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)

    llama_server_binary()  # fails at once, saying how to build it, when it is missing
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as scratch:
        for load in loads(args.quick, args.seed):
            results[load.name] = {}
            for system in SYSTEMS:
                print(f"bench_llamacpp: {load.name} on {system} ...", file=sys.stderr, flush=True)
                workdir = Path(scratch) / load.name / system
                with serving(system, workdir, args) as (url, started):
                    summary = run_loadgen(url, load, workdir / "loadgen.json")
                results[load.name][system] = {
                    "figures": figures(summary),
                    "loadgen": {"flags": list(load.flags), "summary": summary},
                    **started,
                }
                print(f"  {json.dumps(figures(summary))}", file=sys.stderr, flush=True)
    report = {
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llamacpp.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, args.out / "llamacpp.png")
    print(table(results))
    print(f"wrote {args.out / 'llamacpp.json'} and {args.out / 'llamacpp.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
