"""Canary retunes through the controller's tick: emulated pods, a fake metric source with per-pod
latency, an in-memory API."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import Any

import pytest

from batchpilot_operator.control.controller import Controller, PodRecord, ProfileRef, Settings
from batchpilot_operator.control.facts import RESTARTED_CANARY
from batchpilot_operator.control.status import rfc3339
from batchpilot_operator.io.scrape import ScrapeSource
from batchpilot_operator.tuning.model_metrics import MetricsBuilder, ModelKey, ModelMetrics
from batchpilot_runtime.contract.metric_names import LATENCY_BUCKETS_S
from batchpilot_runtime.contract.window import Window
from tests.support.controller_harness import ControllerHarness, controller_harness
from tests.support.factories import make_spec_dict

PODS = ("0", "1", "2", "3")


def _latency(builder: MetricsBuilder, key: ModelKey, latency_s: float, requests_per_s: float) -> None:
    """Every request of the window took ``latency_s`` to its first token."""
    for bound in (*LATENCY_BUCKETS_S, math.inf):
        builder.add_bucket(key, "ttft", bound, requests_per_s if bound >= latency_s else 0.0)
    builder.add_rate(key, "requests", requests_per_s)


class PodLatencySource:
    """The model's latency for the policy, and each pod's for the canary (by pod name; absent: no data)."""

    def __init__(self) -> None:
        self.model_latency_s = 2.0  # 4x the SLO: the policy lowers the window on the first tick
        self.pod_latency_s: dict[str, float] = {}
        self.rate_window_s = 1.5  # a tick and a half: the first interval after a start is not counted
        self.pod_calls = 0

    async def collect(
        self, targets: Mapping[ModelKey, Sequence[str]], engines: Collection[str] = ("batchpilot",)
    ) -> dict[ModelKey, ModelMetrics]:
        builder = MetricsBuilder(60.0)
        for key in targets:
            _latency(builder, key, self.model_latency_s, 10.0)
            builder.add_gauge(key, "queue_depth", 2.0)
        return builder.build()

    async def collect_pods(
        self, targets: Mapping[ModelKey, Mapping[str, str]]
    ) -> dict[ModelKey, dict[str, ModelMetrics]]:
        self.pod_calls += 1
        answer: dict[ModelKey, dict[str, ModelMetrics]] = {}
        for key, pods in targets.items():
            for name in pods:
                latency = self.pod_latency_s.get(name)
                if latency is None:
                    continue
                builder = MetricsBuilder(self.rate_window_s)
                _latency(builder, key, latency, 100.0)
                answer.setdefault(key, {})[name] = builder.build()[key]
        return answer


class Harness(ControllerHarness[PodLatencySource]):
    def window(self, pod_id: str) -> Window:
        return self.fake.pods[pod_id].state.window

    def seen(self, pod_id: str) -> list[Window]:
        return self.fake.pods[pod_id].history

    def canary_ids(self) -> list[str]:
        return [name.removeprefix("chat-") for name in self.status()["canary"]["pods"]]

    def events(self, reason: str) -> list[str]:
        return [message for _, _, r, message in self.sink.events if r == reason]


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async with controller_harness(PodLatencySource(), Harness) as harness:
        yield harness


def canary_spec(**canary: Any) -> dict[str, Any]:
    return make_spec_dict(tuning={"cooldownSeconds": 0, "canary": {"enabled": True, "share": 0.5, **canary}})


async def start_canary(h: Harness, **canary: Any) -> tuple[list[str], list[str], Window]:
    """Four pods, a profile whose first decision lowers the window: (canary pods, the others, the new window)."""
    for pod_id in PODS:
        h.add_pod(pod_id)
    h.controller.upsert_profile("ml", "chat", canary_spec(**canary), generation=1)
    await h.tick()
    canaries = h.canary_ids()
    others = [p for p in PODS if p not in canaries]
    assert h.status()["canary"]["verdict"] == "running"
    return canaries, others, Window.model_validate(h.status()["canary"]["window"])


async def test_a_canary_that_breaks_the_slo_is_rolled_back_and_the_others_never_get_its_window(h: Harness) -> None:
    canaries, others, tried = await start_canary(h)
    assert len(canaries) == 2  # half of four
    assert tried.target_batch_size < 8  # the policy lowered the window: 2 s against a 500 ms P99
    for pod_id in canaries:
        assert h.window(pod_id) == tried
    for pod_id in others:
        assert h.window(pod_id).fields_equal(Window.from_fields(make_window_fields(), 0))
    assert h.status()["window"]["generation"] == 1  # the window in force stays the baseline's
    h.source.pod_latency_s = {f"chat-{p}": 0.3 for p in others} | {f"chat-{p}": 1.5 for p in canaries}
    intervals = 0
    while h.status()["canary"]["verdict"] == "running" and intervals < 3:
        await h.tick()
        intervals += 1
    canary = h.status()["canary"]
    assert canary["verdict"] == "rolledBack" and intervals == 1  # a break is not waited out
    assert "breaks the SLO's 500 ms, which the other pods meet" in canary["reason"]
    for pod_id in canaries:  # back to the previous fields, numbered past the canary
        assert h.window(pod_id).fields_equal(Window.from_fields(make_window_fields(), 0))
        assert h.window(pod_id).generation > tried.generation
    for pod_id in others:
        assert not any(w.fields_equal(tried) for w in h.seen(pod_id))
    assert len(h.events("CanaryRolledBack")) == 1
    assert h.status()["lastDecision"]["reason"].startswith("Canary rolled back:")


def make_window_fields() -> Any:
    from batchpilot_runtime.contract.window import WindowFields

    return WindowFields.model_validate(make_spec_dict()["window"])


async def test_a_good_canary_is_promoted_after_its_intervals(h: Harness) -> None:
    _canaries, _others, tried = await start_canary(h, intervals=2)
    h.source.pod_latency_s = {f"chat-{p}": 0.3 for p in PODS}
    verdicts = []
    for _ in range(4):
        await h.tick()
        verdicts.append(h.status()["canary"]["verdict"])
        if verdicts[-1] != "running":
            break
    # The first interval's rate window reaches before the start: two counted passes after it.
    assert verdicts == ["running", "running", "promoted"]
    assert h.status()["canary"]["passedIntervals"] == 2
    assert h.status()["window"]["generation"] == tried.generation
    for pod_id in PODS:
        assert h.window(pod_id) == tried
    assert h.status()["pods"]["synced"] == 4
    assert len(h.events("CanaryPromoted")) == 1 and len(h.events("CanaryStarted")) == 1


async def test_no_per_pod_data_is_not_a_pass(h: Harness) -> None:
    _canaries, others, tried = await start_canary(h, intervals=2)
    h.source.pod_latency_s = {f"chat-{p}": 0.3 for p in others}  # the canary pods serve nothing
    for _ in range(2):
        await h.tick()
    canary = h.status()["canary"]
    assert canary["verdict"] == "rolledBack" and "no data is not a pass" in canary["reason"]
    for pod_id in others:
        assert not any(w.fields_equal(tried) for w in h.seen(pod_id))


async def test_a_canary_pod_going_away_leaves_the_canary_to_the_rest_and_all_gone_rolls_back(h: Harness) -> None:
    canaries, others, tried = await start_canary(h, intervals=2)
    h.source.pod_latency_s = {f"chat-{p}": 0.3 for p in PODS}
    h.controller.remove_pod("ml", f"chat-{canaries[0]}")
    await h.tick()
    assert h.status()["canary"]["verdict"] == "running"
    assert h.status()["canary"]["pods"] == [f"chat-{canaries[1]}"]
    h.controller.remove_pod("ml", f"chat-{canaries[1]}")
    await h.tick()
    canary = h.status()["canary"]
    assert canary["verdict"] == "rolledBack" and "every canary pod went away" in canary["reason"]
    for pod_id in others:
        assert not any(w.fields_equal(tried) for w in h.seen(pod_id))
        assert h.window(pod_id).generation > tried.generation  # the rollback is numbered past the canary


async def test_a_baseline_pod_going_away_mid_canary_changes_nothing_and_the_canary_is_promoted(h: Harness) -> None:
    _canaries, others, tried = await start_canary(h, intervals=1)
    h.source.pod_latency_s = {f"chat-{p}": 0.3 for p in PODS}
    h.controller.remove_pod("ml", f"chat-{others[0]}")
    for _ in range(2):
        await h.tick()
    assert h.status()["canary"]["verdict"] == "promoted"
    assert h.window(others[1]) == tried


async def test_the_policy_holds_while_a_canary_runs_and_a_rolled_back_window_is_not_retried_at_once(
    h: Harness,
) -> None:
    canaries, _others, tried = await start_canary(h)
    h.source.pod_latency_s = {f"chat-{p}": 0.3 for p in PODS}
    await h.tick()  # not counted yet: the policy, still seeing 2 s, holds
    assert h.status()["lastDecision"]["direction"] == "hold"
    assert h.status()["lastDecision"]["reason"].startswith("Holding while the canary of generation")
    h.source.pod_latency_s |= {f"chat-{p}": 1.5 for p in canaries}
    await h.tick()
    assert h.status()["canary"]["verdict"] == "rolledBack"
    await h.tick()  # the policy proposes the same window again: held
    reason = h.status()["lastDecision"]["reason"]
    assert (
        reason.startswith(f"Holding: target={tried.target_batch_size} ") and "was rolled back by its canary" in reason
    )
    assert len(h.events("CanaryStarted")) == 1


async def test_a_single_pod_is_its_own_canary_judged_against_the_slo_alone(h: Harness) -> None:
    h.add_pod("0")
    h.controller.upsert_profile("ml", "chat", canary_spec(intervals=1), generation=1)
    await h.tick()
    assert h.canary_ids() == ["0"]
    h.source.pod_latency_s = {"chat-0": 0.9}
    await h.tick()
    canary = h.status()["canary"]
    assert canary["verdict"] == "rolledBack" and "no other pod's figure" in canary["reason"]


async def test_without_a_canary_in_progress_no_per_pod_query_runs(h: Harness) -> None:
    h.add_pod("0")
    h.add_pod("1")
    h.controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1)
    for _ in range(3):
        await h.tick()
    assert h.source.pod_calls == 0
    assert "canary" not in h.status()
    assert h.window("0") == h.window("1")


def successor(h: Harness, spec: dict[str, Any]) -> Controller:
    """A new operator on the same pods, API and clock, adopting the status its predecessor left: the
    predecessor is dropped between two ticks, as a killed operator is (its status written ahead of its
    pushes is all that is left of it)."""
    controller = Controller(
        Settings(interval_override_s=1.0, default_token="secret", default_token_namespaces=frozenset({"ml"})),
        h.source,
        h.controller.admin,
        h.sink,
        wall_clock=lambda: h.now,
        monotonic=lambda: h.now,
    )
    h.controller = controller
    for pod_id in PODS:
        h.add_pod(pod_id)
    controller.upsert_profile("ml", "chat", spec, generation=1, status=h.status())
    return controller


async def test_an_operator_restarted_mid_canary_returns_the_canary_pods_and_says_so(h: Harness) -> None:
    _canaries, others, tried = await start_canary(h)
    h.source.model_latency_s = 0.3  # within the SLO: the new operator's policy holds
    successor(h, canary_spec())
    for _ in range(2):
        await h.tick()
    assert h.status()["canary"]["verdict"] == "rolledBack"
    assert h.status()["canary"]["reason"] == RESTARTED_CANARY
    assert h.events("CanaryRolledBack") == [f"{tried.describe()} rolled back: {RESTARTED_CANARY}"]
    first = h.window(others[0])
    assert not first.fields_equal(tried)
    for pod_id in PODS:  # every pod on the baseline's fields, numbered past the canary
        assert h.window(pod_id) == first and first.generation > tried.generation


async def test_a_canary_is_in_status_before_its_window_reaches_a_pod(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written ahead of the push, as a changed window is: an operator killed between the two leaves a
    status whose successor ends the canary and keeps the cooldown it started."""
    puts_when_written: list[int] = []
    patch_status = h.sink.patch_status

    async def recording(ref: ProfileRef, patch: Mapping[str, Any]) -> None:
        if "canary" in patch and "canary" not in h.sink.status.get(ref.key, {}):
            puts_when_written.append(sum(pod.puts for pod in h.fake.pods.values()))
        await patch_status(ref, patch)

    monkeypatch.setattr(h.sink, "patch_status", recording)
    canaries, _others, tried = await start_canary(h)
    assert puts_when_written == [0]
    assert h.status()["policy"]["lastChangeTime"] == "1970-01-01T00:16:41.000000Z"  # t=1001
    for pod_id in canaries:
        assert h.window(pod_id) == tried


