"""Emulated runtime admin endpoints: many pods' ``/admin/window`` (and ``/metrics``) in one aiohttp server.

Pod ``i`` lives under ``/pods/{i}``: its admin base URL is ``{url}/pods/{i}``. Each
pod keeps a WindowState and answers like the runtime's admin API does (401 without
the token, 409 for an older generation, 422 for a cap over its capacity, 200 with the
new state). Tests inject failures per pod: a number of 503s, a delay, a restart
(generation back to 0), or a fixed ``/metrics`` text.

Used by the push-client unit tests and by the scale benchmark, which runs it as its
own process: ``python -m tests.integration.fake_admin --pods 4000 --port-file F``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError

from batchpilot_runtime.contract.admin_api import AdminError, PodCapacity, WindowState, WindowUpdate
from batchpilot_runtime.contract.window import Window
from tests.support.factories import make_window

ROOT_POD = "_"


@dataclass
class FakePod:
    state: WindowState
    token: str | None
    fail_next: int = 0  # answer this many requests with 503
    delay_s: float = 0.0
    metrics_text: str = ""
    refuse_all: str = ""  # answer every PUT with 422 and this detail
    latency_s: float | None = None  # when set, /metrics grows by 50 requests of this TTFT per scrape
    scrapes: int = 0
    puts: int = 0
    gets: int = 0
    history: list[Window] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)  # the Authorization header of every admin call

    def restart(self) -> None:
        """A restarted runtime: back to its startup window, generation 0."""
        self.state = self.state.model_copy(update={"window": self.state.window.with_generation(0), "lanes": []})


def render_metrics(model: str, latency_s: float, requests: int) -> str:
    """A runtime-like exposition: ``requests`` finished, every one with this TTFT."""
    from batchpilot_runtime.contract import metric_names as rm

    lines = [f"# TYPE {rm.TTFT_SECONDS} histogram"]
    for bound in (*rm.LATENCY_BUCKETS_S, float("inf")):
        le = "+Inf" if bound == float("inf") else repr(bound)
        count = requests if bound >= latency_s else 0
        lines.append(f'{rm.TTFT_SECONDS}_bucket{{model="{model}",lane="default",le="{le}"}} {count}')
    lines += [
        f'{rm.TTFT_SECONDS}_sum{{model="{model}",lane="default"}} {requests * latency_s}',
        f'{rm.TTFT_SECONDS}_count{{model="{model}",lane="default"}} {requests}',
        f"# TYPE {rm.REQUESTS_TOTAL} counter",
        f'{rm.REQUESTS_TOTAL}{{model="{model}",outcome="completed"}} {requests}',
        f"# TYPE {rm.QUEUE_DEPTH} gauge",
        f'{rm.QUEUE_DEPTH}{{model="{model}"}} 5',
    ]
    return "\n".join(lines) + "\n"


def make_state(model: str, *, max_hard_cap: int = 512, window: Window | None = None) -> WindowState:
    return WindowState(
        model=model,
        window=window or make_window(target=4, cap=8, wait_ms=10),
        lanes=[],
        capacity=PodCapacity(kv_cache_tokens=65536, kv_block_size=16, max_hard_cap=max_hard_cap, max_model_len=2048),
        batching="continuous",
    )


def _error(status: int, error: str, detail: str, in_force: Window | None = None) -> web.Response:
    body = AdminError(error=error, detail=detail, window_in_force=in_force).model_dump_json(by_alias=True)
    return web.Response(status=status, text=body, content_type="application/json")


class FakeAdminServer:
    def __init__(self, pods: int = 0, *, model: str = "m", token: str | None = "secret", max_hard_cap: int = 512):
        self.pods: dict[str, FakePod] = {}
        for i in range(pods):
            self.add_pod(str(i), model=model, token=token, max_hard_cap=max_hard_cap)
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.requests = 0

    def add_pod(
        self, pod_id: str, *, model: str = "m", token: str | None = "secret", max_hard_cap: int = 512
    ) -> FakePod:
        pod = FakePod(make_state(model, max_hard_cap=max_hard_cap), token)
        self.pods[pod_id] = pod
        return pod

    def admin_url(self, pod_id: str | int) -> str:
        return f"{self.url}/pods/{pod_id}"

    def _pod(self, request: web.Request) -> FakePod:
        pod = self.pods.get(request.match_info.get("pod", ROOT_POD))
        if pod is None:
            raise web.HTTPNotFound(text="no such pod")
        return pod

    async def _prelude(self, pod: FakePod, request: web.Request) -> web.Response | None:
        self.requests += 1
        pod.authorizations.append(request.headers.get("Authorization"))
        if pod.delay_s:
            await asyncio.sleep(pod.delay_s)
        if pod.fail_next > 0:
            pod.fail_next -= 1
            return web.Response(status=503, text="injected failure")
        if pod.token and request.headers.get("Authorization") != f"Bearer {pod.token}":
            return _error(401, "unauthorized", "missing or wrong bearer token")
        return None

    async def get_window(self, request: web.Request) -> web.Response:
        pod = self._pod(request)
        if (early := await self._prelude(pod, request)) is not None:
            return early
        pod.gets += 1
        return web.Response(text=pod.state.model_dump_json(by_alias=True), content_type="application/json")

    async def put_window(self, request: web.Request) -> web.Response:
        pod = self._pod(request)
        if (early := await self._prelude(pod, request)) is not None:
            return early
        try:
            update = WindowUpdate.model_validate_json(await request.read())
        except ValidationError as error:
            problem = error.errors()[0]
            return _error(422, "invalid_window", f"{'.'.join(map(str, problem['loc']))}: {problem['msg']}")
        in_force = pod.state.window
        if pod.refuse_all:
            return _error(422, "invalid_window", pod.refuse_all, in_force)
        if update.window.generation < in_force.generation:
            return _error(
                409, "stale_generation", f"generation {update.window.generation} < {in_force.generation}", in_force
            )
        if update.window.hard_cap > pod.state.capacity.max_hard_cap:
            return _error(
                422,
                "invalid_window",
                f"hardCap {update.window.hard_cap} exceeds this pod's capacity {pod.state.capacity.max_hard_cap}",
                in_force,
            )
        pod.puts += 1
        pod.history.append(update.window)
        pod.state = pod.state.model_copy(
            update={"window": update.window, "lanes": update.lanes if update.lanes is not None else pod.state.lanes}
        )
        return web.Response(text=pod.state.model_dump_json(by_alias=True), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        pod = self._pod(request)
        if pod.latency_s is None:
            return web.Response(text=pod.metrics_text, content_type="text/plain")
        pod.scrapes += 1
        return web.Response(text=render_metrics(pod.state.model, pod.latency_s, 50 * pod.scrapes),
                            content_type="text/plain")  # fmt: skip

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/pods/{pod}/admin/window", self.get_window)
        app.router.add_put("/pods/{pod}/admin/window", self.put_window)
        app.router.add_get("/pods/{pod}/metrics", self.metrics)
        # A pod added as ROOT_POD also answers at the root, like one real runtime on its own address.
        app.router.add_get("/admin/window", self.get_window)
        app.router.add_put("/admin/window", self.put_window)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> str:
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=1024)
        await site.start()
        sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
        bound = sockets[0].getsockname()[1] if sockets else port
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeAdminServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def closed_port_url() -> str:
    """A loopback URL nothing listens on (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class FakePrometheusAnswers:
    """Answers the operator's three grouped queries for ``models`` models (``m0``..), for the scale benchmark.

    Even-numbered models answer with a TTFT of ``slow_s`` (over a 500 ms SLO), odd ones with ``fast_s``;
    the latency answer has the shape Prometheus gives the operator's query (quantiles and counts).
    """

    def __init__(self, models: int, namespace: str = "bench", slow_s: float = 2.0, fast_s: float = 0.05) -> None:
        from batchpilot_runtime.contract.metric_names import LATENCY_BUCKETS_S

        self.models, self.namespace = models, namespace
        self.queries = 0
        top = LATENCY_BUCKETS_S[-1]
        self._latency: list[dict[str, object]] = []
        for i in range(models):
            latency = slow_s if i % 2 == 0 else fast_s
            for series in ("ttft", "queueWait", "e2e"):
                for q in ("0.5", "0.99", "0.999"):
                    self._latency.append(self._sample(i, min(top, latency * float(q) * 1.2), bp_series=series,
                                                      bp_quantile=q))  # fmt: skip
                self._latency.append(self._sample(i, 10.0, bp_series=f"{series}_count"))
        self._rates = [
            self._sample(i, value, bp_series=series)
            for i in range(models)
            for series, value in (("requests", 10.0), ("generated_tokens", 300.0), ("batch_sum", 80.0),
                                  ("batch_count", 10.0))
        ]  # fmt: skip
        self._gauges = [
            self._sample(i, value, bp_series=series)
            for i in range(models)
            for series, value in (("queue_depth", 3.0), ("running", 8.0), ("kv_usage", 0.4), ("pods", 4.0))
        ]

    def _sample(self, i: int, value: float, **labels: str) -> dict[str, object]:
        return {"metric": {"namespace": self.namespace, "model": f"m{i}", **labels}, "value": [0, repr(value)]}

    async def query(self, request: web.Request) -> web.Response:
        self.queries += 1
        expr = request.query.get("query", "")
        if "histogram_quantile" in expr:
            result = self._latency
        elif "queue_depth" in expr:
            result = self._gauges
        else:
            result = self._rates
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"queries": self.queries})


async def _serve(pods: int, port_file: Path, model: str, token: str | None, prometheus_models: int = 0) -> None:
    server = FakeAdminServer(pods, model=model, token=token)
    if prometheus_models:
        answers = FakePrometheusAnswers(prometheus_models)
        original_app = server.app

        def app_with_prometheus() -> web.Application:
            app = original_app()
            app.router.add_get("/api/v1/query", answers.query)
            app.router.add_get("/stats", answers.stats)
            return app

        server.app = app_with_prometheus  # type: ignore[method-assign]
    url = await server.start()
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    tmp.replace(port_file)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, required=True)
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--model-prefix", default="m")
    parser.add_argument("--token", default="secret")
    parser.add_argument("--prometheus-models", type=int, default=0, help="also answer the operator's PromQL")
    args = parser.parse_args()
    asyncio.run(_serve(args.pods, args.port_file, args.model_prefix, args.token or None, args.prometheus_models))


if __name__ == "__main__":
    main()
