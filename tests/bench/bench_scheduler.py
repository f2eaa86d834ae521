"""Scheduler overhead per step: schedule() + update_from_output() at a given number of running sequences.

    .venv/bin/python tests/bench/bench_scheduler.py --running 64 256

Two regimes per size: "steady" (all sequences decoding, none finishing) and "churn" (outputs of
16-64 tokens, so requests finish and new ones are admitted every few steps, with chunked prefill).
Prints CPU microseconds per step (thread time, so that other load on a shared machine does not
count), median and best of the repeats; no model runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import SchedRequest, SchedulerConfig


def measure_us_per_step(running: int, churn: bool, steps: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    block_size = 16
    prompt_tokens = 256
    max_new = (16, 64) if churn else (4000 - prompt_tokens, 4000 - prompt_tokens)
    config = SchedulerConfig(
        num_kv_blocks=running * 4096 // block_size + 64,
        kv_block_size=block_size,
        max_prefill_tokens_per_step=2048 if churn else None,
        max_queue=4 * running,
    )
    window = Window(target_batch_size=running, hard_cap=running, max_wait_ms=0)
    scheduler = Scheduler(config, window)
    prompt = tuple(range(prompt_tokens))
    next_id = 0
    now_s = 0.0

    def top_up() -> None:
        nonlocal next_id
        while scheduler.num_running + scheduler.num_waiting < 2 * running:
            scheduler.add_request(SchedRequest(f"r{next_id}", prompt, rng.randint(*max_new), now_s))
            next_id += 1

    def one_step() -> None:
        nonlocal now_s
        plan = scheduler.schedule(now_s)
        sampled = {seq.request_id: 7 for seq in plan.seqs if seq.sample}
        scheduler.update_from_output(plan, sampled, now_s)
        now_s += 0.01

    top_up()
    for _ in range(20):  # warm up: admit and prefill everyone
        one_step()
        top_up()
    elapsed_s = 0.0
    for _ in range(steps):
        # CPU time of this thread: what the scheduler costs, without the waits of a shared machine.
        start = time.thread_time()
        one_step()
        elapsed_s += time.thread_time() - start
        top_up()  # arrivals are the caller's cost, not the step's
    return elapsed_s / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for running in args.running:
        for churn in (False, True):
            runs = [measure_us_per_step(running, churn, args.steps, seed) for seed in range(args.repeats)]
            regime = "churn" if churn else "steady"
            print(
                f"running={running:4d} {regime:6s} schedule+update: median {statistics.median(runs):8.1f} us/step, "
                f"best {min(runs):8.1f} us/step ({min(runs) / running:.2f} us/seq)"
            )


if __name__ == "__main__":
    main()
