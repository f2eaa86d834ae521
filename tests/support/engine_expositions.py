"""vLLM's and SGLang's /metrics as those engines write them, for tests of the operator's engine kinds.

Both engines export through prometheus_client, so the fixture does too: the same metric names,
label names, histogram buckets and counter ``_total`` suffixes as their sources (see
:mod:`batchpilot_operator.io.engine_metrics` for the files), with the values a load would leave.
A fixture advances by simulated seconds (:meth:`EngineExposition.advance`); :func:`serving` serves it
on loopback, advanced by the wall clock at each scrape, for a real Prometheus to scrape.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# The buckets each engine's source declares.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)  # fmt: skip
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                      0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)  # fmt: skip
SGLANG_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800,
                      2400)  # fmt: skip
SGLANG_QUEUE_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300)


@dataclass
class Load:
    """What the engine goes through, per second: requests, each with these latencies (one value per
    request, cycled, so that a fraction of requests get each value) and these token counts."""

    requests_per_s: float = 10.0
    ttft_s: Sequence[float] = (0.3,)
    itl_s: Sequence[float] = (0.02,)
    queue_s: Sequence[float] = (0.05,)
    prompt_tokens: int = 200
    output_tokens: int = 50
    waiting: float = 0.0
    running: float = 8.0
    kv_usage: float = 0.4
    preemptions_per_s: float = 0.0


@dataclass
class EngineExposition:
    """One pod of ``engine`` (vllm or sglang) serving ``model``; ``legacy`` adds the older names a
    release exported beside the new ones (vLLM 0.11: time_per_output_token, gpu_cache_usage_perc),
    with different values, so that reading both would show."""

    engine: str
    model: str
    load: Load = field(default_factory=Load)
    legacy: bool = False
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _carry: float = 0.0
    _served: int = 0

    def __post_init__(self) -> None:
        if self.engine == "vllm":
            self._vllm()
        elif self.engine == "sglang":
            self._sglang()
        else:
            raise ValueError(f"no exposition fixture for engine {self.engine!r}")

    def _vllm(self) -> None:
        names = ["model_name", "engine"]
        values = [self.model, "0"]
        r = self.registry

        def hist(name: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, name, names, buckets=buckets, registry=r).labels(*values)  # type: ignore[no-any-return]

        self.running = Gauge("vllm:num_requests_running", "running", names, registry=r).labels(*values)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", names, registry=r).labels(*values)
        self.kv = [Gauge("vllm:kv_cache_usage_perc", "kv", names, registry=r).labels(*values)]
        self.success = Counter("vllm:request_success", "ok", [*names, "finished_reason"], registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "prompt", names, registry=r).labels(*values)
        self.generated = Counter("vllm:generation_tokens", "gen", names, registry=r).labels(*values)
        self.preempted = Counter("vllm:num_preemptions", "preempt", names, registry=r).labels(*values)
        self.ttft = hist("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS)
        self.itl = [hist("vllm:inter_token_latency_seconds", VLLM_ITL_BUCKETS)]
        self.queue = hist("vllm:request_queue_time_seconds", VLLM_REQUEST_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", VLLM_REQUEST_BUCKETS)
        self.legacy_itl: Histogram | None = None
        if self.legacy:
            self.legacy_itl = hist("vllm:time_per_output_token_seconds", VLLM_ITL_BUCKETS)
            self.kv.append(Gauge("vllm:gpu_cache_usage_perc", "kv", names, registry=r).labels(*values))

    def _sglang(self) -> None:
        scheduler = {"model_name": self.model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                     "moe_ep_rank": "0"}  # fmt: skip
        tokenizer = {"model_name": self.model}
        r = self.registry

        def hist(name: str, buckets: Sequence[float], labels: dict[str, str]) -> Histogram:
            return Histogram(name, name, list(labels), buckets=buckets, registry=r).labels(**labels)  # type: ignore[no-any-return]

        self.running = Gauge("sglang:num_running_reqs", "running", list(scheduler), registry=r).labels(**scheduler)
        self.waiting = Gauge("sglang:num_queue_reqs", "queue", list(scheduler), registry=r).labels(**scheduler)
        self.kv = [Gauge("sglang:token_usage", "usage", list(scheduler), registry=r).labels(**scheduler)]
        self.requests = Counter("sglang:num_requests_total", "requests", list(tokenizer), registry=r).labels(
            **tokenizer
        )
        self.prompt = Counter("sglang:prompt_tokens_total", "prompt", list(tokenizer), registry=r).labels(**tokenizer)
        self.generated = Counter("sglang:generation_tokens_total", "gen", list(tokenizer), registry=r).labels(
            **tokenizer
        )
        self.preempted = Counter(
            "sglang:num_retracted_requests_total", "retracted", list(scheduler), registry=r
        ).labels(**scheduler)
        self.ttft = hist("sglang:time_to_first_token_seconds", SGLANG_TTFT_BUCKETS, tokenizer)
        self.itl = [hist("sglang:inter_token_latency_seconds", SGLANG_ITL_BUCKETS, tokenizer)]
        self.queue = hist("sglang:queue_time_seconds", SGLANG_QUEUE_BUCKETS, scheduler)
        self.e2e = hist("sglang:e2e_request_latency_seconds", SGLANG_E2E_BUCKETS, tokenizer)
        self.legacy_itl = None

    def advance(self, seconds: float) -> None:
        """``seconds`` of the load: whole requests completed (a fraction carried to the next call)."""
        load = self.load
        self._carry += load.requests_per_s * seconds
        count = int(self._carry)
        self._carry -= count
        for _ in range(count):
            i = self._served
            self._served += 1
            ttft = load.ttft_s[i % len(load.ttft_s)]
            itl = load.itl_s[i % len(load.itl_s)]
            self.ttft.observe(ttft)
            self.queue.observe(load.queue_s[i % len(load.queue_s)])
            self.e2e.observe(ttft + itl * (load.output_tokens - 1))
            for _ in range(load.output_tokens - 1):
                for histogram in self.itl:
                    histogram.observe(itl)
                if self.legacy_itl is not None:
                    self.legacy_itl.observe(itl * 10)  # deliberately different: must not be read
            if self.engine == "vllm":
                self.success.labels(self.model, "0", "stop" if i % 4 else "length").inc()
            else:
                self.requests.inc()
            self.prompt.inc(load.prompt_tokens)
            self.generated.inc(load.output_tokens)
        self.preempted.inc(load.preemptions_per_s * seconds)
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        for i, gauge in enumerate(self.kv):
            gauge.set(load.kv_usage if i == 0 else 0.99)  # the legacy name's value must not be read

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


@contextmanager
def serve_exposition(render: Callable[[], bytes], host: str = "127.0.0.1", name: str = "metrics") -> Iterator[str]:
    """Serve ``render()`` at ``http://host:port/metrics`` (rendered again on every scrape, on the server's
    threads); yields the host:port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = render()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            del format, args

    server = ThreadingHTTPServer((host, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    try:
        yield f"{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def serving(fixture: EngineExposition, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``fixture`` at ``http://host:port/metrics``, advanced by the wall-clock time since its last
    scrape; yields the host:port."""
    lock = threading.Lock()
    last = [time.monotonic()]

    def render() -> bytes:
        with lock:
            now = time.monotonic()
            fixture.advance(now - last[0])
            last[0] = now
            return fixture.exposition()

    with serve_exposition(render, host, f"{fixture.engine}-metrics") as address:
        yield address
