"""The controller's tick against emulated pods (``FakeAdminServer``), a metric source the test
brings, and an in-memory API (``MemorySink``), on a clock the test moves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

from batchpilot_operator.control.controller import Controller, PodRecord, ProfileRef, Settings
from batchpilot_operator.control.status import apply_merge_patch
from batchpilot_operator.io.push import AdminClient
from tests.integration.fake_admin import FakeAdminServer


class MemorySink:
    """Status patches merged in memory, events listed; ``fail_patches`` conflicts first."""

    def __init__(self) -> None:
        self.status: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str, str, str]] = []
        self.fail_patches = 0
        self.patches = 0

    async def patch_status(self, ref: ProfileRef, patch: Mapping[str, Any]) -> None:
        if self.fail_patches > 0:
            self.fail_patches -= 1
            raise RuntimeError("409 Conflict: the object has been modified")
        self.patches += 1
        self.status[ref.key] = apply_merge_patch(self.status.get(ref.key), patch)

    async def event(self, ref: ProfileRef, type_: str, reason: str, message: str) -> None:
        self.events.append((ref.key, type_, reason, message))

    async def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        return "secret"

    def reasons(self, key: str) -> list[str]:
        return [reason for k, _, reason, _ in self.events if k == key]

    def messages(self, reason: str) -> list[str]:
        return [message for _, _, r, message in self.events if r == reason]


SourceT = TypeVar("SourceT")


class ControllerHarness(Generic[SourceT]):
    """One controller with its fakes; ``tick`` moves the clock a second and runs one tick."""

    def __init__(self, fake: FakeAdminServer, controller: Controller, sink: MemorySink, source: SourceT) -> None:
        self.fake, self.controller, self.sink, self.source = fake, controller, sink, source
        self.now = 1000.0

    async def tick(self) -> None:
        self.now += 1.0
        await self.controller.tick()
        await self.controller.drain_events()

    def add_pod(self, pod_id: str, model: str = "chat", *, admin_url: str | None = None) -> PodRecord:
        if pod_id not in self.fake.pods:
            self.fake.add_pod(pod_id, model=model, max_hard_cap=64)
        pod = PodRecord(
            "ml", f"{model}-{pod_id}", {"app": model}, ip="127.0.0.1", ready=True,
            admin_url=admin_url or self.fake.admin_url(pod_id), uid=f"uid-{pod_id}",
        )  # fmt: skip
        self.controller.upsert_pod(pod)
        return pod

    def status(self, name: str = "chat") -> dict[str, Any]:
        return self.sink.status[f"ml/{name}"]

    def condition(self, type_: str, name: str = "chat") -> dict[str, Any]:
        return next(c for c in self.status(name)["conditions"] if c["type"] == type_)


HarnessT = TypeVar("HarnessT", bound=ControllerHarness[Any])


@asynccontextmanager
async def controller_harness(source: Any, harness_type: type[HarnessT]) -> AsyncIterator[HarnessT]:
    """A ``harness_type`` around a controller that reads ``source``: one-second intervals, token
    ``secret`` for namespace ``ml``, quick admin retries that never really sleep."""

    async def no_sleep(_: float) -> None:
        await asyncio.sleep(0)

    async with FakeAdminServer(0) as fake:
        sink = MemorySink()
        admin = AdminClient(timeout_s=0.5, retries=2, backoff_s=0.01, sleep=no_sleep)
        harness: HarnessT
        controller = Controller(
            Settings(interval_override_s=1.0, default_token="secret", default_token_namespaces=frozenset({"ml"})),
            source,
            admin,
            sink,
            wall_clock=lambda: harness.now,
            monotonic=lambda: harness.now,
        )
        harness = harness_type(fake, controller, sink, source)
        try:
            yield harness
        finally:
            await admin.aclose()
