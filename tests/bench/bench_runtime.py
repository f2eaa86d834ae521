"""Runtime benchmark: the Azure conversation trace replayed through four ways of serving it.

    .venv/bin/python tests/bench/bench_runtime.py --quick      # < 3 minutes on the 2-core CPU box
    .venv/bin/python tests/bench/bench_runtime.py               # the full run

On the same weights (the ``small`` preset, seeded, or a real checkpoint with ``--checkpoint``,
e.g. ``smollm2-135m-instruct``) and the same requests (a slice of the trace, time- and
token-scaled so that this CPU machine is loaded; the scaling is printed):

1. ``continuous``: batchpilot continuous batching,
2. ``static``: batchpilot static batching with the same window,
3. ``sequential``: batchpilot, one request at a time,
4. ``hf_static``: transformers ``generate`` on static, left-padded batches formed by the same
   window rule (target reached, or the oldest waited maxWaitMs; at most hardCap). A batch
   generates max(output lengths of its requests) tokens; each request counts only its own
   tokens and is finished at the step that produced its own last token (which favours HF:
   ``generate`` returns the whole batch at the end).

Every system replays the arrivals in real time from one process, one after the other, after an
untimed warm-up (--no-warmup skips it). Prompts
are random token ids with the trace's (scaled) lengths; outputs are greedy with exactly the
trace's (scaled) lengths (no stop token). A dedicated run at 64 concurrent decoding sequences
measures the share of step time spent outside the model's forward pass.

Writes JSON ({"systems": {name: {"tokens_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", ...}},
"scheduler_overhead_fraction", "config", ...}) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.engine.engine import Engine
from batchpilot_runtime.engine.types import GenerationRequest
from batchpilot_runtime.model.batch import ForwardBatch
from batchpilot_runtime.model.config import config_from_name, describe
from batchpilot_runtime.model.kernels import BATCH_INVARIANT_ENV
from batchpilot_runtime.model.kv_cache import PagedKVCache
from batchpilot_runtime.model.model import LlamaModel
from batchpilot_runtime.model.sources import load_checkpoint, resolve_checkpoint
from batchpilot_runtime.model.tokenizer import ByteTokenizer
from batchpilot_runtime.replay.trace import (
    DEFAULT_TRACE_PATH,
    TraceRequest,
    TraceScaling,
    read_trace,
    scale_trace,
    time_scale_for_rate,
)
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import RequestTimings, SchedulerConfig, StepStats

SYSTEMS = ("continuous", "static", "sequential", "hf_static")
# An outside reference, run only when asked: llama.cpp through llama-cpp-python (not a dependency:
# it builds llama.cpp from source), on the same GGUF file with its own quantized kernels.
REFERENCE_SYSTEMS = ("llama_cpp",)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Job:
    """One request of the replay: when it arrives (s from the replay's start) and what it asks."""

    index: int
    arrival_s: float
    prompt: list[int]
    output_tokens: int


@dataclass(frozen=True)
class Outcome:
    index: int
    arrival_s: float
    first_token_s: float
    finished_s: float
    output_tokens: int


class ReplayClock:
    """Seconds since the replay started: the trace's arrival times live on this clock.

    ``cpu`` (the default) counts this thread's CPU time, plus the idle gaps the replay skips
    instead of sleeping through them. With one torch thread every system computes on the
    calling thread, so this clock measures the work each system does as if it had a core to
    itself: the other processes of a shared machine do not leak into the figures, and the
    systems, run one after the other, are compared on equal terms. ``wall`` is real time (for
    a dedicated machine), where idle gaps are slept.

    ``scale`` (cpu only) multiplies the CPU time counted: 0.8 replays as if on a host 1.25x as fast,
    which moves where static batches close (--clock-scale).
    """

    def __init__(self, kind: str, scale: float = 1.0) -> None:
        if kind not in ("cpu", "wall"):
            raise ValueError(f"clock must be 'cpu' or 'wall', got {kind!r}")
        if scale <= 0 or (kind == "wall" and scale != 1.0):
            raise ValueError(f"clock scale: must be > 0, and 1 with the wall clock, got {scale} ({kind})")
        self.kind = kind
        self.scale = scale
        self._read = time.thread_time if kind == "cpu" else time.monotonic
        self.origin = self._read()
        self.skipped_s = 0.0

    def reset(self) -> None:
        self.origin = self._read()
        self.skipped_s = 0.0

    def __call__(self) -> float:
        return (self._read() - self.origin) * self.scale + self.skipped_s

    def idle_until(self, wake_s: float) -> None:
        """Nothing to do before ``wake_s``: skip (cpu) or sleep (wall) up to it."""
        delay_s = wake_s - self()
        if delay_s <= 0 or delay_s == float("inf"):
            return
        if self.kind == "cpu":
            self.skipped_s += delay_s
        else:
            time.sleep(min(delay_s, 0.05))


# -- the workload ------------------------------------------------------------------------


def make_jobs(args: argparse.Namespace, vocab_size: int) -> tuple[list[Job], TraceScaling]:
    trace = read_trace(args.trace)
    window_slice = scale_trace(trace, TraceScaling(start_s=args.start_s, limit=args.requests))
    time_scale = time_scale_for_rate(window_slice, args.rate)
    scaling = TraceScaling(
        time_scale=time_scale,
        token_scale=args.token_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        start_s=args.start_s,
        limit=args.requests,
    )
    scaled: list[TraceRequest] = scale_trace(trace, scaling)
    rng = random.Random(args.seed)
    jobs = [
        Job(i, r.arrival_s, [rng.randrange(vocab_size) for _ in range(r.prompt_tokens)], r.output_tokens)
        for i, r in enumerate(scaled)
    ]
    return jobs, scaling


# -- batchpilot ------------------------------------------------------------------------------


class TimedModel:
    """Wraps the model to time its forward pass in wall and CPU (thread) seconds."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.wall_s = 0.0
        self.cpu_s = 0.0

    def __call__(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        wall, cpu = time.perf_counter(), time.thread_time()
        logits = self.model(batch, kv)
        self.wall_s += time.perf_counter() - wall
        self.cpu_s += time.thread_time() - cpu
        return logits


class StepLog:
    """EngineObserver keeping each step's stats and wall times."""

    def __init__(self) -> None:
        self.steps: list[tuple[StepStats, float, float]] = []

    def on_step(self, stats: StepStats, step_seconds: float, forward_seconds: float) -> None:
        self.steps.append((stats, step_seconds, forward_seconds))

    def on_request_finished(self, timings: RequestTimings, outcome: str) -> None:
        pass

    def on_tokens(self, lane: str, inter_token_gaps_s: Sequence[float]) -> None:
        pass

    def on_window(self, state: Any) -> None:
        pass


def make_engine(
    model: LlamaModel,
    window: Window,
    batching: str,
    kv_cache_tokens: int,
    max_prefill: int | None,
    clock_kind: str = "cpu",
    clock_scale: float = 1.0,
) -> tuple[Engine, ReplayClock, StepLog]:
    num_blocks = PagedKVCache.blocks_for_token_budget(kv_cache_tokens, BLOCK_SIZE)
    kv = PagedKVCache(model.config, num_blocks, BLOCK_SIZE, model.device, model.dtype)
    scheduler = Scheduler(
        SchedulerConfig(
            num_kv_blocks=num_blocks,
            kv_block_size=BLOCK_SIZE,
            max_model_len=model.config.max_position_embeddings,
            max_prefill_tokens_per_step=max_prefill,
            max_queue=100_000,
            batching="static" if batching == "static" else "continuous",
        ),
        window,
    )
    clock = ReplayClock(clock_kind, clock_scale)
    log = StepLog()
    engine = Engine(model, kv, scheduler, ByteTokenizer(), "bench", clock=clock, observer=log)
    return engine, clock, log


def replay_engine(
    engine: Engine, clock: ReplayClock, jobs: Sequence[Job]
) -> tuple[list[Outcome], dict[int, list[int]]]:
    """Feed the jobs at their arrival times and step until all are done; the engine never waits on
    the driver (arrivals are added between steps, stamped with their trace arrival time)."""
    tokens: dict[int, list[int]] = {job.index: [] for job in jobs}
    outcomes: list[Outcome] = []
    next_job = 0
    clock.reset()
    while next_job < len(jobs) or engine.has_unfinished:
        now_s = clock()
        while next_job < len(jobs) and jobs[next_job].arrival_s <= now_s:
            job = jobs[next_job]
            engine.add_request(
                GenerationRequest(str(job.index), job.prompt, job.output_tokens), arrival_s=job.arrival_s
            )
            next_job += 1
        steps_before = engine.steps_run
        for event in engine.step():
            index = int(event.request_id)
            if event.token_id is not None:
                tokens[index].append(event.token_id)
            if event.finish_reason is not None:
                timings = event.timings
                assert timings is not None and timings.first_token_s is not None
                assert event.finish_reason == "length", event
                outcomes.append(
                    Outcome(index, timings.arrival_s, timings.first_token_s, timings.finished_s, timings.output_tokens)
                )
        if engine.steps_run == steps_before:
            # Idle: sleep to the next arrival or the scheduler's next admission deadline.
            wake_s = jobs[next_job].arrival_s if next_job < len(jobs) else float("inf")
            deadline_s = engine.next_deadline_s()
            if deadline_s is not None:
                wake_s = min(wake_s, deadline_s)
            clock.idle_until(wake_s)
    return outcomes, tokens


# -- transformers ----------------------------------------------------------------------------


class StepTimes:
    """A logits processor that only notes when each generated token is chosen."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.times_s: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times_s.append(self.clock())
        return scores


def load_hf(model: LlamaModel, directory: Path) -> Any:
    """transformers' Llama on the same weights, in the same dtype as batchpilot's model."""
    from transformers import LlamaForCausalLM

    model.save_safetensors(directory)
    hf = LlamaForCausalLM.from_pretrained(str(directory), dtype=model.dtype).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    hf.generation_config.do_sample = False
    return hf


def warm_up_hf(hf: Any, job: Job) -> None:
    """One untimed ``generate`` of ``job``: transformers' first-call costs stay out of the replay."""
    with torch.inference_mode():
        hf.generate(input_ids=torch.tensor([job.prompt]), max_new_tokens=job.output_tokens, do_sample=False)


def replay_hf(
    hf: Any, window: Window, jobs: Sequence[Job], clock_kind: str, clock_scale: float = 1.0
) -> tuple[list[Outcome], dict[int, list[int]], list[int]]:
    """Static padded batches formed by the window rule, each run with ``generate`` to the
    longest output in the batch."""
    from transformers import LogitsProcessorList

    clock = ReplayClock(clock_kind, clock_scale)
    waiting: deque[Job] = deque()
    outcomes: list[Outcome] = []
    tokens: dict[int, list[int]] = {}
    batch_sizes: list[int] = []
    next_job = 0
    wait_s = window.max_wait_ms / 1000.0
    while next_job < len(jobs) or waiting:
        now_s = clock()
        while next_job < len(jobs) and jobs[next_job].arrival_s <= now_s:
            waiting.append(jobs[next_job])
            next_job += 1
        if not waiting or (len(waiting) < window.target_batch_size and now_s < waiting[0].arrival_s + wait_s):
            wake_s = jobs[next_job].arrival_s if next_job < len(jobs) else float("inf")
            if waiting:
                wake_s = min(wake_s, waiting[0].arrival_s + wait_s)
            clock.idle_until(wake_s)
            continue
        batch = [waiting.popleft() for _ in range(min(window.hard_cap, len(waiting)))]
        batch_sizes.append(len(batch))
        longest_prompt = max(len(job.prompt) for job in batch)
        input_ids = torch.zeros((len(batch), longest_prompt), dtype=torch.long)
        attention_mask = torch.zeros((len(batch), longest_prompt), dtype=torch.long)
        for row, job in enumerate(batch):  # left padding, as decoder-only generation needs
            input_ids[row, longest_prompt - len(job.prompt) :] = torch.tensor(job.prompt)
            attention_mask[row, longest_prompt - len(job.prompt) :] = 1
        steps = StepTimes(clock)
        max_new = max(job.output_tokens for job in batch)
        with torch.inference_mode():
            sequences = hf.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new,
                do_sample=False,
                logits_processor=LogitsProcessorList([steps]),
            )
        for row, job in enumerate(batch):
            generated = sequences[row, longest_prompt : longest_prompt + job.output_tokens].tolist()
            tokens[job.index] = generated
            outcomes.append(
                Outcome(
                    job.index, job.arrival_s, steps.times_s[0], steps.times_s[job.output_tokens - 1], len(generated)
                )
            )
    return outcomes, tokens, batch_sizes


