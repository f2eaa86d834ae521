"""``batchpilot-runtime calibrate``: fit the step-time cost model to the real engine on this machine.

It builds the engine exactly as ``serve`` does (``Engine.build``: model preset or checkpoint,
paged KV cache, scheduler) and runs steps of varied composition through the same path as
``Engine.step``: ``schedule`` -> ``ForwardBatch.build`` -> model forward -> greedy sampling ->
``update_from_output``, timing each step (with a device sync on CUDA; the forward is repeated and the fastest run kept,
so that a shared machine's noise does not enter the fit). Each scenario admits
``batch`` requests of ``prompt`` tokens together (one prefill step of batch x prompt tokens),
then decodes them (steps of ``batch`` sequences over a growing KV), and a staggered variant
mixes prefill chunks with decodes and contexts of different lengths (every second request, a
quarter of the prompt, joins three steps later), as a server's steps do. Scenarios run corners
first (``scenario_order``), so that ``--max-seconds`` never drops a whole range of contexts: the
KV term is only measurable from steps whose sequences attend to long contexts, and a fit without
them charges nothing for the context (on this project's CPU host the live server's steps then
took 1.29x the model's on the Azure trace). ``--from-step-log FILE`` fits the steps a serving
runtime logged (``serve --step-log``) instead. The ``(composition, seconds)`` samples are fitted by
non-negative least squares (:func:`batchpilot_runtime.replay.cost_model.fit_cost_model`) and written as
JSON that ``batchpilot-operator simulate --cost-profile FILE`` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchpilot_runtime.engine.engine import Engine
    from batchpilot_runtime.replay.cost_model import FitResult, StepComposition
    from batchpilot_runtime.scheduling.types import StepPlan

# Forward runs of one step stop repeating once they have taken this long.
REPEAT_BUDGET_S = 0.3


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="time engine steps of varied composition and fit the simulator's step-time cost model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="small", help="model preset (tiny, small, medium)")
    parser.add_argument(
        "--checkpoint", default=None, help="a named model, a GGUF file or a safetensors checkpoint directory"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: CUDA when available)")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated batch sizes")
    parser.add_argument(
        "--prompt-lengths",
        default="16,64,256,1024",
        help="comma-separated prompt lengths (tokens); reach the contexts the engine will serve",
    )
    parser.add_argument(
        "--max-step-tokens",
        type=int,
        default=4096,
        help="skip a scenario whose prefill step (batch x prompt tokens) is larger than this",
    )
    parser.add_argument("--decode-steps", type=int, default=12, help="decode steps timed per scenario")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; 1 is steadier on a shared machine)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="forward runs per step; the fastest is kept")
    parser.add_argument("--kv-cache-tokens", type=int, default=65_536)
    parser.add_argument("--max-seconds", type=float, default=120.0, help="stop adding scenarios after this long")
    parser.add_argument("--name", default=None, help="profile name (default: '<checkpoint or preset>-<device>')")
    parser.add_argument("-o", "--output", type=Path, default=None, help="write the fitted model as JSON here")
    parser.add_argument(
        "--from-step-log",
        type=Path,
        default=None,
        help="fit the steps a serving runtime logged (`serve --step-log FILE`) instead of timing new ones",
    )
    parser.set_defaults(handler=_run)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must list integers >= 1, got {text!r}")
    return values


def _run(args: argparse.Namespace) -> int:
    from batchpilot_runtime.replay.cost_model import fit_cost_model

    if args.from_step_log is not None:
        return _fit_step_log(args)
    batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
    prompt_lengths = _ints(args.prompt_lengths, "--prompt-lengths")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.decode_steps < 1:
        raise ValueError(f"--decode-steps must be >= 1, got {args.decode_steps}")
    if args.max_step_tokens < 1:
        raise ValueError(f"--max-step-tokens must be >= 1, got {args.max_step_tokens}")
    engine = _build_engine(args, max(batch_sizes))
    scenarios = _Scenarios(engine, decode_steps=args.decode_steps, repeats=args.repeats)
    device = engine.model.device

    began = time.perf_counter()
    scenarios.run(min(batch_sizes), min(prompt_lengths), False, record=False)  # warm-up: allocator, kernels
    stopped_early = False
    for batch, prompt, staggered in scenario_order(batch_sizes, prompt_lengths, args.max_step_tokens):
        if time.perf_counter() - began > args.max_seconds:
            stopped_early = True
            break
        scenarios.run(batch, prompt, staggered, record=True)
    # The model timed: a checkpoint when one is given (the preset is then unused), else the preset.
    model = f"checkpoint {Path(args.checkpoint).name}" if args.checkpoint else f"preset {args.preset}"
    name = args.name or f"{Path(args.checkpoint).name if args.checkpoint else args.preset}-{device.type}"
    fit = fit_cost_model(
        scenarios.samples,
        name=name,
        source=f"batchpilot-runtime calibrate on this machine ({device.type}, {model}, "
        f"{len(scenarios.samples)} timed steps)",
        kv_capacity_tokens=engine.scheduler.capacity_tokens,
    )
    _report(fit, args.output, {"stopped_early": stopped_early, "wall_s": time.perf_counter() - began})
    return 0


def _fit_step_log(args: argparse.Namespace) -> int:
    """The cost model of a serving runtime's own steps: what it ran, under its traffic, on its host."""
    from batchpilot_runtime.replay.cost_model import fit_cost_model
    from batchpilot_runtime.server.step_log import read_step_log

    samples = read_step_log(args.from_step_log)
    name = args.name or args.from_step_log.stem
    fit = fit_cost_model(samples, name=name, source=f"fit to {len(samples)} steps of {args.from_step_log.name}")
    _report(fit, args.output, {})
    return 0


