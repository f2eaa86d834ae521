"""The scraping source's hour of inter-token gaps (what Prometheus's ``increase(...[3600s])`` gives the
other source): summed from the increments between scrapes, in bounded memory, and handed to the policy."""

from __future__ import annotations

import math

import httpx
import pytest

from batchpilot_operator.io.scrape import GapHour, ScrapeSource
from batchpilot_operator.tuning.model_metrics import ERROR_BUDGET_WINDOW_S, to_observations
from batchpilot_operator.tuning.observations import share_above
from batchpilot_runtime.contract.admin_api import DEFAULT_LANE
from batchpilot_runtime.contract.metric_names import STEP_BUCKETS_S
from batchpilot_runtime.server.metrics import MetricsExporter

INF = math.inf


def test_the_hour_sums_the_increments_of_its_slots_and_forgets_what_left_it() -> None:
    hour = GapHour(window_s=3600.0, slot_s=60.0)
    hour.add(10.0, {0.05: 10.0, INF: 10.0})
    hour.add(30.0, {0.05: 1.0, INF: 2.0})  # the same minute: the same slot
    hour.add(1800.0, {0.05: 5.0, INF: 8.0})
    assert hour.slots_held == 2
    assert hour.total(1800.0) == {0.05: 16.0, INF: 20.0}
    # The first minute ends at 60 s, one hour before 3660 s: it has left the window.
    assert hour.total(3659.0) == {0.05: 16.0, INF: 20.0}
    assert hour.total(3660.0) == {0.05: 5.0, INF: 8.0}
    assert hour.total(1860.0 + 3600.0) == {} and hour.slots_held == 0


def test_the_hour_holds_at_most_one_slot_more_than_it_spans_whatever_the_scrape_interval() -> None:
    hour = GapHour(window_s=3600.0, slot_s=60.0)
    for second in range(2 * 3600):
        hour.add(float(second), {INF: 1.0})
        assert hour.slots_held <= 61
    # One gap a second: the hour's, give or take the slot the window's start falls in.
    assert 3600.0 <= hour.total(7199.0)[INF] <= 3660.0


@pytest.mark.parametrize("slot_s", [0.0, -1.0, 7200.0])
def test_a_slot_must_fit_in_the_hour(slot_s: float) -> None:
    with pytest.raises(ValueError, match="slot_s"):
        GapHour(window_s=3600.0, slot_s=slot_s)


async def test_the_scraping_source_gives_the_policy_the_hour_of_gaps() -> None:
    exporter = MetricsExporter("chat")
    clock = [0.0]

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=exporter.exposition())

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    source = ScrapeSource(rate_window_s=30.0, client=client, clock=lambda: clock[0])
    targets = {("ml", "chat"): ["http://pod-a/metrics"]}

    async def observe_at(at_s: float) -> tuple[tuple[float, float], ...]:
        clock[0] = at_s
        metrics = await source.collect(targets)
        return to_observations(metrics[("ml", "chat")], "ttft", at_s).itl_window_buckets

    try:
        assert await observe_at(0.0) == ()  # one scrape: no increase yet, so no hour (not an empty one)
        exporter.on_tokens(DEFAULT_LANE, [0.01] * 90 + [0.5] * 10)
        first = await observe_at(15.0)
        exporter.on_tokens(DEFAULT_LANE, [0.01] * 100)
        second = await observe_at(120.0)
        # An hour after the first minute: its 100 gaps have left the window, those of the third minute not yet.
        later = await observe_at(60.0 + ERROR_BUDGET_WINDOW_S)
        latest = await observe_at(180.0 + ERROR_BUDGET_WINDOW_S)
    finally:
        await client.aclose()
    assert [bound for bound, _ in first] == [*STEP_BUCKETS_S, INF]  # the exporter's gap buckets, all of them
    assert first[-1][1] == pytest.approx(100.0) and share_above(0.1, first) == pytest.approx(0.1)
    assert second[-1][1] == pytest.approx(200.0) and share_above(0.1, second) == pytest.approx(0.05)
    assert later[-1][1] == pytest.approx(100.0) and share_above(0.1, later) == pytest.approx(0.0)
    assert latest[-1][1] == pytest.approx(0.0)


async def test_a_pod_no_longer_scraped_takes_its_hour_with_it() -> None:
    exporters = {"pod-a": MetricsExporter("chat"), "pod-b": MetricsExporter("chat")}
    clock = [0.0]

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=exporters[request.url.host].exposition())

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    source = ScrapeSource(rate_window_s=30.0, client=client, clock=lambda: clock[0])
    both = {("ml", "chat"): ["http://pod-a/metrics", "http://pod-b/metrics"]}
    try:
        await source.collect(both)
        for exporter in exporters.values():
            exporter.on_tokens(DEFAULT_LANE, [0.01] * 50)
        clock[0] = 15.0
        together = await source.collect(both)
        clock[0] = 30.0
        alone = await source.collect({("ml", "chat"): ["http://pod-a/metrics"]})
    finally:
        await client.aclose()
    window = together[("ml", "chat")].itl_window
    assert window is not None and window.count == pytest.approx(100.0)  # both pods' gaps add up
    window = alone[("ml", "chat")].itl_window
    assert window is not None and window.count == pytest.approx(50.0)
