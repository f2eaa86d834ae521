"""One profile's failure is that profile's alone: a sync or a status that raises (a bug) is logged and
reported on its own profile, and the tick goes on for every other profile."""

from __future__ import annotations

import io
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from batchpilot_operator.control.controller import Controller, PodRecord, ProfileRecord, Settings, StatusFacts
from batchpilot_operator.frontends.local import LocalSink
from batchpilot_operator.io.push import AdminClient, PodTarget, PushResult
from batchpilot_runtime.contract.admin_api import LaneWindow
from batchpilot_runtime.contract.window import Window
from tests.integration.fake_admin import FakeAdminServer
from tests.support.factories import make_spec_dict


class BuggyAdmin(AdminClient):
    """Raises (as a bug would, not as a pod failure) for the pods named in ``broken``."""

    def __init__(self) -> None:
        super().__init__(timeout_s=1.0, retries=1)
        self.broken: set[str] = set()

    async def sync(
        self, target: PodTarget, window: Window, lanes: Sequence[LaneWindow] | None = None, **kwargs: Any
    ) -> PushResult:
        if target.name in self.broken:
            raise RuntimeError(f"bug while pushing to {target.name}")
        return await super().sync(target, window, lanes, **kwargs)


class Env:
    def __init__(self, fake: FakeAdminServer, admin: BuggyAdmin) -> None:
        self.fake, self.admin = fake, admin
        self.out = io.StringIO()
        self.sink = LocalSink(self.out)
        self.now = 1000.0
        self.controller = Controller(
            Settings(interval_override_s=1.0), None, admin, self.sink, match_by_model=True,
            wall_clock=lambda: self.now, monotonic=lambda: self.now,
        )  # fmt: skip
        for model in ("a", "b"):
            self.controller.upsert_pod(
                PodRecord("local", f"{model}-0", ready=True, admin_url=fake.admin_url(model), model=model, uid=model)
            )
            self.controller.upsert_profile("local", model, make_spec_dict(model, tuning=None), generation=1)

    async def tick(self) -> None:
        """One tick of the next interval (every profile due)."""
        self.now += 1.0
        await self.controller.tick()
        await self.controller.drain_events()

    def synced(self, model: str) -> dict[str, Any]:
        conditions = self.sink.status[f"local/{model}"]["conditions"]
        return dict(next(c for c in conditions if c["type"] == "Synced"))


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    async with FakeAdminServer(0) as fake:
        for model in ("a", "b"):
            fake.add_pod(model, model=model, token=None)
        admin = BuggyAdmin()
        yield Env(fake, admin)
        await admin.aclose()


async def test_a_sync_that_raises_fails_its_own_profile_only(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    env.admin.broken.add("local/b-0")
    with caplog.at_level(logging.ERROR, "batchpilot.operator"):
        await env.tick()
        await env.tick()
    assert env.fake.pods["a"].state.window.generation == 1
    assert env.synced("a")["status"] == "True"
    synced = env.synced("b")
    assert (synced["status"], synced["reason"]) == ("False", "PushFailed")
    assert synced["message"] == "sync failed: RuntimeError: bug while pushing to local/b-0"
    assert env.out.getvalue().count("local/b Warning PushFailed: sync failed: RuntimeError") == 1  # not per tick
    assert "sync of local/b failed" in caplog.text and "Traceback" in caplog.text
    assert env.controller.ticks == 2 and env.controller.last_report.push_failures == 1
    env.admin.broken.clear()
    await env.tick()
    assert env.synced("b")["status"] == "True" and env.fake.pods["b"].state.window.generation == 1


async def test_a_status_that_cannot_be_built_leaves_the_others_written(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    facts = env.controller.facts

    def broken_for_b(record: ProfileRecord) -> StatusFacts:
        if record.ref.name == "b":
            raise ValueError("bug in b's status")
        return facts(record)

    monkeypatch.setattr(env.controller, "facts", broken_for_b)
    with caplog.at_level(logging.ERROR, "batchpilot.operator"):
        await env.tick()
    assert env.synced("a")["status"] == "True"
    assert "local/b" not in env.sink.status
    assert env.controller.last_report.status_failures == 1
    assert "status of local/b could not be built" in caplog.text