def _report(fit: FitResult, output: Path | None, extra: dict[str, Any]) -> None:
    """Writes the fit as JSON (to ``output``, else stdout after the summary line), with ``extra`` in its fit."""
    model_fit = fit.model
    payload = fit.as_dict()
    payload["fit"].update(extra)
    # Ready for a BatchProfile's spec.stepCosts: a profile that gives no window starts from one derived
    # from these and its SLO.
    payload["stepCosts"] = {
        "fixedMs": round(model_fit.fixed_s * 1e3, 4),
        "prefillUsPerToken": round(model_fit.per_prefill_token_s * 1e6, 4),
        "decodeUsPerSequence": round(model_fit.per_decode_seq_s * 1e6, 4),
        "source": model_fit.name,
    }
    text = json.dumps(payload, indent=2)
    if output:
        output.write_text(text + "\n")
    sys.stdout.write(
        f"{model_fit.name}: fixed {model_fit.fixed_s * 1e3:.3f} ms + {model_fit.per_prefill_token_s * 1e6:.2f} us/prompt "
        f"token + {model_fit.per_decode_seq_s * 1e6:.2f} us/decoding seq + {model_fit.per_kv_token_s * 1e9:.2f} ns/KV "
        f"token (R^2 {fit.r_squared:.3f}, mean |error| {fit.mean_abs_rel_error:.1%}, {fit.samples} steps"
        f"{', stopped early at --max-seconds' if extra.get('stopped_early') else ''})\n"
    )
    if not output:
        sys.stdout.write(text + "\n")


def scenario_order(
    batch_sizes: list[int], prompt_lengths: list[int], max_step_tokens: int
) -> list[tuple[int, int, bool]]:
    """Every (batch, prompt, staggered) scenario whose prefill fits ``max_step_tokens``, in rounds: each
    round takes one batch size for every prompt length, the smallest first, then the largest that fits,
    then the others from small to large. The corners that tell the four coefficients apart (one short
    sequence, one long context, a wide batch) come first, so a ``--max-seconds`` limit cuts repeats of
    what is known, not a whole range of contexts or batch sizes."""
    by_prompt: list[list[int]] = []
    for prompt in prompt_lengths:
        fitting = sorted({b for b in batch_sizes if b * prompt <= max_step_tokens})
        if fitting:
            by_prompt.append([fitting[0], *fitting[:0:-1][:1], *fitting[1:-1]])
    order: list[tuple[int, int, bool]] = []
    for round_ in range(max((len(b) for b in by_prompt), default=0)):
        for prompt, batches in zip(prompt_lengths, by_prompt, strict=False):
            if round_ < len(batches):
                batch = batches[round_]
                order += [(batch, prompt, False)] + ([(batch, prompt, True)] if batch > 1 else [])
    return order


