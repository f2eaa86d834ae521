"""Open-loop load generation: replay a trace against runtimes and summarize what they did.

Each trace request is sent at its (scaled) arrival time whatever the state of earlier ones,
and its latencies are measured from that intended time, so that a slow server cannot hide
its queueing by slowing the sender (no coordinated omission). Prompts are synthesized as
token-id lists of the trace's (scaled) length, deterministic from a seed; every request is
streamed so that the time to the first token is seen by the client.

``run_load`` is the library entry point (the CLI, the operator's integration tests and the
demo use it); everything else here is pure and unit-tested.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from batchpilot_runtime.contract.admin_api import LANE_HEADER
from batchpilot_runtime.replay.trace import TraceRequest, TraceScaling

Fanout = Literal["each", "round-robin"]
OUTCOMES = (
    "completed",
    "rejected_429",
    "rejected_503",
    "client_error",
    "server_error",
    "transport_error",
    "incomplete",
)
# Printable ASCII: valid token ids for the byte tokenizer and for any larger vocabulary.
DEFAULT_TOKEN_ID_RANGE = (32, 127)


@dataclass(frozen=True)
class Endpoint:
    """A runtime's serving URL, the model name to send (looked up from /v1/models when None) and a lane."""

    url: str
    model: str | None = None
    lane: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Endpoint:
        """``URL[,model=NAME][,lane=LANE]``."""
        url, *options = (part.strip() for part in spec.split(","))
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint {spec!r}: expected an http(s) URL first, e.g. http://127.0.0.1:8000")
        values: dict[str, str] = {}
        for option in options:
            key, eq, value = option.partition("=")
            if not eq or key not in ("model", "lane") or not value:
                raise ValueError(f"--endpoint {spec!r}: unknown option {option!r}; use model=NAME or lane=LANE")
            values[key] = value
        return cls(url=url.rstrip("/"), model=values.get("model"), lane=values.get("lane"))


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    endpoint: int
    send_at_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class RequestResult:
    index: int
    endpoint: int
    outcome: str
    status: int | None
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    send_lag_s: float
    detail: str | None = None
    # Seconds between successive streamed chunks that carry text (a token each, for the engines the
    # project serves: vLLM, SGLang, llama-server, this runtime).
    inter_token_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class LatencyStats:
    count: int
    mean_s: float | None
    p50_s: float | None
    p99_s: float | None
    p999_s: float | None
    max_s: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            return cls(0, None, None, None, None, None)
        ordered = sorted(values)
        return cls(
            count=len(ordered),
            mean_s=sum(ordered) / len(ordered),
            p50_s=percentile(ordered, 50.0),
            p99_s=percentile(ordered, 99.0),
            p999_s=percentile(ordered, 99.9),
            max_s=ordered[-1],
        )


@dataclass(frozen=True)
class Throughput:
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    completed_requests_per_s: float


