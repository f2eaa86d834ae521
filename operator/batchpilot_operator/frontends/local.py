"""``batchpilot-operator local``: the embedded default, no cluster.

Profiles come from YAML files, runtimes from the command line, metrics from a
Prometheus URL or, without one, straight from the runtimes' ``/metrics``. The
very same :class:`Controller` runs: same policy, same pushes. Status lives in
memory (and in ``--status-file`` when given, rewritten after every tick and
ahead of every push of a new window); every decision and every push failure is
printed.

The status file is what a cluster keeps in each BatchProfile's status, so a
restart with the same file resumes as the cluster path does (see
:func:`read_status_file` and :func:`add_profiles`): the window in force and its
generation, the policy's memory (the cooldown included), and a canary left
running ended and reported. Each entry is the profile's status plus ``spec``,
the spec it was written for, standing in for ``metadata.generation``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from batchpilot_operator.api.kinds import EngineKind
from batchpilot_operator.api.manifests import LoadedProfile, load_profiles
from batchpilot_operator.control.controller import Controller, PodRecord, ProfileRecord, ProfileRef, Settings
from batchpilot_operator.control.engine_knobs import describe_settings, engine_settings
from batchpilot_operator.control.settings import DEFAULT_SETTINGS
from batchpilot_operator.control.status import apply_merge_patch
from batchpilot_operator.io.engine_metrics import ENGINES
from batchpilot_operator.io.opmetrics import OperatorMetrics
from batchpilot_operator.io.push import AdminClient
from batchpilot_operator.tuning import policy as policy_mod

RUNTIME_KEYS = ("model", "url", "admin", "token-file", "name", "engine", "engine-url")

log = logging.getLogger("batchpilot.operator")


@dataclass(frozen=True)
class RuntimeSpec:
    model: str
    url: str  # serving base URL (its /metrics is scraped)
    admin: str  # admin base URL
    token: str | None
    name: str
    engine: str = EngineKind.BATCHPILOT
    engine_url: str = ""  # llamacpp: llama-server's base URL, whose /metrics is scraped beside the gate's


def parse_runtime(text: str, index: int = 0) -> RuntimeSpec:
    """``model=NAME,url=SERVE_URL,admin=ADMIN_URL,token-file=PATH[,name=NAME][,engine=KIND][,engine-url=URL]``;
    errors name the key.

    ``engine`` is batchpilot (the default), vllm, sglang or llamacpp. batchpilot's runtime and llamacpp need
    ``admin=``: for llamacpp ``url=`` and ``admin=`` are batchpilot-gate's (in front of llama-server), and
    ``engine-url=`` is llama-server's own, whose ``/metrics`` is read too (an SGLang server takes its live
    settings on its serving port)."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--runtime {text!r}: expected KEY=VALUE pairs separated by commas, got {part!r}")
        if key not in RUNTIME_KEYS:
            raise ValueError(f"--runtime {text!r}: unknown key {key!r} (known: {', '.join(RUNTIME_KEYS)})")
        fields[key] = value.strip()
    engine = fields.get("engine") or EngineKind.BATCHPILOT
    if engine not in ENGINES:
        raise ValueError(f"--runtime {text!r}: unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    if engine == EngineKind.SGLANG:
        fields.setdefault("admin", fields.get("url", ""))
    for required in (
        ("model", "url", "admin") if engine in (EngineKind.BATCHPILOT, EngineKind.LLAMACPP) else ("model", "url")
    ):
        if not fields.get(required):
            raise ValueError(f"--runtime {text!r}: {required}= is required")
    if fields.get("engine-url") and engine != EngineKind.LLAMACPP:
        raise ValueError(f"--runtime {text!r}: engine-url= is for engine=llamacpp (the engine behind the gate)")
    for key in ("url", "admin", "engine-url"):
        if key not in fields or (key == "admin" and not fields[key]):
            continue
        if not fields[key].startswith(("http://", "https://")):
            raise ValueError(f"--runtime {text!r}: {key}= must be an http(s) URL, got {fields[key]!r}")
        try:
            httpx.URL(fields[key])
        except httpx.InvalidURL as error:
            raise ValueError(
                f"--runtime {text!r}: {key}= is not a valid URL ({error}); an IPv6 address goes in brackets, "
                "e.g. http://[::1]:8081"
            ) from None
    token = None
    if fields.get("token-file"):
        path = Path(fields["token-file"])
        if not path.is_file():
            raise ValueError(f"--runtime {text!r}: token-file {path} does not exist")
        token = path.read_text().strip()
    return RuntimeSpec(
        model=fields["model"],
        url=fields["url"].rstrip("/"),
        admin=fields.get("admin", "").rstrip("/"),
        token=token,
        name=fields.get("name") or f"{fields['model']}-{index}",
        engine=engine,
        engine_url=fields.get("engine-url", "").rstrip("/"),
    )


# The key of each status file entry that holds the spec its status was written for (not a status field).
SPEC_KEY = "spec"


def read_status_file(path: Path | None) -> dict[str, dict[str, Any]]:
    """The entries of ``--status-file`` by profile key; none when no file is given or it does not exist yet
    (a first start).

    A file that cannot be read, or is not a JSON object of objects, is a ``ValueError`` naming it, never a
    fresh start: starting afresh would push every profile's starting window over its tuned one, forget
    the cooldowns, and then overwrite the file. The file is only ever replaced whole (see
    :meth:`LocalSink.write_file`), so a torn write by this command cannot cause it; to start afresh on
    purpose, move the file away."""
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"--status-file {path}: cannot be read as JSON ({error}); move it away to start afresh"
        ) from None
    if not isinstance(data, dict) or not all(isinstance(entry, dict) for entry in data.values()):
        raise ValueError(
            f"--status-file {path}: not a status file (expected a JSON object of each profile's status by "
            "namespace/name); move it away to start afresh"
        )
    return data


