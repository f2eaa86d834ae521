"""The controller's tick against emulated pods, a fake metric source and an in-memory API: the failure cases."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping, Sequence

import pytest

from batchpilot_operator.io.observe import MetricsUnavailable
from batchpilot_operator.tuning.model_metrics import INTER_TOKEN, MetricsBuilder, ModelKey, ModelMetrics
from batchpilot_runtime.contract.metric_names import LATENCY_BUCKETS_S
from tests.integration.fake_admin import closed_port_url
from tests.support.controller_harness import ControllerHarness, controller_harness
from tests.support.factories import make_spec_dict


class FakeSource:
    """Per-model latency in seconds: every request of the window takes exactly that long."""

    def __init__(self) -> None:
        self.latency_s: dict[str, float] = {}
        self.itl_s: dict[str, float] = {}  # every inter-token gap of the window takes exactly that long
        self.error: str | None = None
        self.calls = 0

    async def collect(self, targets: Mapping[ModelKey, Sequence[str]]) -> dict[ModelKey, ModelMetrics]:
        self.calls += 1
        if self.error:
            raise MetricsUnavailable(self.error)
        builder = MetricsBuilder(60.0)
        for (namespace, model), _ in targets.items():
            latency = self.latency_s.get(model)
            if latency is None:
                continue
            for bound in (*LATENCY_BUCKETS_S, math.inf):
                builder.add_bucket((namespace, model), "ttft", bound, 10.0 if bound >= latency else 0.0)
            builder.add_rate((namespace, model), "requests", 10.0)
            builder.add_rate((namespace, model), "batch_sum", 60.0)
            builder.add_rate((namespace, model), "batch_count", 10.0)
            builder.add_gauge((namespace, model), "queue_depth", 2.0)
            gap = self.itl_s.get(model)
            if gap is not None:
                for bound in (*LATENCY_BUCKETS_S, math.inf):
                    builder.add_bucket((namespace, model), INTER_TOKEN, bound, 100.0 if bound >= gap else 0.0)
        return builder.build()


class Harness(ControllerHarness[FakeSource]):
    pass


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async with controller_harness(FakeSource(), Harness) as harness:
        yield harness


async def test_new_profile_pushes_spec_window_and_reports_synced(h: Harness) -> None:
    h.add_pod("0")
    h.add_pod("1")
    h.controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1)
    await h.tick()
    for pod in ("0", "1"):
        assert h.fake.pods[pod].state.window.hard_cap == 16
    assert h.status()["pods"] == {"total": 2, "ready": 2, "synced": 2, "summary": "2/2"}
    assert h.condition("Synced")["status"] == "True"
    assert h.condition("Ready")["observedGeneration"] == 1
    assert h.status()["observedGeneration"] == 1
    assert h.status()["startingWindow"] == "spec.window"


async def test_a_profile_without_a_window_pushes_the_one_derived_from_its_step_costs(h: Harness) -> None:
    h.add_pod("0")
    costs = {"fixedMs": 11.3, "prefillUsPerToken": 61.0, "source": "a100"}
    spec = make_spec_dict(window=None, stepCosts=costs, slo={"p99Ms": 1000, "interTokenP99Ms": 100})
    h.controller.upsert_profile("ml", "chat", spec, generation=1)
    await h.tick()
    window = h.fake.pods["0"].state.window  # the cap clamped to what the pod holds
    assert (window.target_batch_size, window.max_wait_ms, window.max_prefill_tokens) == (1, 0, 798)
    assert h.status()["window"]["hardCap"] == 128
    assert h.status()["startingWindow"].startswith("derived from spec.stepCosts (fixed 11.3 ms, 61 us per prompt token")
    assert h.status()["window"]["maxPrefillTokens"] == 798


async def test_slo_miss_lowers_the_window_and_lands_in_status_and_events(h: Harness) -> None:
    h.add_pod("0")
    h.controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1)
    h.source.latency_s["chat"] = 2.0  # 4x the SLO
    await h.tick()
    window = h.status()["window"]
    assert window["targetBatchSize"] < 8 and window["generation"] == 2
    assert h.fake.pods["0"].state.window.generation == 2
    assert h.status()["lastDecision"]["direction"] == "down"
    assert h.condition("SLOMet")["status"] == "False"
    assert "DecisionDown" in h.sink.reasons("ml/chat")


async def test_an_slo_of_gaps_alone_is_judged_and_tuned_by_the_gaps(h: Harness) -> None:
    h.add_pod("0")
    spec = make_spec_dict(
        window={"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 40, "maxPrefillTokens": 2048},
        slo={"interTokenP99Ms": 50},
    )
    h.controller.upsert_profile("ml", "chat", spec, generation=1)
    h.source.latency_s["chat"] = 2.0  # would miss any first-token target the spec could have had
    h.source.itl_s["chat"] = 0.02
    await h.tick()
    slo_met = h.condition("SLOMet")
    assert slo_met["status"] == "True"
    assert slo_met["message"].startswith("inter-token P99") and "vs 50 ms" in slo_met["message"]
    h.source.itl_s["chat"] = 0.2
    await h.tick()
    assert h.condition("SLOMet")["status"] == "False"
    assert h.status()["window"]["maxPrefillTokens"] < 2048
    assert h.status()["lastDecision"]["reason"].startswith("inter-token P99")


async def test_prometheus_unreachable_holds_and_reports_then_recovers(h: Harness) -> None:
    h.add_pod("0")
    h.controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1)
    await h.tick()
    h.source.error = "Prometheus at http://prom:9090 failed: connection refused"
    h.source.latency_s["chat"] = 2.0
    await h.tick()
    condition = h.condition("MetricsAvailable")
    assert condition["status"] == "False" and "connection refused" in condition["message"]
    assert h.status()["window"]["generation"] == 1
    assert h.fake.pods["0"].state.window.generation == 1
    h.source.error = None
    await h.tick()
    assert h.condition("MetricsAvailable")["status"] == "True"
    assert h.status()["window"]["generation"] == 2


async def test_no_data_for_one_profile_leaves_the_others_deciding(h: Harness) -> None:
    h.add_pod("0", "chat")
    h.add_pod("1", "batch")
    h.controller.upsert_profile("ml", "chat", make_spec_dict("chat"), generation=1)
    h.controller.upsert_profile("ml", "batch", make_spec_dict("batch"), generation=1)
    h.source.latency_s["batch"] = 3.0  # chat: no series at all
    await h.tick()
    assert h.condition("MetricsAvailable", "chat")["status"] == "False"
    assert h.status("chat")["window"]["generation"] == 1
    assert h.status("batch")["window"]["generation"] == 2


async def test_restarted_pod_gets_the_current_window_within_one_interval(h: Harness) -> None:
    h.add_pod("0")
    h.controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1)
    h.source.latency_s["chat"] = 2.0
    await h.tick()
    generation = h.fake.pods["0"].state.window.generation
    h.fake.pods["0"].restart()
    await h.tick()
    assert h.fake.pods["0"].state.window.generation >= generation


async def test_failed_push_is_visible_and_does_not_block_other_pods(h: Harness) -> None:
    h.add_pod("0")
    h.add_pod("dead", admin_url=closed_port_url())
    h.fake.add_pod("flaky", model="chat")
    h.fake.pods["flaky"].fail_next = 100
    h.add_pod("flaky")
    h.controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1)
    await h.tick()
    assert h.fake.pods["0"].state.window.generation == 1
    synced = h.condition("Synced")
    assert synced["status"] == "False" and synced["reason"] == "PushFailed"
    assert "chat-dead" in synced["message"] and "503" in synced["message"]
    assert h.status()["pods"]["synced"] == 1
    assert h.sink.reasons("ml/chat").count("PushFailed") == 2
    h.fake.pods["flaky"].fail_next = 0
    await h.tick()
    assert h.fake.pods["flaky"].state.window.generation == 1


async def test_status_patch_failure_loses_no_field(h: Harness) -> None:
    h.add_pod("0")
    h.controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1)
    h.sink.fail_patches = 1
    await h.tick()
    assert "ml/chat" not in h.sink.status
    h.source.latency_s["chat"] = 2.0
    await h.tick()
    status = h.status()
    for key in ("window", "pods", "conditions", "observedGeneration", "lastDecision", "observed"):
        assert key in status, key
    # A later failure does not roll anything back either.
    h.sink.fail_patches = 1
    h.source.latency_s["chat"] = 0.05
    await h.tick()
    await h.tick()
    assert h.status()["observed"]["p99Ms"] < 100


async def test_invalid_profile_is_reported_naming_the_field_and_nothing_is_pushed(h: Harness) -> None:
    h.add_pod("0")
    bad = make_spec_dict(window={"targetBatchSize": 64, "hardCap": 16, "maxWaitMs": 40})
    h.controller.upsert_profile("ml", "chat", bad, generation=3)
    await h.tick()
    await h.tick()
    ready = h.condition("Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "spec.window" in ready["message"] and ready["observedGeneration"] == 3
    assert h.fake.pods["0"].puts == 0
    assert h.sink.reasons("ml/chat") == ["InvalidSpec"]  # once per generation, not per tick


async def test_window_over_pod_capacity_is_clamped(h: Harness) -> None:
    h.add_pod("0")  # capacity 64
    spec = make_spec_dict(window={"targetBatchSize": 100, "hardCap": 128, "maxWaitMs": 40})
    h.controller.upsert_profile("ml", "chat", spec, generation=1)
    await h.tick()
    assert h.fake.pods["0"].state.window.hard_cap == 64
    assert h.condition("Synced")["reason"] == "Clamped"
    assert "WindowClamped" in h.sink.reasons("ml/chat")


async def test_refused_window_is_never_retried_forever(h: Harness) -> None:
    h.add_pod("0")
    h.fake.pods["0"].refuse_all = "tailMarkRatio not supported"
    h.controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1)
    for _ in range(5):
        await h.tick()
    assert h.condition("Synced")["reason"] == "PushRefused"
    assert h.fake.requests <= 3  # GET + PUT once for generation 1, then never again


async def test_pod_with_newer_generation_is_overtaken(h: Harness) -> None:
    h.add_pod("0")
    h.fake.pods["0"].state = h.fake.pods["0"].state.model_copy(
        update={"window": h.fake.pods["0"].state.window.with_generation(41)}
    )
    h.controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1)
    await h.tick()
    assert h.fake.pods["0"].state.window.generation == 42
    assert h.fake.pods["0"].state.window.hard_cap == 16


async def test_a_static_profiles_new_window_goes_out_with_a_new_generation(h: Harness) -> None:
    # Found on the real API server with the real runtime: a changed spec window was numbered 1 again, the
    # runtime kept the window it held for generation 1, and the profile read Synced.
    h.add_pod("0")
    static = {"mode": "static", "cooldownSeconds": 0}
    h.controller.upsert_profile("ml", "chat", make_spec_dict(tuning=static), generation=1)
    await h.tick()
    assert h.fake.pods["0"].state.window.generation == 1
    window = {"targetBatchSize": 6, "hardCap": 12, "maxWaitMs": 10}
    h.controller.upsert_profile("ml", "chat", make_spec_dict(tuning=static, window=window), generation=2)
    await h.tick()
    state = h.fake.pods["0"].state.window
    assert (state.hard_cap, state.generation) == (12, 2)
    assert h.status()["window"]["generation"] == 2


async def test_recommend_mode_never_pushes(h: Harness) -> None:
    h.add_pod("0")
    spec = make_spec_dict(tuning={"mode": "recommend", "cooldownSeconds": 0})
    h.controller.upsert_profile("ml", "chat", spec, generation=1)
    h.source.latency_s["chat"] = 2.0
    await h.tick()
    assert h.fake.pods["0"].puts == 0
    assert h.status()["lastDecision"]["direction"] == "recommend"
    assert h.status()["recommendedWindow"]["targetBatchSize"] < 8


async def test_unchanged_status_is_not_patched(h: Harness) -> None:
    h.add_pod("0")
    h.controller.upsert_profile("ml", "chat", make_spec_dict(), generation=1)
    await h.tick()
    await h.tick()
    patches = h.sink.patches
    await h.tick()
    await h.tick()
    assert h.sink.patches == patches


async def test_one_collection_per_interval_for_all_profiles(h: Harness) -> None:
    for i in range(20):
        h.add_pod(str(i), f"m{i}")
        h.controller.upsert_profile("ml", f"p{i}", make_spec_dict(f"m{i}"), generation=1)
    await h.tick()
    await h.tick()
    assert h.source.calls == 2