async def test_an_operator_restarted_mid_cooldown_and_mid_canary_pushes_nothing_new_until_the_policy_would_have(
    h: Harness,
) -> None:
    spec = make_spec_dict(tuning={"cooldownSeconds": 60, "canary": {"enabled": True, "share": 0.5, "intervals": 20}})
    for pod_id in PODS:
        h.add_pod(pod_id)
    h.controller.upsert_profile("ml", "chat", spec, generation=1)
    await h.tick()  # t=1001: 2 s against a 500 ms P99: a lower window, on the canary pods first
    canaries, others = h.canary_ids(), [p for p in PODS if p not in h.canary_ids()]
    tried = Window.model_validate(h.status()["canary"]["window"])
    baseline = h.window(others[0])
    assert (baseline.generation, tried.generation) == (1, 2)
    seen = {pod_id: len(h.seen(pod_id)) for pod_id in PODS}
    h.now = 1025.0  # killed 25 s into the 60 s cooldown, the canary still running
    successor(h, spec)  # the model is still slow: only the cooldown holds the policy back

    await h.tick()  # t=1026
    assert h.events("CanaryRolledBack") == [f"{tried.describe()} rolled back: {RESTARTED_CANARY}"]
    assert h.status()["canary"]["verdict"] == "rolledBack"
    assert h.status()["lastDecision"]["reason"].endswith("but in cooldown for 35 s more; holding.")
    await h.tick()  # t=1027: the baseline pods follow the renumbered baseline
    h.now = 1059.0
    await h.tick()  # t=1060: one second of cooldown left
    assert h.status()["lastDecision"]["reason"].endswith("but in cooldown for 1 s more; holding.")
    back = baseline.with_generation(3)  # the baseline's fields, numbered past the canary's generation
    for pod_id in PODS:
        assert h.seen(pod_id)[seen[pod_id] :] == [back]

    await h.tick()  # t=1061: the cooldown is over: the policy lowers the window again, canary first
    canary = h.status()["canary"]
    assert canary["verdict"] == "running" and canary["startedAt"] == rfc3339(1061.0)
    retried = Window.model_validate(canary["window"])
    assert retried.generation == 4
    for pod_id in canaries:
        assert h.seen(pod_id)[seen[pod_id] :] == [back, retried]
    for pod_id in others:
        assert h.seen(pod_id)[seen[pod_id] :] == [back]
    assert len(h.events("CanaryStarted")) == 2