# -- llama.cpp, an outside reference --------------------------------------------------------


def replay_llama_cpp(
    gguf_path: Path, jobs: Sequence[Job], threads: int, clock_kind: str, clock_scale: float = 1.0
) -> tuple[list[Outcome], dict[int, list[int]]]:
    """The same requests through llama.cpp (llama-cpp-python's ``Llama``), greedy, one request at a
    time in arrival order: its binding decodes one sequence (as its own server does), on the GGUF
    file's quantized weights, where the runtime serves them dequantized to fp32."""
    try:
        from llama_cpp import Llama  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise SystemExit(
            "--systems llama_cpp needs llama-cpp-python, which builds llama.cpp from source: "
            "pip install llama-cpp-python (not a dependency of batchpilot)"
        ) from exc
    longest = max(len(job.prompt) + job.output_tokens for job in jobs)
    llm = Llama(
        model_path=str(gguf_path),
        n_ctx=longest + 16,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )
    llm.eval(jobs[0].prompt[:8])  # page the weights in before the clock starts
    clock = ReplayClock(clock_kind, clock_scale)
    outcomes: list[Outcome] = []
    tokens: dict[int, list[int]] = {}
    for job in jobs:
        clock.idle_until(job.arrival_s)
        generated: list[int] = []
        times_s: list[float] = []
        # top_k 1 and temperature 0: greedy; no repeat penalty, and no stop on end-of-text, so that
        # every request generates the tokens the trace asks for, as in the other systems.
        for token in llm.generate(job.prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            generated.append(int(token))
            times_s.append(clock())
            if len(generated) == job.output_tokens:
                break
        tokens[job.index] = generated
        outcomes.append(Outcome(job.index, job.arrival_s, times_s[0], times_s[-1], len(generated)))
    return outcomes, tokens


# -- scheduler overhead at 64 running sequences ------------------------------------------------


def measure_overhead(model: LlamaModel, num_seqs: int, prompt_tokens: int, decode_steps: int) -> dict[str, Any]:
    """Share of step time outside the model's forward at ``num_seqs`` decoding sequences: the
    scheduler, ForwardBatch.build, sampling and event bookkeeping."""
    window = Window(target_batch_size=num_seqs, hard_cap=num_seqs, max_wait_ms=0)
    engine, _clock, log = make_engine(model, window, "continuous", num_seqs * (prompt_tokens + decode_steps + 32), None)
    timed = TimedModel(model)
    engine.model = timed  # type: ignore[assignment]
    rng = random.Random(1)
    for index in range(num_seqs):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(prompt_tokens)]
        engine.add_request(GenerationRequest(str(index), prompt, decode_steps + 2))
    engine.step()  # the prefill of all 64
    step_wall_s = step_cpu_s = forward_wall_s = forward_cpu_s = 0.0
    measured = 0
    for _ in range(decode_steps):
        timed.wall_s = timed.cpu_s = 0.0
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        stats = log.steps[-1][0]
        if stats.batch_size != num_seqs or stats.num_prefill_seqs:
            continue
        step_wall_s += time.perf_counter() - wall
        step_cpu_s += time.thread_time() - cpu
        forward_wall_s += timed.wall_s
        forward_cpu_s += timed.cpu_s
        measured += 1
    if measured == 0:
        raise RuntimeError("no decode step ran at the full batch size")
    return {
        "running_sequences": num_seqs,
        "prompt_tokens": prompt_tokens,
        "steps_measured": measured,
        "step_ms_wall": 1000 * step_wall_s / measured,
        "forward_ms_wall": 1000 * forward_wall_s / measured,
        "step_ms_cpu": 1000 * step_cpu_s / measured,
        "forward_ms_cpu": 1000 * forward_cpu_s / measured,
        "fraction_wall": 1.0 - forward_wall_s / step_wall_s,
        "fraction_cpu": 1.0 - forward_cpu_s / step_cpu_s,
    }


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
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
    args = parser.parse_args(argv)
    try:
        ReplayClock(args.clock, args.clock_scale)  # the clock's own rule, checked before anything loads
    except ValueError as exc:
        parser.error(f"--clock-scale: {exc}")
    if args.requests is None:
        args.requests = 32 if args.quick else 128
    return args