def _build_engine(args: argparse.Namespace, cap: int) -> Engine:
    """Sets torch's threads and builds an engine whose scheduler admits up to ``cap`` sequences at once."""
    import torch

    from batchpilot_runtime.contract.window import Window
    from batchpilot_runtime.engine.engine import Engine

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    return Engine.build(
        model_name="calibrate",
        window=Window(target_batch_size=1, hard_cap=cap, max_wait_ms=0),
        preset=args.preset,
        checkpoint=args.checkpoint,
        kv_cache_tokens=args.kv_cache_tokens,
        device=args.device,
    )


class _Scenarios:
    """Runs batches of synthetic requests through the engine's scheduler and model, timing each step.

    Request ids stay unique across scenarios (``c1``, ``c2``, ...); recorded steps go to ``samples``.
    """

    def __init__(self, engine: Engine, decode_steps: int, repeats: int) -> None:
        self.scheduler, self.model, self.kv = engine.scheduler, engine.model, engine.kv
        self.decode_steps = decode_steps
        self.repeats = repeats
        self.samples: list[tuple[StepComposition, float]] = []
        self._counter = 0

    def run(self, batch: int, prompt: int, staggered: bool, record: bool) -> None:
        """``batch`` requests of ``prompt`` tokens; when staggered, every second one has a quarter of the
        prompt and joins after 3 steps: decodes of different context lengths (which the engine attends to
        in separate buckets) beside a prefill."""
        from batchpilot_runtime.replay.cost_model import StepComposition
        from batchpilot_runtime.scheduling.types import SchedRequest

        scheduler = self.scheduler
        vocab = self.model.config.vocab_size
        max_new = self.decode_steps + 1
        if batch * (prompt + max_new) > scheduler.capacity_tokens or prompt + max_new > scheduler.config.max_model_len:
            return
        now = time.monotonic()
        pending: list[SchedRequest] = []
        for i in range(batch):
            self._counter += 1
            counter = self._counter
            late = staggered and i % 2 == 1
            length = max(1, prompt // 4) if late else prompt
            tokens = tuple((counter * 31 + j * 7) % (vocab - 1) + 1 for j in range(length))
            request = SchedRequest(f"c{counter}", tokens, max_new, now)
            if late:
                pending.append(request)  # joins after a few decode steps, so prefill and decode mix
            else:
                scheduler.add_request(request)
        steps = 0
        while scheduler.has_unfinished or pending:
            if pending and steps == 3:
                for request in pending:
                    scheduler.add_request(request)
                pending = []
            started = time.perf_counter()
            plan = scheduler.schedule(time.monotonic())
            if plan.is_empty:
                break
            elapsed = self._timed_step(plan, started)
            steps += 1
            if record:
                self.samples.append((StepComposition.from_seqs(plan.seqs), elapsed))

    def _timed_step(self, plan: StepPlan, started: float) -> float:
        """Runs a step whose scheduling began at ``started`` (``perf_counter``); returns its seconds.

        The seconds are scheduling and batch building + the fastest of the repeated forwards + the update.
        """
        import torch

        from batchpilot_runtime.model.batch import ForwardBatch

        model, device = self.model, self.model.device
        forward_batch = ForwardBatch.build(plan.seqs, self.scheduler.config.kv_block_size, device)
        bookkeeping_s = time.perf_counter() - started
        # The forward is repeated (it rewrites the same K/V slots with the same values) and the
        # fastest run kept: on a shared machine the minimum is the step's cost, the rest is noise.
        forward_s = float("inf")
        spent_s = 0.0
        with torch.inference_mode():
            for _ in range(self.repeats):
                if spent_s > REPEAT_BUDGET_S:
                    break  # a long step: the noise is a small share of it, and repeats cost minutes
                forward_started = time.perf_counter()
                logits = model(forward_batch, self.kv)
                tokens_out = logits.argmax(dim=-1).tolist()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                forward_s = min(forward_s, time.perf_counter() - forward_started)
                spent_s += time.perf_counter() - forward_started
        update_started = time.perf_counter()
        sampling = [seq.request_id for seq in plan.seqs if seq.sample]
        self.scheduler.update_from_output(plan, dict(zip(sampling, tokens_out, strict=True)), time.monotonic())
        return bookkeeping_s + forward_s + (time.perf_counter() - update_started)
