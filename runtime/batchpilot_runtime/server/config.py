"""What ``batchpilot-runtime serve`` is asked to run, parsed and checked (no I/O, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from batchpilot_runtime.contract.admin_api import DEFAULT_ADMIN_PORT, DEFAULT_LANE, DEFAULT_SERVE_PORT, LaneWindow
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.engine.watchdog import DEFAULT_STALL_TIMEOUT_S

# Flag names of the window fields, so that an error names what the user typed.
_WINDOW_FLAG = {
    "targetBatchSize": "--target-batch-size",
    "hardCap": "--hard-cap",
    "maxWaitMs": "--max-wait-ms",
    "tailMarkRatio": "--tail-mark-ratio",
}
_LANE_KEYS = {
    "target": "target_batch_size",
    "cap": "hard_cap",
    "wait": "max_wait_ms",
    "tail": "tail_mark_ratio",
    "reserved": "reserved_slots",
}


@dataclass(frozen=True)
class ServeConfig:
    model_name: str
    window: Window
    lanes: tuple[LaneWindow, ...] = ()
    preset: str = "tiny"
    checkpoint: Path | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_SERVE_PORT
    admin_port: int = DEFAULT_ADMIN_PORT
    admin_token_file: Path | None = None
    kv_cache_tokens: int | None = None  # None: the engine's default (a memory fraction on CUDA)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    batching: Literal["continuous", "static"] = "continuous"
    max_queue: int = 1024
    max_prefill_tokens: int | None = None
    seed: int = 0
    device: str | None = None
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU (model/device.py)
    threads: int | None = None  # torch intra-op threads; None: torch's choice
    batch_invariant: bool = False  # bitwise-equal logits in any batch (model/kernels.py), slower
    ready_file: Path | None = None
    drain_timeout_s: float = 600.0
    engine_stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S  # pending requests without a step: /healthz fails
    log_level: str = "info"
    step_log: Path | None = None  # every engine step as a JSON line (server/step_log.py)
    extra: dict[str, str] = field(default_factory=dict)


def window_from_flags(target_batch_size: int, hard_cap: int, max_wait_ms: int, tail_mark_ratio: float) -> Window:
    """The starting window (generation 0); a ValueError names the offending flag."""
    try:
        return Window(
            target_batch_size=target_batch_size,
            hard_cap=hard_cap,
            max_wait_ms=max_wait_ms,
            tail_mark_ratio=tail_mark_ratio,
            generation=0,
        )
    except ValidationError as error:
        raise ValueError(_describe(error, _WINDOW_FLAG)) from None


def parse_lane(spec: str, default_window: Window) -> LaneWindow:
    """``NAME:target=2,cap=4,wait=5[,tail=2.0][,reserved=2]``; fields left out come from the default window
    (a target left out is lowered to the lane's cap when that is smaller)."""
    name, sep, rest = spec.partition(":")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"--lane {spec!r}: expected NAME:target=N,cap=N,wait=MS[,tail=R][,reserved=N]")
    if name == DEFAULT_LANE:
        raise ValueError(f"--lane: {DEFAULT_LANE!r} is the main window; set it with --target-batch-size etc.")
    values: dict[str, float | int] = {
        "target_batch_size": default_window.target_batch_size,
        "hard_cap": default_window.hard_cap,
        "max_wait_ms": default_window.max_wait_ms,
        "tail_mark_ratio": default_window.tail_mark_ratio,
        "reserved_slots": 0,
    }
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or key.strip() not in _LANE_KEYS:
            raise ValueError(f"--lane {name}: unknown field {key.strip()!r}; use {', '.join(_LANE_KEYS)}")
        target = _LANE_KEYS[key.strip()]
        try:
            values[target] = float(raw) if target == "tail_mark_ratio" else int(raw)
        except ValueError:
            raise ValueError(f"--lane {name}: {key.strip()}={raw!r} is not a number") from None
    given = {_LANE_KEYS[k.split("=", 1)[0].strip()] for k in rest.split(",") if "=" in k}
    if "target_batch_size" not in given:
        # A lane that only sets its cap gets a target that fits under it.
        values["target_batch_size"] = min(int(values["target_batch_size"]), int(values["hard_cap"]))
    reserved = int(values.pop("reserved_slots"))
    try:
        window = Window.model_validate(values)
        return LaneWindow(name=name, window=window, reserved_slots=reserved)
    except ValidationError as error:
        raise ValueError(f"--lane {name}: {_describe(error, {})}") from None


def _describe(error: ValidationError, flag_names: dict[str, str]) -> str:
    problems = []
    for item in error.errors(include_url=False):
        where = ".".join(flag_names.get(str(p), str(p)) for p in item["loc"]) or "window"
        problems.append(f"{where}: {item['msg']}")
    return "; ".join(problems)