def load_model(args: argparse.Namespace) -> tuple[LlamaModel, str]:
    """The model every system serves, and its name: a preset with seeded weights, or a checkpoint."""
    if args.checkpoint is None:
        config = config_from_name(args.preset)
        return LlamaModel.random(
            config, args.seed, "cpu", getattr(torch, args.dtype), args.batch_invariant
        ), args.preset
    source = resolve_checkpoint(args.checkpoint)
    model, _tokenizer = load_checkpoint(source, "cpu", getattr(torch, args.dtype), args.batch_invariant)
    return model, source.name


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "llama_cpp" in args.systems and (args.checkpoint is None or resolve_checkpoint(args.checkpoint).kind != "gguf"):
        raise SystemExit("--systems llama_cpp serves the same GGUF file: give a GGUF --checkpoint")
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    model, model_name = load_model(args)
    config = model.config
    jobs, scaling = make_jobs(args, config.vocab_size)
    prompt_tokens = [len(j.prompt) for j in jobs]
    output_tokens = [j.output_tokens for j in jobs]
    window = Window(target_batch_size=args.target_batch_size, hard_cap=args.hard_cap, max_wait_ms=args.max_wait_ms)
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
    systems: dict[str, dict[str, Any]] = {}
    e2e_by_system: dict[str, list[float]] = {}
    tokens_by_system: dict[str, dict[int, list[int]]] = {}
    extra: dict[str, Any] = {}
    if args.warmup and set(args.systems) & {"continuous", "static", "sequential"}:
        # first large allocations and cold caches would otherwise fall on whichever system runs first
        t0 = time.monotonic()
        engine, clock, _ = make_engine(model, window, "continuous", args.kv_cache_tokens, args.max_prefill_tokens)
        replay_engine(engine, clock, jobs)
        del engine
        print(f"    warmup: one untimed continuous replay ({time.monotonic() - t0:.0f} s)")
    for name in args.systems:
        t0 = time.monotonic()
        if name == "llama_cpp":
            outcomes, tokens = replay_llama_cpp(
                resolve_checkpoint(args.checkpoint).path, jobs, args.threads, args.clock, args.clock_scale
            )
        elif name == "hf_static":
            with tempfile.TemporaryDirectory() as directory:
                hf = load_hf(model, Path(directory))
                if args.warmup:
                    warm_up_hf(hf, jobs[0])
                outcomes, tokens, batch_sizes = replay_hf(hf, window, jobs, args.clock, args.clock_scale)
            extra["hf_static_mean_batch"] = float(np.mean(batch_sizes))
        else:
            system_window = Window(target_batch_size=1, hard_cap=1, max_wait_ms=0) if name == "sequential" else window
            batching = "static" if name == "static" else "continuous"
            engine, clock, log = make_engine(
                model,
                system_window,
                batching,
                args.kv_cache_tokens,
                args.max_prefill_tokens,
                args.clock,
                args.clock_scale,
            )
            outcomes, tokens = replay_engine(engine, clock, jobs)
            extra[f"{name}_mean_batch"] = float(np.mean([s.batch_size for s, _, _ in log.steps]))
            extra[f"{name}_preemptions"] = sum(s.preempted for s, _, _ in log.steps)
        summary = summarize(outcomes)
        summary["wall_s"] = time.monotonic() - t0
        systems[name] = summary
        e2e_by_system[name] = [o.finished_s - o.arrival_s for o in outcomes]
        tokens_by_system[name] = tokens
        print(
            f"{name:>10}: {summary['tokens_per_s']:7.1f} tok/s  TTFT p50 {summary['ttft_p50_s']:6.2f} s "
            f"p99 {summary['ttft_p99_s']:6.2f} s  e2e p99 {summary['e2e_p99_s']:6.2f} s  "
            f"(makespan {summary['makespan_s']:.1f} s, ran {summary['wall_s']:.0f} s)",
            flush=True,
        )
    reference = tokens_by_system.get("continuous")
    agreement = {}
    if reference is not None:
        for name, tokens in tokens_by_system.items():
            if name != "continuous":
                same = sum(tokens[i] == reference[i] for i in reference)
                agreement[name] = same / len(reference)
    overhead = measure_overhead(model, args.overhead_seqs, prompt_tokens=32, decode_steps=12 if args.quick else 32)
    print(
        f"overhead at {overhead['running_sequences']} running sequences: "
        f"{100 * overhead['fraction_cpu']:.1f} % of step CPU time outside the forward "
        f"({overhead['step_ms_cpu']:.1f} ms/step; wall: {100 * overhead['fraction_wall']:.1f} % "
        f"of {overhead['step_ms_wall']:.1f} ms)"
    )
    result: dict[str, Any] = {
        "systems": systems,
        "scheduler_overhead_fraction": overhead["fraction_cpu"],
        "overhead": overhead,
        "token_agreement_with_continuous": agreement,
        "batching": extra,
        "config": {
            "preset": model_name,
            "checkpoint": args.checkpoint,
            "model": describe(config),
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
    print(f"token agreement with continuous: {agreement}")
    for path in (args.json, args.plot):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, e2e_by_system, args.plot)
    print(f"wrote {args.json} and {args.plot} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
