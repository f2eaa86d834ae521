"""The I/O half of ``bench_live``: the servers one probe runs against, started fresh for it.

- ``batchpilot``: ``batchpilot-runtime serve`` with a window (the SmolLM2 GGUF, or ``--preset tiny``);
- ``llamacpp``: llama.cpp's ``llama-server`` behind ``batchpilot-gate`` (both processes), the gate's
  window in front of llama-server's slots;
- with ``adaptive``, ``batchpilot-operator local`` beside them, retuning the window of the runtime or of the
  gate from a dual-SLO profile, its status file read back when the probe ends.

Every server is a process of its own (none shares the load generator's interpreter), started fresh per
probe: llama-server keeps each slot's prompt cached, and a runtime's queue or an operator's history
must not carry over from one load to the next.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.server.ready import RuntimeInfo
from tests.integration.llama_server_process import llama_server, llama_server_args
from tests.integration.runtime_process import runtime_process, wait_until

MODEL = "smollm2"
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class EngineSetup:
    """How one engine is started on this host; ``tiny`` swaps the real model for the runtime's tiny preset
    (the tests' two-probe search)."""

    engine: str  # "batchpilot" | "llamacpp"
    threads: int = 1
    tiny: bool = False
    slot_ctx: int = 1024  # llama-server's context per slot
    max_slots: int = 16  # llama-server's --parallel under the adaptive gate; the gate's --max-hard-cap

    def __post_init__(self) -> None:
        if self.engine not in ("batchpilot", "llamacpp"):
            raise ValueError(f"engine must be batchpilot or llamacpp, got {self.engine!r}")
        if self.tiny and self.engine != "batchpilot":
            raise ValueError("the tiny preset is the batchpilot runtime's")


@dataclass(frozen=True)
class Served:
    """A policy's setting of the engine: a window, llama-server's slots (None: its defaults), adaptive or not."""

    label: str
    window: Window
    slots: int | None = None
    adaptive: bool = False


@dataclass
class Running:
    url: str
    operator_dir: Path | None = None
    step_log: Path | None = None  # the runtime's --step-log (every step it ran), once it has stopped
    notes: dict[str, Any] = field(default_factory=dict)

    def operator_report(self) -> dict[str, Any]:
        """What the operator decided: its lines by direction (its log) and its window and last decision as
        its status file has them when the probe ends."""
        if self.operator_dir is None:
            return {}
        log = (self.operator_dir / "operator.log").read_text(errors="replace")
        directions: dict[str, int] = {}
        for found in _DECISION.finditer(log):
            directions[found.group(1)] = directions.get(found.group(1), 0) + 1
        report: dict[str, Any] = {"decisions": directions}
        status_path = self.operator_dir / "status.json"
        if status_path.exists():
            entries = json.loads(status_path.read_text())  # replaced whole (os.replace), never half-written
            status: dict[str, Any] = next(iter(entries.values()), {})
            report["final_window"] = status.get("window")
            report["last_decision"] = status.get("lastDecision")
        return report


_DECISION = re.compile(r" mode=adaptive ([a-z-]+): ")


def runtime_flags(window: Window) -> list[str]:
    flags = ["--target-batch-size", str(window.target_batch_size), "--hard-cap", str(window.hard_cap),
             "--max-wait-ms", str(window.max_wait_ms), "--max-queue", "4096"]  # fmt: skip
    if window.max_prefill_tokens is not None:
        flags += ["--max-prefill-tokens", str(window.max_prefill_tokens)]
    return flags


@contextmanager
def _child(command: list[str], log_path: Path, what: str, written: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` as a process logging to ``log_path``, once it has written ``written`` (its ready or status
    file); an error with the log's end if it exits first. Terminated (killed after 30 s) on the way out."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited with {process.returncode}: {log_path.read_text()[-3000:]}")
            return written.exists()

        wait_until(ready, START_TIMEOUT_S, f"{what} to write {written.name}", interval_s=0.05)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


@contextmanager
def gate_process(workdir: Path, upstream: str, window: Window, max_hard_cap: int) -> Iterator[RuntimeInfo]:
    workdir.mkdir(parents=True, exist_ok=True)
    token_file, ready_file = workdir / "gate-token", workdir / "gate.ready.json"
    token_file.write_text(secrets.token_urlsafe(24) + "\n")
    token_file.chmod(0o600)
    command = [sys.executable, "-m", "batchpilot_runtime.gate.cli", "--upstream", upstream, "--model-name", MODEL,
               "--port", "0", "--admin-port", "0", "--ready-file", str(ready_file), "--admin-token-file",
               str(token_file), "--target-batch-size", str(window.target_batch_size), "--hard-cap",
               str(window.hard_cap), "--max-wait-ms", str(window.max_wait_ms), "--max-hard-cap", str(max_hard_cap),
               "--max-queue", "4096", "--engine-metrics", "/metrics", "--log-level", "warning"]  # fmt: skip
    with _child(command, workdir / "gate.log", "the gate", ready_file):
        yield RuntimeInfo.read(ready_file)


def profile(setup: EngineSetup, served: Served, slo_ms: tuple[float, float], interval_s: int) -> dict[str, Any]:
    """The BatchProfile the operator tunes: dual SLO, starting at the policy's window, bounded by what the
    engine can apply live (llama-server's slots through the gate; no prompt budget there)."""
    window = served.window
    start: dict[str, Any] = {"targetBatchSize": window.target_batch_size, "hardCap": window.hard_cap,
                             "maxWaitMs": window.max_wait_ms}  # fmt: skip
    cap_max = setup.max_slots if setup.engine == "llamacpp" else 256
    bounds: dict[str, Any] = {"hardCap": {"min": 1, "max": cap_max}, "targetBatchSize": {"min": 1, "max": cap_max}}
    if setup.engine == "batchpilot" and window.max_prefill_tokens is not None:
        start["maxPrefillTokens"] = window.max_prefill_tokens
        bounds["maxPrefillTokens"] = {"min": 16, "max": 16_384}
    slo: dict[str, Any] = {"latencyMetric": "ttft", "p99Ms": slo_ms[0]}
    if setup.engine == "batchpilot":
        # The operator refuses an inter-token target for llama-server behind the gate: only the prompt budget
        # bounds a gap, and --batch-size is a start-up flag. There it tunes for the first token alone, and the
        # probe still judges both tails.
        slo["interTokenP99Ms"] = slo_ms[1]
    spec: dict[str, Any] = {
        "model": MODEL,
        "selector": {"matchLabels": {"app": MODEL}},
        "window": start,
        "slo": slo,
        # The simulator's replays run 15-s intervals and a 30-s cooldown over 10-30 minutes; a probe lasts
        # about a minute, so both shrink with it.
        "tuning": {"mode": "adaptive", "intervalSeconds": interval_s, "cooldownSeconds": 2 * interval_s,
                   "maxStepFraction": 0.5, "bounds": bounds},
    }  # fmt: skip
    if setup.engine == "llamacpp":
        spec["engine"] = "llamacpp"
    return {"apiVersion": "batchpilot.dev/v1alpha1", "kind": "BatchProfile",
            "metadata": {"name": MODEL, "namespace": "bench"}, "spec": spec}  # fmt: skip


@contextmanager
def local_operator(
    workdir: Path, spec: dict[str, Any], runtime: str, interval_s: float
) -> Iterator[subprocess.Popen[bytes]]:
    workdir.mkdir(parents=True, exist_ok=True)
    profiles, status = workdir / "profiles.yaml", workdir / "status.json"
    profiles.write_text(yaml.safe_dump(spec))
    command = [sys.executable, "-m", "batchpilot_operator.cli.main", "local", "--profiles", str(profiles),
               "--runtime", runtime, "--interval", str(interval_s), "--status-file", str(status)]  # fmt: skip
    with _child(command, workdir / "operator.log", "the operator", status) as process:
        refused = [c["message"] for entry in json.loads(status.read_text()).values()
                   for c in entry.get("conditions", []) if c.get("reason") == "InvalidSpec"]  # fmt: skip
        if refused:
            raise RuntimeError(f"the operator refused the benchmark's profile: {refused[0]}")
        yield process


@contextmanager
def serving(
    setup: EngineSetup, served: Served, workdir: Path, slo_ms: tuple[float, float], interval_s: int
) -> Iterator[Running]:
    """The engine as ``served`` sets it, fresh, with the operator when adaptive; yields where to send load."""
    with ExitStack() as stack:
        if setup.engine == "batchpilot":
            model = ("--preset", "tiny") if setup.tiny else ("--checkpoint", "smollm2-135m-instruct")
            flags = (*model, "--threads", str(setup.threads), *runtime_flags(served.window))
            step_log = workdir / "steps.jsonl"
            runtime = stack.enter_context(runtime_process(workdir, *flags, "--step-log", str(step_log),
                                                          model_name=MODEL, timeout_s=START_TIMEOUT_S))  # fmt: skip
            url, admin, token_file = runtime.serve_url, runtime.admin_url, runtime.info.admin_token_file
            running = Running(url, step_log=step_log, notes={"command": ["batchpilot-runtime", "serve", *flags]})
            engine_part = ""
        else:
            slots = served.slots
            args = (["--metrics", "--threads", str(setup.threads)] if slots is None  # llama-server's defaults
                    else llama_server_args(parallel=slots, ctx_size=slots * setup.slot_ctx, threads=setup.threads))  # fmt: skip
            server = stack.enter_context(llama_server(workdir, args, name="llama-server"))
            gate = stack.enter_context(
                gate_process(workdir / "gate", server.url, served.window, max(served.window.hard_cap, slots or 0))
            )
            url, admin, token_file = gate.serve_url, gate.admin_url, gate.admin_token_file
            running = Running(url, notes={"command": ["llama-server", *args]})
            engine_part = f",engine=llamacpp,engine-url={server.url}"
        if served.adaptive:
            spec = profile(setup, served, slo_ms, interval_s)
            runtime_spec = f"model={MODEL},url={url},admin={admin},token-file={token_file},name={MODEL}-0{engine_part}"
            stack.enter_context(local_operator(workdir / "operator", spec, runtime_spec, interval_s))
            running.operator_dir = workdir / "operator"
        yield running