@dataclass(frozen=True)
class LoadSummary:
    """What a replay measured. ``accepted = completed + server_error + incomplete`` (answered 200)."""

    duration_s: float
    requests_sent: int
    outcomes: dict[str, int]
    throughput: Throughput
    ttft: LatencyStats
    e2e: LatencyStats
    inter_token: LatencyStats  # every gap between two chunks of a completed request
    output_tokens: int
    prompt_tokens: int
    max_send_lag_s: float
    scaling: dict[str, Any]
    endpoints: list[dict[str, Any]]
    results: list[RequestResult] = field(default_factory=list, repr=False)

    def to_dict(self, include_results: bool = False) -> dict[str, Any]:
        data = asdict(self)
        if not include_results:
            data.pop("results")
        return data

    def to_json(self, include_results: bool = False) -> str:
        return json.dumps(self.to_dict(include_results), indent=2)


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, interpolating linearly between ranks."""
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be within 0..100, got {q}")
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def synth_prompt(length_tokens: int, rng: random.Random, token_id_range: tuple[int, int]) -> tuple[int, ...]:
    low, high = token_id_range
    return tuple(rng.randrange(low, high) for _ in range(length_tokens))


def plan_requests(
    trace: Sequence[TraceRequest],
    num_endpoints: int,
    *,
    fanout: Fanout = "each",
    seed: int = 0,
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE,
) -> list[PlannedRequest]:
    """The requests to send, in sending order. ``each``: every endpoint gets the whole trace (the same
    arrivals for every model); ``round-robin``: the trace is spread over the endpoints (replicas)."""
    if num_endpoints < 1:
        raise ValueError("at least one endpoint is needed")
    low, high = token_id_range
    if not 0 <= low < high:
        raise ValueError(f"token_id_range must satisfy 0 <= low < high, got {token_id_range}")
    planned: list[PlannedRequest] = []
    for position, request in enumerate(trace):
        # One generator per trace request: the prompt does not depend on the endpoints or the fanout.
        prompt = synth_prompt(request.prompt_tokens, random.Random(f"{seed}:{position}"), token_id_range)
        targets = range(num_endpoints) if fanout == "each" else (position % num_endpoints,)
        for endpoint in targets:
            planned.append(
                PlannedRequest(len(planned), endpoint, request.arrival_s, prompt, max(1, request.output_tokens))
            )
    planned.sort(key=lambda p: (p.send_at_s, p.index))
    return planned


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    endpoints: Sequence[Endpoint],
    scaling: dict[str, Any] | None = None,
) -> LoadSummary:
    outcomes = dict.fromkeys(OUTCOMES, 0)
    for result in results:
        outcomes[result.outcome] = outcomes.get(result.outcome, 0) + 1
    completed = [r for r in results if r.outcome == "completed"]
    output_tokens = sum(r.output_tokens for r in completed)
    prompt_tokens = sum(r.prompt_tokens for r in completed)
    span_s = max(duration_s, 1e-9)
    per_endpoint = []
    for position, endpoint in enumerate(endpoints):
        mine = [r for r in results if r.endpoint == position]
        done = [r for r in mine if r.outcome == "completed"]
        per_endpoint.append(
            {
                "url": endpoint.url,
                "model": endpoint.model,
                "lane": endpoint.lane,
                "requests": len(mine),
                "outcomes": {o: sum(1 for r in mine if r.outcome == o) for o in OUTCOMES},
                "output_tokens_per_s": sum(r.output_tokens for r in done) / span_s,
                "ttft": asdict(LatencyStats.of([r.ttft_s for r in done if r.ttft_s is not None])),
                "e2e": asdict(LatencyStats.of([r.e2e_s for r in done if r.e2e_s is not None])),
            }
        )
    return LoadSummary(
        duration_s=duration_s,
        requests_sent=len(results),
        outcomes=outcomes,
        throughput=Throughput(
            output_tokens_per_s=output_tokens / span_s,
            total_tokens_per_s=(output_tokens + prompt_tokens) / span_s,
            requests_per_s=len(results) / span_s,
            completed_requests_per_s=len(completed) / span_s,
        ),
        ttft=LatencyStats.of([r.ttft_s for r in completed if r.ttft_s is not None]),
        e2e=LatencyStats.of([r.e2e_s for r in completed if r.e2e_s is not None]),
        inter_token=LatencyStats.of([gap for r in completed for gap in r.inter_token_s]),
        output_tokens=output_tokens,
        prompt_tokens=prompt_tokens,
        max_send_lag_s=max((r.send_lag_s for r in results), default=0.0),
        scaling=scaling or {},
        endpoints=per_endpoint,
        results=list(results),
    )


async def resolve_models(client: httpx.AsyncClient, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """Fill in each endpoint's model from its /v1/models when not given."""
    resolved = []
    for endpoint in endpoints:
        if endpoint.model is None:
            try:
                response = await client.get(f"{endpoint.url}/v1/models")
                response.raise_for_status()
                model = str(response.json()["data"][0]["id"])
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
                raise ValueError(f"{endpoint.url}: cannot read the model name from /v1/models ({error})") from None
            endpoint = Endpoint(endpoint.url, model, endpoint.lane)
        resolved.append(endpoint)
    return resolved