async def test_an_operator_restarted_mid_cooldown_keeps_the_tuned_window_and_sends_its_pods_nothing(
    h: Harness,
) -> None:
    spec = make_spec_dict(tuning={"cooldownSeconds": 60})
    for pod_id in PODS:
        h.add_pod(pod_id)
    h.controller.upsert_profile("ml", "chat", spec, generation=1)
    await h.tick()  # t=1001: a lower window on every pod
    tuned = h.window("0")
    assert tuned.generation == 2 and tuned.target_batch_size < 8
    puts = {pod_id: h.fake.pods[pod_id].puts for pod_id in PODS}
    h.now = 1025.0
    successor(h, spec)
    for _ in range(3):
        await h.tick()
    assert h.status()["window"]["generation"] == 2
    assert h.status()["lastDecision"]["reason"].endswith("but in cooldown for 33 s more; holding.")
    assert h.status()["pods"]["synced"] == 4
    for pod_id in PODS:  # read back, never written: each already held the window in force
        assert h.fake.pods[pod_id].puts == puts[pod_id]
        assert h.window(pod_id) == tuned


async def test_through_the_scraping_source_a_slow_canary_is_rolled_back(h: Harness) -> None:
    """The same story with the pods' own /metrics scraped (local mode without Prometheus): the per-pod
    figures come from the scrapes of the model-wide collection."""
    source = ScrapeSource(rate_window_s=30.0, clock=lambda: h.now)
    h.controller.source = source
    try:
        for pod_id in PODS:
            h.fake.add_pod(pod_id, model="chat", max_hard_cap=64).latency_s = 2.0
            url = h.fake.admin_url(pod_id)
            pod = PodRecord("ml", f"chat-{pod_id}", {"app": "chat"}, ip="127.0.0.1", ready=True,
                            admin_url=url, metrics_url=f"{url}/metrics", uid=f"uid-{pod_id}")  # fmt: skip
            h.controller.upsert_pod(pod)
        h.controller.upsert_profile("ml", "chat", canary_spec(), generation=1)
        while "canary" not in h.sink.status.get("ml/chat", {}):  # the first scrape has no rates yet
            await h.tick()
            assert h.now < 1010
        canaries, others = h.canary_ids(), [p for p in PODS if p not in h.canary_ids()]
        tried = Window.model_validate(h.status()["canary"]["window"])
        for pod_id in PODS:
            h.fake.pods[pod_id].latency_s = 1.5 if pod_id in canaries else 0.3
        await h.tick()
    finally:
        await source.aclose()
    canary = h.status()["canary"]
    assert canary["verdict"] == "rolledBack" and "which the other pods meet" in canary["reason"]
    for pod_id in others:
        assert not any(w.fields_equal(tried) for w in h.seen(pod_id))


@pytest.mark.parametrize("tuning", [{"cooldownSeconds": 0}, {"mode": "static"}])
async def test_a_canary_the_spec_no_longer_wants_ends_and_every_pod_gets_the_window_in_force(
    h: Harness, tuning: dict[str, Any]
) -> None:
    _canaries, others, tried = await start_canary(h)
    h.controller.upsert_profile("ml", "chat", make_spec_dict(tuning=tuning), generation=2)
    h.source.model_latency_s = 0.3
    for _ in range(2):
        await h.tick()
    canary = h.status()["canary"]
    assert canary["verdict"] == "rolledBack" and "switched off" in canary["reason"]
    in_force = Window.model_validate({k: v for k, v in h.status()["window"].items() if k != "appliedAt"})
    for pod_id in PODS:
        assert h.window(pod_id) == in_force
    assert in_force.generation > tried.generation and not in_force.fields_equal(tried)
    for pod_id in others:
        assert not any(w.fields_equal(tried) for w in h.seen(pod_id))
