"""A restarted operator continues: the policy's memory comes back from status, and the cap does not
climb back into preemption.

The pods run a closed loop: the load keeps ``DEMAND`` sequences in flight, the batch is
``min(cap, DEMAND)``, the rest queues, and a batch over ``KV_SEQS`` (what the KV cache holds)
preempts. So the cap the operator pushes decides whether the next interval preempts, and a
restart that forgot the memory ceiling shows up as preemptions again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from batchpilot_operator.control.controller import Controller, PodRecord, ProfileRef, Settings
from batchpilot_operator.io.push import AdminClient
from batchpilot_operator.tuning.model_metrics import MetricsBuilder, ModelKey, ModelMetrics
from batchpilot_operator.tuning.policy import PolicyState
from batchpilot_runtime.contract.metric_names import LATENCY_BUCKETS_S, batch_bucket
from tests.integration.fake_admin import FakeAdminServer
from tests.support.controller_harness import MemorySink
from tests.support.factories import make_spec_dict

KV_SEQS = 40
DEMAND = 48
POD = "0"


def make_spec(hard_cap: int = 64, **tuning: Any) -> dict[str, Any]:
    return make_spec_dict(
        batchFriendliness="high",
        window={"targetBatchSize": 8, "hardCap": hard_cap, "maxWaitMs": 40},
        tuning={"cooldownSeconds": 0, **tuning},
    )


class ClosedLoopSource:
    """The metrics of ``DEMAND`` sequences on the fake pod, whatever cap it runs (see the module docstring)."""

    def __init__(self, fake: FakeAdminServer) -> None:
        self.fake = fake
        self.preempting: list[bool] = []  # one entry per collection: did that interval preempt?

    async def collect(self, targets: Mapping[ModelKey, Sequence[str]]) -> dict[ModelKey, ModelMetrics]:
        cap = self.fake.pods[POD].state.window.hard_cap
        running = min(cap, DEMAND)
        self.preempting.append(running > KV_SEQS)
        builder = MetricsBuilder(60.0)
        for key in targets:
            for bound in (*LATENCY_BUCKETS_S, math.inf):
                builder.add_bucket(key, "ttft", bound, 10.0 if bound >= 0.1 else 0.0)
            builder.add_rate(key, "requests", 10.0)
            builder.add_rate(key, "batch_sum", 10.0 * running)
            builder.add_rate(key, "batch_count", 10.0)
            builder.add_rate(key, "preemptions", 5.0 if running > KV_SEQS else 0.0)
            builder.add_rate(key, "step_sum", 10.0 * (0.02 + 0.0005 * running), batch_bucket(running))
            builder.add_rate(key, "step_count", 10.0, batch_bucket(running))
            builder.add_gauge(key, "queue_depth", float(DEMAND - running))
        return builder.build()


class World:
    """What outlives an operator process: the API server (the sink's status), the pods, the wall clock."""

    def __init__(self, fake: FakeAdminServer, admin: AdminClient) -> None:
        self.fake, self.admin = fake, admin
        self.sink = MemorySink()
        self.source = ClosedLoopSource(fake)
        self.now = 1_750_000_000.0
        self.spec = make_spec()
        self.generation = 1

    def start_operator(self, monotonic_offset_s: float = 0.0) -> Controller:
        """A new operator process: nothing in memory, the profile adopted with the status it has
        (kopf's resume handler). Its monotonic clock has its own origin, as a new process's has."""
        controller = Controller(
            Settings(interval_override_s=1.0),
            self.source,
            self.admin,
            self.sink,
            wall_clock=lambda: self.now,
            monotonic=lambda: self.now - monotonic_offset_s,
        )
        controller.upsert_pod(
            PodRecord(
                "ml", "chat-0", {"app": "chat"}, ip="127.0.0.1", ready=True,
                admin_url=self.fake.admin_url(POD), token="secret", uid="uid-0",
            )
        )  # fmt: skip
        controller.upsert_profile(
            "ml", "chat", self.spec, generation=self.generation, status=self.sink.status.get("ml/chat")
        )
        return controller

    async def tick(self, controller: Controller) -> dict[str, Any]:
        self.now += 1.0
        await controller.tick()
        await controller.drain_events()
        return self.status()

    def status(self) -> dict[str, Any]:
        return self.sink.status.get("ml/chat", {})

    def pod_cap(self) -> int:
        return self.fake.pods[POD].state.window.hard_cap


@pytest.fixture
async def worlds() -> AsyncIterator[list[World]]:
    """Two independent worlds (pods, API server, clock), for a run with a restart beside one without."""
    fakes = [FakeAdminServer(0), FakeAdminServer(0)]
    admin = AdminClient(timeout_s=2.0, retries=2, backoff_s=0.01)
    made = []
    for fake in fakes:
        fake.add_pod(POD, model="chat", token="secret", max_hard_cap=512)
        await fake.start()
        made.append(World(fake, admin))
    yield made
    await admin.aclose()
    for fake in fakes:
        await fake.stop()


def decided(status: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a tick decided, as status shows it (the time of a repeated hold is left out: it is the
    first time the hold was seen, which a new process cannot know)."""
    last = status.get("lastDecision", {})
    return status.get("window"), status.get("policy"), last.get("direction"), last.get("reason")


async def test_a_restart_mid_cooldown_ends_where_no_restart_does(worlds: list[World]) -> None:
    """Preemptions set the memory ceiling and start a cooldown; the operator is replaced two intervals
    later. Every tick after that decides exactly what the operator that kept running decides: the
    cooldown runs out at the same tick, the ceiling holds the cap out of preemption for 20 calm
    intervals, and then lifts at the same tick."""
    steady, restarted = worlds
    for world in worlds:
        world.spec = make_spec(cooldownSeconds=5)
    steady_op = steady.start_operator()
    first_op = restarted.start_operator()
    for _ in range(3):
        assert decided(await steady.tick(steady_op)) == decided(await restarted.tick(first_op))
    ceiling = steady.status()["policy"]["kvCapCeiling"]
    assert ceiling <= KV_SEQS and steady.pod_cap() <= ceiling
    assert "in cooldown" in steady.status()["lastDecision"]["reason"]

    second_op = restarted.start_operator(monotonic_offset_s=12_345.0)
    record = second_op.profiles["ml/chat"]
    assert record.memory.policy_state.kv_cap_ceiling == ceiling
    assert replace(record.memory.policy_state, decisions=0, last_change_s=None) == replace(
        first_op.profiles["ml/chat"].memory.policy_state, decisions=0, last_change_s=None
    )
    patches = restarted.sink.patches
    lifted_at = None
    for tick in range(40):
        expected = decided(await steady.tick(steady_op))
        assert decided(await restarted.tick(second_op)) == expected, f"tick {tick} after the restart"
        if lifted_at is None and (restarted.status()["policy"].get("kvCapCeiling") or 0) > ceiling:
            lifted_at = tick
    assert restarted.sink.patches > patches
    # The ceiling held through the calm intervals (no preemption after the restart until it lifted) ...
    assert lifted_at is not None and lifted_at >= 15
    after_restart = restarted.source.preempting[3:]
    assert not any(after_restart[:lifted_at])
    assert after_restart == steady.source.preempting[3:]


async def test_without_the_memory_a_restart_sends_the_cap_back_into_preemption(worlds: list[World]) -> None:
    """The failure this guards against: the same restart with the memory wiped from status."""
    world = worlds[0]
    operator = world.start_operator()
    for _ in range(4):
        await world.tick(operator)
    assert world.status()["policy"]["kvCapCeiling"] <= KV_SEQS and not world.source.preempting[-1]
    del world.sink.status["ml/chat"]["policy"]
    forgetful = world.start_operator()
    for _ in range(2):
        await world.tick(forgetful)
    assert world.source.preempting[-1]  # the cap climbed straight back


class KillableSink(MemorySink):
    """The API server as a killed operator leaves it: once ``dead``, no patch of it lands any more."""

    def __init__(self) -> None:
        super().__init__()
        self.dead_after_puts: int | None = None  # the process dies once the pod has seen more PUTs than this
        self.pods_puts = lambda: 0

    async def patch_status(self, ref: ProfileRef, patch: Mapping[str, Any]) -> None:
        if self.dead_after_puts is not None and self.pods_puts() > self.dead_after_puts:
            raise RuntimeError("the operator process is gone")
        await super().patch_status(ref, patch)


@pytest.mark.parametrize("killed", ["before-the-push", "after-the-push"])
async def test_killed_mid_tick_the_successor_continues_within_two_intervals(worlds: list[World], killed: str) -> None:
    """The operator dies in the tick that cuts the cap for preemptions: before the push reaches the
    pod, or after it and before the tick's status patch. The changed window and the memory that chose
    it were written ahead of the push, so the successor continues from them: within two intervals
    the pod runs a cap out of preemption, the ceiling is in status, status and pod agree, and the
    cap stays out of preemption."""
    world = worlds[0]
    sink = KillableSink()
    world.sink = sink
    pod = world.fake.pods[POD]
    sink.pods_puts = lambda: pod.puts
    operator = world.start_operator()
    await world.tick(operator)  # cap 64: preempts from the next interval on
    assert world.pod_cap() > KV_SEQS
    sink.dead_after_puts = pod.puts  # the next PUT that lands kills the process before its status patch
    if killed == "before-the-push":
        pod.fail_next = 1000  # no push of the dying tick reaches the pod
    await world.tick(operator)
    assert world.status()["policy"]["kvCapCeiling"] <= KV_SEQS  # written ahead
    assert (world.pod_cap() <= KV_SEQS) == (killed == "after-the-push")
    pod.fail_next = 0
    sink.dead_after_puts = None

    successor = world.start_operator(monotonic_offset_s=777.0)
    collections_before = len(world.source.preempting)
    recovered_at = None
    for interval in range(1, 3):
        status = await world.tick(successor)
        in_force = {k: v for k, v in status["window"].items() if k != "appliedAt"}
        if (
            world.pod_cap() <= KV_SEQS
            and status["policy"].get("kvCapCeiling", math.inf) <= KV_SEQS
            and in_force == pod.state.window.model_dump(by_alias=True)
        ):
            recovered_at = interval
            break
    assert recovered_at is not None, (world.source.preempting, world.status())
    for _ in range(5):
        await world.tick(successor)
    # No interval preempts once the successor has pushed (the first one it observes, before its first
    # push, still runs what the dead operator left on the pod).
    first_pushed = 0 if killed == "after-the-push" else 1
    assert not any(world.source.preempting[collections_before + first_pushed :]), world.source.preempting


async def test_a_spec_changed_while_no_operator_ran_keeps_the_ceiling_within_the_new_bounds(
    worlds: list[World],
) -> None:
    world = worlds[0]
    operator = world.start_operator()
    for _ in range(4):
        await world.tick(operator)
    ceiling = world.status()["policy"]["kvCapCeiling"]
    assert world.status()["policy"]["headroomStreak"] > 0 or world.status()["policy"]["underStreak"] > 0
    # While no operator runs, someone raises bounds.hardCap.min above the ceiling (generation 2).
    world.spec = make_spec(bounds={"hardCap": {"min": ceiling + 2, "max": 512}})  # the window's 64 still fits
    world.generation = 2
    successor = world.start_operator()
    state = successor.profiles["ml/chat"].memory.policy_state
    assert state.kv_cap_ceiling == ceiling + 2
    assert (state.headroom_streak, state.under_streak, state.itl_calm_streak) == (0, 0, 0)
    await world.tick(successor)
    assert world.status()["policy"]["observedGeneration"] == 2
    assert world.status()["policy"]["kvCapCeiling"] == ceiling + 2


async def test_a_spec_change_under_a_running_operator_follows_the_same_rule(worlds: list[World]) -> None:
    world = worlds[0]
    operator = world.start_operator()
    for _ in range(4):
        await world.tick(operator)
    before = operator.profiles["ml/chat"].memory.policy_state
    operator.upsert_profile("ml", "chat", make_spec(30, bounds={"hardCap": {"min": 1, "max": 30}}), generation=2)
    after = operator.profiles["ml/chat"].memory.policy_state
    assert after.kv_cap_ceiling is None  # at or above the new maximum: it no longer limits anything
    assert after.step_curve == before.step_curve and after.calm_streak == before.calm_streak
    assert (after.headroom_streak, after.under_streak) == (0, 0)


async def test_garbage_memory_in_status_starts_fresh_says_so_once_and_is_overwritten(
    worlds: list[World], caplog: pytest.LogCaptureFixture
) -> None:
    world = worlds[0]
    world.sink.status["ml/chat"] = {"policy": {"version": 99, "whatever": [1, 2, 3]}}
    with caplog.at_level(logging.WARNING, logger="batchpilot.operator"):
        operator = world.start_operator()
        for _ in range(3):
            await world.tick(operator)
    warnings = [r.getMessage() for r in caplog.records if "policy memory" in r.getMessage()]
    assert len(warnings) == 1 and "version is 99" in warnings[0]
    assert operator.profiles["ml/chat"].memory.policy_state != PolicyState()
    assert world.status()["policy"]["version"] == 1


async def test_a_quiet_profile_does_not_patch_its_memory_every_interval(worlds: list[World]) -> None:
    """Written only when it changed: a profile without traffic holds, and nothing in status moves."""

    class Silent:
        async def collect(self, targets: Mapping[ModelKey, Sequence[str]]) -> dict[ModelKey, ModelMetrics]:
            return {}

    world = worlds[0]
    operator = world.start_operator()
    for _ in range(3):
        await world.tick(operator)
    operator.source = Silent()
    await world.tick(operator)
    await world.tick(operator)
    patches = world.sink.patches
    for _ in range(3):
        await world.tick(operator)
    assert world.sink.patches == patches
    assert world.status()["policy"]["kvCapCeiling"] <= KV_SEQS