async def _send(
    client: httpx.AsyncClient, endpoint: Endpoint, planned: PlannedRequest, intended_s: float, seed: int
) -> RequestResult:
    """One streamed completion; latencies from the intended send time (``time.perf_counter`` clock)."""
    send_lag_s = max(0.0, time.perf_counter() - intended_s)
    body: dict[str, Any] = {
        "model": endpoint.model,
        "prompt": list(planned.prompt_token_ids),
        "max_tokens": planned.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # the trace fixes the output length; an early EOS would shorten it
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": seed,
    }
    headers = {LANE_HEADER: endpoint.lane} if endpoint.lane else {}

    def result(
        outcome: str,
        status: int | None,
        output_tokens: int = 0,
        ttft_s: float | None = None,
        e2e_s: float | None = None,
        detail: str | None = None,
    ) -> RequestResult:
        return RequestResult(
            planned.index,
            planned.endpoint,
            outcome,
            status,
            len(planned.prompt_token_ids),
            output_tokens,
            ttft_s,
            e2e_s,
            send_lag_s,
            detail,
            tuple(gaps_s),
        )

    ttft_s: float | None = None
    last_chunk_s = 0.0
    gaps_s: list[float] = []
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", f"{endpoint.url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                status = response.status_code
                outcome = {429: "rejected_429", 503: "rejected_503"}.get(
                    status, "client_error" if status < 500 else "server_error"
                )
                return result(outcome, status, detail=text)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    e2e_s = time.perf_counter() - intended_s
                    tokens = usage_tokens if usage_tokens is not None else chunks
                    return result("completed", 200, tokens, ttft_s, e2e_s)
                payload = json.loads(data)
                if "error" in payload:
                    return result("server_error", 200, chunks, ttft_s, detail=str(payload["error"])[:300])
                if payload.get("choices"):
                    now_s = time.perf_counter()
                    if ttft_s is None:
                        ttft_s = now_s - intended_s
                    elif payload["choices"][0].get("text"):  # not a closing chunk that only says why it ended
                        gaps_s.append(now_s - last_chunk_s)
                    last_chunk_s = now_s
                    chunks += 1
                if payload.get("usage"):
                    usage_tokens = int(payload["usage"]["completion_tokens"])
            return result("incomplete", 200, chunks, ttft_s, detail="stream ended without [DONE]")
    except httpx.HTTPError as error:
        return result("transport_error", None, chunks, ttft_s, detail=f"{type(error).__name__}: {error}"[:300])
    except (ValueError, KeyError, TypeError) as error:
        return result("server_error", 200, chunks, ttft_s, detail=f"unreadable stream: {error}"[:300])


class _Progress:
    """A rich progress bar on stderr, or nothing when disabled or not on a terminal."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._progress: Any = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("replay"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._task = self._progress.add_task("", total=total)
        self._counts: dict[str, int] = {}

    def __enter__(self) -> _Progress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, result: RequestResult) -> None:
        self._counts[result.outcome] = self._counts.get(result.outcome, 0) + 1
        if self._progress is not None:
            text = " ".join(f"{k}={v}" for k, v in sorted(self._counts.items()))
            self._progress.update(self._task, advance=1, description=text)


async def run_load(
    endpoints: Sequence[Endpoint | str],
    trace: Sequence[TraceRequest],
    *,
    fanout: Fanout = "each",
    seed: int = 0,
    scaling: TraceScaling | None = None,
    request_timeout_s: float = 600.0,
    max_connections: int = 1024,
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE,
    progress: bool = False,
    on_result: Callable[[RequestResult], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    notes: Mapping[str, Any] | None = None,
) -> LoadSummary:
    """Replay ``trace`` (already scaled) against ``endpoints`` and return what was measured.

    ``on_result`` is called as each request ends (e.g. to drive a live view); ``transport``
    replaces the network (tests); ``notes`` are added to the summary's ``scaling`` (e.g. a target rate).
    """
    parsed = [e if isinstance(e, Endpoint) else Endpoint.parse(e) for e in endpoints]
    plan = plan_requests(trace, len(parsed), fanout=fanout, seed=seed, token_id_range=token_id_range)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=min(max_connections, 256))
    results: list[RequestResult] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        resolved = await resolve_models(client, parsed)
        with _Progress(progress, len(plan)) as bar:

            async def send(planned: PlannedRequest, intended_s: float) -> None:
                outcome = await _send(client, resolved[planned.endpoint], planned, intended_s, seed)
                results.append(outcome)
                bar.advance(outcome)
                if on_result is not None:
                    on_result(outcome)

            start_s = time.perf_counter()
            tasks = []
            # 1. Send each request at its arrival time (open loop), never waiting for earlier ones.
            for planned in plan:
                intended_s = start_s + planned.send_at_s
                delay_s = intended_s - time.perf_counter()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                tasks.append(asyncio.create_task(send(planned, intended_s)))
            # 2. Wait for every answer.
            await asyncio.gather(*tasks)
            duration_s = time.perf_counter() - start_s
    results.sort(key=lambda r: r.index)
    report = _scaling_report(scaling, fanout, len(parsed))
    report.update(notes or {})
    return summarize(results, duration_s, resolved, report)


def _scaling_report(scaling: TraceScaling | None, fanout: Fanout, num_endpoints: int) -> dict[str, Any]:
    report: dict[str, Any] = {"fanout": fanout, "endpoints": num_endpoints}
    if scaling is not None:
        report.update(scaling.as_dict())
        report["description"] = scaling.describe()
    return report
