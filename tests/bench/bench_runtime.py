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
"scheduler_overhead_fraction", "config", ...}) and a PNG. The flags and the report are in
``runtime_report.py``, the requests and the replay clock in ``runtime_workload.py``; the systems are here.
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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.engine.engine import Engine
from batchpilot_runtime.engine.types import GenerationRequest
from batchpilot_runtime.model.batch import ForwardBatch
from batchpilot_runtime.model.config import config_from_name
from batchpilot_runtime.model.kv_cache import PagedKVCache
from batchpilot_runtime.model.model import LlamaModel
from batchpilot_runtime.model.sources import load_checkpoint, resolve_checkpoint
from batchpilot_runtime.model.tokenizer import ByteTokenizer
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import RequestTimings, SchedulerConfig, StepStats

if __package__ in (None, ""):  # run as a script: the repository root makes ``tests.bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.runtime_report import (
    add_comparisons,
    build_result,
    parse_args,
    plot,
    print_overhead,
    print_system,
    print_workload,
    summarize,
    token_agreement,
)
from tests.bench.runtime_workload import Job, Outcome, ReplayClock, make_jobs

BLOCK_SIZE = 16


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

    def on_admitted(self, lane: str, queue_wait_s: float) -> None:
        pass

    def on_first_token(self, lane: str, ttft_s: float) -> None:
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


# -- the run ---------------------------------------------------------------------------------------


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


def warm_up(model: LlamaModel, window: Window, jobs: Sequence[Job], args: argparse.Namespace) -> None:
    """One untimed continuous replay: the process's first large allocations and cold caches would
    otherwise fall on whichever system runs first."""
    t0 = time.monotonic()
    engine, clock, _ = make_engine(model, window, "continuous", args.kv_cache_tokens, args.max_prefill_tokens)
    replay_engine(engine, clock, jobs)
    del engine
    print(f"    warmup: one untimed continuous replay ({time.monotonic() - t0:.0f} s)")


def run_system(
    name: str, args: argparse.Namespace, model: LlamaModel, window: Window, jobs: Sequence[Job], extra: dict[str, Any]
) -> tuple[list[Outcome], dict[int, list[int]]]:
    """Replay ``jobs`` through system ``name``: its outcomes and each request's tokens; its batching
    figures go into ``extra``."""
    if name == "llama_cpp":
        return replay_llama_cpp(
            resolve_checkpoint(args.checkpoint).path, jobs, args.threads, args.clock, args.clock_scale
        )
    if name == "hf_static":
        with tempfile.TemporaryDirectory() as directory:
            hf = load_hf(model, Path(directory))
            if args.warmup:
                warm_up_hf(hf, jobs[0])
            outcomes, tokens, batch_sizes = replay_hf(hf, window, jobs, args.clock, args.clock_scale)
        extra["hf_static_mean_batch"] = float(np.mean(batch_sizes))
        return outcomes, tokens
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
    return outcomes, tokens


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "llama_cpp" in args.systems and (args.checkpoint is None or resolve_checkpoint(args.checkpoint).kind != "gguf"):
        raise SystemExit("--systems llama_cpp serves the same GGUF file: give a GGUF --checkpoint")
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    model, model_name = load_model(args)
    jobs, scaling = make_jobs(args, model.config.vocab_size)
    window = Window(target_batch_size=args.target_batch_size, hard_cap=args.hard_cap, max_wait_ms=args.max_wait_ms)
    print_workload(args, model, model_name, jobs, scaling, window)
    systems: dict[str, dict[str, Any]] = {}
    e2e_by_system: dict[str, list[float]] = {}
    tokens_by_system: dict[str, dict[int, list[int]]] = {}
    extra: dict[str, Any] = {}
    if args.warmup and set(args.systems) & {"continuous", "static", "sequential"}:
        warm_up(model, window, jobs, args)
    for name in args.systems:
        t0 = time.monotonic()
        outcomes, tokens = run_system(name, args, model, window, jobs, extra)
        summary = summarize(outcomes)
        summary["wall_s"] = time.monotonic() - t0
        systems[name] = summary
        e2e_by_system[name] = [o.finished_s - o.arrival_s for o in outcomes]
        tokens_by_system[name] = tokens
        print_system(name, summary)
    agreement = token_agreement(tokens_by_system)
    overhead = measure_overhead(model, args.overhead_seqs, prompt_tokens=32, decode_steps=12 if args.quick else 32)
    print_overhead(overhead)
    figures = {"systems": systems, "overhead": overhead, "agreement": agreement, "extra": extra}
    result = build_result(args, model, model_name, jobs, scaling, window, figures)
    add_comparisons(result)
    print(f"token agreement with continuous: {agreement}")
    for path in (args.json, args.plot):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, e2e_by_system, args.plot)
    print(f"wrote {args.json} and {args.plot} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
