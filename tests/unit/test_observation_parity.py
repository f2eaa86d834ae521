"""The simulator and the live path give the policy the same observations of the same request stream.

One replay runs through the simulator; its scheduler also reports to the runtime's own exporter as the
engine does (steps, gaps, requests as they end, rejections; the load gauges when scraped), and the
exporter is scraped at every controller tick. The scrapes go through the scraping source's arithmetic
and the one builder; every field of the result must equal the simulator's at that tick. The stream
overloads the engine, so a backlog builds: requests end long after they arrive, which is where counting
arrivals instead of requests that ended, or observing a latency at another moment, shows: the queue
wait and the first-token latency are observed when they happen, the end-to-end latency when a request
ends, live and simulated."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest

from batchpilot_operator.api.profile import LatencyMetric
from batchpilot_operator.io.exposition import parse_exposition
from batchpilot_operator.io.scrape import Scrape, gap_increments, metrics_from_scrapes
from batchpilot_operator.sim import simulator as simulator_module
from batchpilot_operator.sim.simulator import SimConfig, SimResult, Simulator, scheduler_config_for
from batchpilot_operator.tuning.model_metrics import MetricsBuilder, to_observations
from batchpilot_operator.tuning.observations import Observations
from batchpilot_runtime.contract.admin_api import DEFAULT_LANE
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.replay.cost_model import A100_LLAMA2_7B
from batchpilot_runtime.replay.trace import TraceRequest
from batchpilot_runtime.scheduling.scheduler import Scheduler
from batchpilot_runtime.scheduling.types import (
    QueueFullError,
    RequestOutput,
    RequestRejected,
    SchedRequest,
    SchedulerConfig,
    StepPlan,
)
from batchpilot_runtime.server.metrics import MetricsExporter

MODEL = "m"
INTERVAL_S = 5.0
RATE_WINDOW_S = 15.0


class ReportingScheduler(Scheduler):
    """The runtime's scheduler reporting to a MetricsExporter where the engine and the server do: each
    step after its tokens, the gaps of each step, a first admission when it is planned, a first token
    when it is sampled, a request when it ends, a rejection on arrival."""

    def __init__(self, config: SchedulerConfig, window: Window, exporter: MetricsExporter) -> None:
        super().__init__(config, window)
        self.exporter = exporter
        self._step_start_s = 0.0
        self._last_token_s: dict[str, float] = {}
        self._arrival_s: dict[str, float] = {}
        self._admitted: set[str] = set()

    def add_request(self, request: SchedRequest) -> None:
        try:
            super().add_request(request)
        except (QueueFullError, RequestRejected):
            self.exporter.on_rejected()
            raise
        self._arrival_s[request.request_id] = request.arrival_s

    def schedule(self, now_s: float) -> StepPlan:
        self._step_start_s = now_s
        plan = super().schedule(now_s)
        for seq in plan.seqs:  # as the engine does: a request's first plan is its admission
            if seq.request_id not in self._admitted:
                self._admitted.add(seq.request_id)
                self.exporter.on_admitted(DEFAULT_LANE, now_s - self._arrival_s[seq.request_id])
        return plan

    def update_from_output(self, plan: StepPlan, sampled: Mapping[str, int], now_s: float) -> list[RequestOutput]:
        outputs = super().update_from_output(plan, sampled, now_s)
        gaps: list[float] = []
        for output in outputs:
            if output.token_id is not None:
                if (last_s := self._last_token_s.get(output.request_id)) is not None:
                    gaps.append(now_s - last_s)
                else:
                    self.exporter.on_first_token(DEFAULT_LANE, now_s - self._arrival_s[output.request_id])
                self._last_token_s[output.request_id] = now_s
                self.exporter.on_generated_tokens(1)
            if output.finish_reason is not None and output.timings is not None:
                del self._last_token_s[output.request_id]
                del self._arrival_s[output.request_id]
                self._admitted.discard(output.request_id)
                self.exporter.on_request_finished(output.timings, output.finish_reason)
        self.exporter.on_tokens(DEFAULT_LANE, gaps)  # the simulator's requests are all in the default lane
        step_s = now_s - self._step_start_s
        self.exporter.on_step(plan.stats, step_s, step_s)
        return outputs


class Recorder:
    """A controller that changes nothing: at each tick it keeps the simulator's observations and scrapes
    the exporter, as the operator's scraping source would at that moment."""

    name = "recorder"

    def __init__(self, exporter: MetricsExporter, latency_metric: LatencyMetric) -> None:
        self.exporter = exporter
        self.latency_metric = latency_metric
        self.scheduler: Scheduler | None = None
        self.scrapes = [Scrape(0.0, parse_exposition(exporter.exposition().decode()))]
        self.pairs: list[tuple[Observations, Observations]] = []

    def on_interval(self, now_s: float, observations: Observations, window: Window) -> Window | None:
        scheduler = self.scheduler
        assert scheduler is not None
        # The runtime's /metrics sets the load gauges from the engine as it answers.
        self.exporter.set_load(scheduler.num_waiting, scheduler.num_running, scheduler.kv_usage_ratio)
        current = Scrape(now_s, parse_exposition(self.exporter.exposition().decode()))
        self.scrapes.append(current)
        oldest = self.scrapes[max(0, len(self.scrapes) - 1 - round(RATE_WINDOW_S / INTERVAL_S))]
        builder = MetricsBuilder(now_s - oldest.at_s)
        metrics_from_scrapes(current, oldest, builder)
        # The hour of gaps: the run is shorter, so all of them since the first scrape.
        for key, increments in gap_increments(current, self.scrapes[0]).items():
            for bound, count in increments.items():
                builder.add_window_bucket(key, bound, count)
        metrics = builder.build()[("", MODEL)]
        metrics.window_s = now_s - oldest.at_s
        self.pairs.append((observations, to_observations(metrics, str(self.latency_metric), now_s)))
        return None