class LocalSink:
    """Status in memory (optionally mirrored to a JSON file, with each profile's spec); Events printed.

    ``saved``: the status file's entries (:func:`read_status_file`), which the status starts from; entries
    of profiles this run does not manage are written back as they were."""

    def __init__(
        self,
        out: TextIO = sys.stdout,
        status_file: Path | None = None,
        saved: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.out = out
        self.status: dict[str, dict[str, Any]] = {}
        self.specs: dict[str, Any] = {}  # profile key -> the spec its status was written for
        for key, entry in (saved or {}).items():
            self.status[key] = {k: v for k, v in entry.items() if k != SPEC_KEY}
            if SPEC_KEY in entry:
                self.specs[key] = entry[SPEC_KEY]
        self.status_file = status_file

    async def patch_status(self, ref: ProfileRef, patch: Mapping[str, Any]) -> None:
        self.status[ref.key] = apply_merge_patch(self.status.get(ref.key), patch)
        if "window" in patch or "policy" in patch or "canary" in patch:
            # Written ahead of the push, as the cluster's status is: a kill before the tick ends leaves a
            # file its successor continues from.
            self.write_file()

    async def event(self, ref: ProfileRef, type_: str, reason: str, message: str) -> None:
        if reason.startswith("Decision"):
            return  # decisions are printed by on_decision, with more detail
        self.out.write(f"{_now()} {ref.key} {type_} {reason}: {message}\n")
        self.out.flush()

    async def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        raise LookupError("local mode has no Secrets: give the runtime's token with --runtime ...,token-file=PATH")

    def write_file(self) -> None:
        if self.status_file is None:
            return
        entries = {key: {**status, **({SPEC_KEY: self.specs[key]} if key in self.specs else {})}
                   for key, status in self.status.items()}  # fmt: skip
        tmp = self.status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
        os.replace(tmp, self.status_file)


def _now() -> str:
    return time.strftime("%H:%M:%S")


def print_decision(out: TextIO, output: str = "text") -> Any:
    """A decision callback writing one line per decision: text for people, or a JSON object
    (``time``, ``profile``, ``model``, ``engine``, ``mode``, ``direction``, ``window``, ``reason``, and for
    vLLM and SGLang ``engineSettings``: the window as the engine's flags or server args)."""

    def on_decision(record: ProfileRecord, decision: policy_mod.Decision) -> None:
        mode = record.spec.mode.value if record.spec else "?"
        engine = record.spec.engine.value if record.spec else EngineKind.BATCHPILOT.value
        direction = decision.direction if mode not in ("recommend", "restart") or not decision.changed else "recommend"
        # The window in the engine's own settings (vLLM's flags, SGLang's server args); none for batchpilot.
        settings = engine_settings(engine, decision.window)
        if output == "json":
            line = json.dumps(
                {
                    "time": _now(),
                    "profile": record.ref.key,
                    "model": record.model,
                    "engine": engine,
                    "mode": mode,
                    "direction": direction,
                    "window": decision.window.model_dump(mode="json", by_alias=True),
                    **({"engineSettings": settings} if settings else {}),
                    "reason": decision.reason,
                }
            )
        else:
            in_engine = f" ({engine}: {describe_settings(settings)})" if settings else ""
            line = (
                f"{_now()} {record.ref.key} model={record.model} mode={mode} {direction}: "
                f"{decision.window.describe()}{in_engine} - {decision.reason}"
            )
        out.write(line + "\n")
        out.flush()

    return on_decision


async def run_local(
    profiles_path: Path,
    runtimes: Sequence[RuntimeSpec],
    *,
    prometheus_url: str | None = None,
    interval_s: float | None = None,
    scrape_interval_s: float = DEFAULT_SETTINGS.scrape_interval_s,
    push_timeout_s: float = 2.0,
    query_timeout_s: float = 3.0,
    duration_s: float | None = None,
    status_file: Path | None = None,
    metrics_port: int = 0,
    output: str = "text",
    out: TextIO = sys.stdout,
) -> int:
    loaded = load_profiles(profiles_path)
    if not loaded:
        raise ValueError(f"--profiles {profiles_path}: no BatchProfile found")
    _check_engines(loaded, runtimes)
    saved = read_status_file(status_file)
    sink = LocalSink(out, status_file, saved)
    metrics = OperatorMetrics()
    metrics.serve(metrics_port, "127.0.0.1")
    source = _metrics_source(prometheus_url, interval_s, scrape_interval_s, query_timeout_s)
    admin = AdminClient(timeout_s=push_timeout_s)
    controller = Controller(
        Settings(tick_s=min(1.0, interval_s or 1.0), interval_override_s=interval_s),
        source,
        admin,
        sink,
        metrics=metrics,
        match_by_model=True,
        on_decision=print_decision(out, output),
    )
    _add_runtimes(controller, runtimes)
    add_profiles(controller, loaded, sink, out)
    out.write(
        f"{_now()} local mode: {len(loaded)} profile(s), {len(runtimes)} runtime(s), metrics from "
        f"{prometheus_url or 'the runtimes /metrics'}\n"
    )
    out.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    deadline = time.monotonic() + duration_s if duration_s else None
    try:
        await _tick_until(controller, sink, stop, deadline)
    finally:
        await controller.drain_events()
        await admin.aclose()
        await controller.sglang.client.aclose()
        if prometheus_url:
            source.close()
        else:
            await source.aclose()
    return 0


def _metrics_source(
    prometheus_url: str | None, interval_s: float | None, scrape_interval_s: float, query_timeout_s: float
) -> Any:
    """Prometheus when a URL is given, else a scrape of the runtimes' own ``/metrics``."""
    if prometheus_url:
        from batchpilot_operator.io.promql import PrometheusSource

        return PrometheusSource(
            prometheus_url,
            scrape_interval_s=scrape_interval_s,
            interval_s=interval_s or 15.0,
            timeout_s=query_timeout_s,
            namespace_label=None,
        )
    from batchpilot_operator.io.scrape import ScrapeSource

    return ScrapeSource(rate_window_s=interval_s or 15.0, timeout_s=query_timeout_s)


def _check_engines(loaded: Sequence[LoadedProfile], runtimes: Sequence[RuntimeSpec]) -> None:
    """A runtime's engine= must be its profiles' spec.engine: the names the metrics are read by, and the
    way a window reaches it, follow from it."""
    for profile in loaded:
        if profile.spec is None:
            continue
        for runtime in runtimes:
            if runtime.model == profile.spec.model and runtime.engine != profile.spec.engine.value:
                raise ValueError(
                    f"--runtime {runtime.name} (model {runtime.model}) has engine={runtime.engine}, but profile "
                    f"{profile.key} names spec.engine {profile.spec.engine.value}: give the runtime "
                    f"engine={profile.spec.engine.value}"
                )


def _add_runtimes(controller: Controller, runtimes: Sequence[RuntimeSpec]) -> None:
    """Each runtime as a Ready pod of namespace ``local``, matched to profiles by model."""
    for runtime in runtimes:
        controller.upsert_pod(
            PodRecord(
                namespace="local",
                name=runtime.name,
                ready=True,
                admin_url=runtime.admin or None,  # vLLM has no admin API: nothing is read or sent
                metrics_url=f"{runtime.url}/metrics",
                engine_metrics_url=f"{runtime.engine_url}/metrics" if runtime.engine_url else None,
                model=runtime.model,
                token=runtime.token,
                uid=runtime.name,
            )
        )


def add_profiles(controller: Controller, loaded: Sequence[LoadedProfile], sink: LocalSink, out: TextIO) -> None:
    """Every profile, adopted as the cluster path adopts a BatchProfile: with the status kept in the status
    file (``sink.status``), at the generation it was written for. An invalid one is printed and still added
    (the controller keeps its error).

    A spec that differs from the one its status was written for takes the next generation, and is applied
    as a change to that spec: the status is adopted with the old spec first, so the controller's rule for a
    spec change under a running operator decides (a new spec.window is the new starting window; the
    policy's memory carries over, see policy_memo.carry_over). A restart across an edit of the file ends
    where an edit under a running operator would have. An entry without a spec (written before specs were
    kept) counts as written for this spec."""
    for profile in loaded:
        if profile.error:
            out.write(f"{_now()} {profile.key} INVALID: {profile.error}\n")
        namespace, name = profile.namespace, profile.name or "?"
        key = f"{namespace}/{name}"
        spec = _plain(profile.manifest.get("spec"))
        status = sink.status.get(key)
        if status is None:
            controller.upsert_profile(namespace, name, spec, generation=1)
        else:
            generation = _saved_generation(status)
            written_for = sink.specs.get(key, spec)
            if written_for == spec:
                controller.upsert_profile(namespace, name, spec, generation=generation, status=status)
            else:
                controller.upsert_profile(namespace, name, written_for, generation=generation, status=status)
                controller.upsert_profile(namespace, name, spec, generation=generation + 1)
                out.write(f"{_now()} {key} spec changed since the status file was written: generation "
                          f"{generation + 1}\n")  # fmt: skip
            out.write(f"{_now()} {key} resumed from the status file: {_resumed(controller, key)}\n")
        sink.specs[key] = spec


def _plain(spec: Any) -> Any:
    """``spec`` as the status file holds it (JSON values), so that a spec read back compares equal."""
    return json.loads(json.dumps(spec, default=str))


def _saved_generation(status: Mapping[str, Any]) -> int:
    """The generation the saved status was written for (1 in files from before local mode kept one)."""
    generation = status.get("observedGeneration")
    return generation if type(generation) is int and generation >= 1 else 1


def _resumed(controller: Controller, key: str) -> str:
    """What a resumed profile starts from, for the printed line."""
    record = controller.profiles[key]
    window = record.loop.window
    return window.describe() if window is not None else "no window in force"


async def _tick_until(controller: Controller, sink: LocalSink, stop: asyncio.Event, deadline: float | None) -> None:
    """Tick every ``tick_s`` and rewrite the status file after each, until ``stop`` is set or the monotonic
    ``deadline`` has passed."""
    while not stop.is_set():
        try:
            await controller.tick()
        except Exception:  # as in Controller.run: the loop survives anything one tick does
            log.exception("tick failed")
        sink.write_file()
        if deadline is not None and time.monotonic() >= deadline:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=controller.settings.tick_s)


def cmd_local(args: Any) -> int:
    runtimes = [parse_runtime(text, i) for i, text in enumerate(args.runtime)]
    if not runtimes:
        raise ValueError("--runtime: give at least one runtime (model=NAME,url=SERVE_URL,admin=ADMIN_URL,...)")
    return asyncio.run(
        run_local(
            args.profiles,
            runtimes,
            prometheus_url=args.prometheus_url,
            interval_s=args.interval,
            scrape_interval_s=args.scrape_interval,
            push_timeout_s=args.push_timeout,
            query_timeout_s=args.query_timeout,
            duration_s=args.duration,
            status_file=args.status_file,
            metrics_port=args.metrics_port,
            output=args.output,
        )
    )