def overload(n: int = 400) -> list[TraceRequest]:
    """More than a hard cap of 8 serves for the first half, then a trickle: a backlog builds and drains."""
    requests = []
    t = 0.0
    for i in range(n):
        t += 0.05 if i < n // 2 else 0.4
        requests.append(TraceRequest(t, 40 + (i * 37) % 300, 20 + (i * 13) % 120))
    return requests


def run_both(monkeypatch: pytest.MonkeyPatch, metric: LatencyMetric) -> tuple[SimResult, Recorder]:
    exporter = MetricsExporter(MODEL)
    recorder = Recorder(exporter, metric)

    def reporting_scheduler(config: SchedulerConfig, window: Window) -> Scheduler:
        recorder.scheduler = ReportingScheduler(config, window, exporter)
        return recorder.scheduler

    monkeypatch.setattr(simulator_module, "Scheduler", reporting_scheduler)
    config = SimConfig(
        cost=A100_LLAMA2_7B,
        scheduler=scheduler_config_for(A100_LLAMA2_7B, max_queue=100),
        slo_p99_s=1.0,
        latency_metric=metric,
        interval_s=INTERVAL_S,
        rate_window_s=RATE_WINDOW_S,
    )
    window = Window(target_batch_size=4, hard_cap=8, max_wait_ms=20, tail_mark_ratio=2.0)
    result = Simulator(overload(), window, config, recorder).run()
    # The stream is what the test needs: a backlog, rejections, tail marks, and a rate of requests
    # that ended that differs from the arrival rate (which counting arrivals would report).
    assert result.final_window == window and any(r.rejected for r in result.records)
    assert max(live.queue_depth for _, live in recorder.pairs) > 50
    assert any(live.tail_marked_share > 0 for _, live in recorder.pairs)
    assert any(
        abs(point.arrival_rate_per_s - live.arrival_rate_per_s) > 1.0
        for point, (_, live) in zip(result.timeline, recorder.pairs, strict=True)
    )
    return result, recorder


# The quantiles of the SLO's latency metric and the samples they rest on.
LATENCY_FIELDS = frozenset({"p50_s", "p99_s", "p999_s", "p99_saturated", "p999_saturated", "samples"})


def assert_same(simulated: Observations, live: Observations, skip: frozenset[str] = frozenset()) -> None:
    for name in (f.name for f in dataclasses.fields(Observations) if f.name not in skip):
        got, want = getattr(simulated, name), getattr(live, name)
        where = (name, simulated.at_s)
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-9, nan_ok=True), where
        elif isinstance(want, tuple):  # (upper bound, count) pairs
            assert [b for b, _ in got] == [b for b, _ in want], where
            assert [c for _, c in got] == pytest.approx([c for _, c in want], rel=1e-9), where
        elif isinstance(want, Mapping):
            assert dict(got) == pytest.approx(dict(want), rel=1e-9), where
        else:
            assert got == want, where


def test_every_field_is_the_live_paths_on_the_same_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """End-to-end latency is observed when a request ends, live and simulated: every field agrees."""
    _, recorder = run_both(monkeypatch, LatencyMetric.E2E)
    assert len(recorder.pairs) > 10
    for simulated, live in recorder.pairs:
        assert_same(simulated, live)


@pytest.mark.parametrize("metric", [LatencyMetric.TTFT, LatencyMetric.QUEUE_WAIT])
def test_every_field_but_the_latency_quantiles_is_the_live_paths(
    monkeypatch: pytest.MonkeyPatch, metric: LatencyMetric
) -> None:
    _, recorder = run_both(monkeypatch, metric)
    for simulated, live in recorder.pairs:
        assert_same(simulated, live, skip=LATENCY_FIELDS)


@pytest.mark.parametrize("metric", [LatencyMetric.TTFT, LatencyMetric.QUEUE_WAIT])
def test_first_token_and_queue_wait_quantiles_are_the_live_paths(
    monkeypatch: pytest.MonkeyPatch, metric: LatencyMetric
) -> None:
    """Observed when they happen, live and simulated: the quantiles and their sample counts agree."""
    _, recorder = run_both(monkeypatch, metric)
    assert len(recorder.pairs) > 10
    for simulated, live in recorder.pairs:
        assert_same(simulated, live)
