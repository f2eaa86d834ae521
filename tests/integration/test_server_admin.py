"""The admin window API: 401 (for reads too), 409, 422 and 200, and the window gauges after a 200."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_runtime.contract import metric_names as mn
from batchpilot_runtime.contract.admin_api import AdminError, WindowState
from batchpilot_runtime.contract.window import MAX_GENERATION
from tests.integration.runtime_process import ThreadRuntime, runtime_thread
from tests.support.factories import make_window_dict


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    with runtime_thread(tmp_path_factory.mktemp("admin"), kv_cache_tokens=2048) as started:
        yield started


@pytest.fixture
def admin(runtime: ThreadRuntime) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime.admin_url, timeout=30.0) as http:
        yield http


def _update(**window: Any) -> dict[str, Any]:
    """A PUT /admin/window body: the shared window with ``window``'s changes, not validated here."""
    return {"window": make_window_dict(**window)}


def _gauges(serve_url: str) -> dict[str, float]:
    text = httpx.get(f"{serve_url}/metrics", timeout=30.0).text
    wanted = {mn.WINDOW_TARGET_BATCH_SIZE, mn.WINDOW_HARD_CAP, mn.WINDOW_MAX_WAIT_SECONDS, mn.WINDOW_GENERATION}
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in wanted}


@pytest.fixture
def auth(runtime: ThreadRuntime) -> dict[str, str]:
    return runtime.auth_headers()


def _in_force(admin: httpx.Client, auth: dict[str, str]) -> WindowState:
    response = admin.get("/admin/window", headers=auth)
    assert response.status_code == 200, response.text
    return WindowState.model_validate(response.json())


def test_get_window_reports_window_and_capacity(admin: httpx.Client, auth: dict[str, str]) -> None:
    state = _in_force(admin, auth)
    assert state.model == "tiny-test"
    assert state.capacity.kv_cache_tokens == 2048
    assert state.capacity.max_hard_cap == 2048 // state.capacity.kv_block_size
    assert state.batching == "continuous"


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-token"}, {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer"}],
)
def test_put_without_valid_token_is_401(admin: httpx.Client, auth: dict[str, str], headers: dict[str, str]) -> None:
    before = _in_force(admin, auth).window
    response = admin.put("/admin/window", json=_update(generation=before.generation + 1), headers=headers)
    assert response.status_code == 401
    refusal = AdminError.model_validate(response.json())
    assert refusal.error == "unauthorized" and refusal.window_in_force is None
    assert _in_force(admin, auth).window == before


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-token"}, {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer"}],
)
def test_get_without_valid_token_is_401_and_tells_nothing(
    runtime: ThreadRuntime, admin: httpx.Client, headers: dict[str, str]
) -> None:
    response = admin.get("/admin/window", headers=headers)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert response.json() == {
        "error": "unauthorized",
        "detail": "a valid 'Authorization: Bearer <token>' header is required",
    }
    assert runtime.ctx.loaded is not None and runtime.ctx.loaded.engine.window_state().model not in response.text


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (_update(generation=50, target=16, cap=8), "hardCap"),
        (_update(generation=50, ratio=1.0), "tailMarkRatio"),
        (_update(generation=50, wait_ms=-1), "maxWaitMs"),
        ({"window": {"targetBatchSize": 2, "hardCap": 4, "generation": 50}}, "maxWaitMs"),
        (
            _update(generation=50, target=8, cap=4000),
            "hardCap",
        ),  # over what 2048 KV tokens can hold: the engine refuses
        ({**_update(generation=50), "surprise": 1}, "surprise"),
        # Strict types: a number sent as a string is a client's bug, never converted (it was applied).
        ({"window": {**make_window_dict(generation=50), "hardCap": "16"}}, "hardCap"),
        ({"window": {**make_window_dict(generation=50), "tailMarkRatio": "2"}}, "tailMarkRatio"),
        ({"window": {**make_window_dict(generation=50), "maxWaitMs": True}}, "maxWaitMs"),
        # A generation past the largest would leave no later one to push: the window would freeze.
        (_update(generation=2**63 - 1), "generation"),
        (_update(generation=MAX_GENERATION + 1), "generation"),
    ],
)
def test_invalid_window_is_422_with_the_reason(
    runtime: ThreadRuntime, admin: httpx.Client, body: dict[str, Any], named: str
) -> None:
    before = _in_force(admin, runtime.auth_headers()).window
    response = admin.put("/admin/window", json=body, headers=runtime.auth_headers())
    assert response.status_code == 422
    refusal = AdminError.model_validate(response.json())
    assert refusal.error == "invalid_window"
    assert named in refusal.detail
    assert refusal.window_in_force == before


def test_non_json_body_is_422(runtime: ThreadRuntime, admin: httpx.Client) -> None:
    response = admin.put("/admin/window", content=b"{not json", headers=runtime.auth_headers())
    assert response.status_code == 422


def test_update_then_stale_generation_then_gauges(runtime: ThreadRuntime, admin: httpx.Client) -> None:
    generation = _in_force(admin, runtime.auth_headers()).window.generation + 10
    # 200: the applied window comes back, and the gauges follow.
    applied = admin.put(
        "/admin/window",
        json=_update(generation=generation, target=3, cap=6, wait_ms=40),
        headers=runtime.auth_headers(),
    )
    assert applied.status_code == 200
    state = WindowState.model_validate(applied.json())
    assert (state.window.target_batch_size, state.window.hard_cap, state.window.generation) == (3, 6, generation)
    assert _gauges(runtime.serve_url) == {
        mn.WINDOW_TARGET_BATCH_SIZE: 3.0,
        mn.WINDOW_HARD_CAP: 6.0,
        mn.WINDOW_MAX_WAIT_SECONDS: 0.04,
        mn.WINDOW_GENERATION: float(generation),
    }
    # The same update again is idempotent (a retried push).
    again = admin.put(
        "/admin/window",
        json=_update(generation=generation, target=3, cap=6, wait_ms=40),
        headers=runtime.auth_headers(),
    )
    assert again.status_code == 200
    # 409: an older generation, or the same generation with other values.
    for body in (_update(generation=generation - 1, target=2, cap=4), _update(generation=generation, target=2, cap=4)):
        stale = admin.put("/admin/window", json=body, headers=runtime.auth_headers())
        assert stale.status_code == 409
        refusal = AdminError.model_validate(stale.json())
        assert refusal.error == "stale_generation"
        assert refusal.window_in_force is not None
        assert refusal.window_in_force.generation == generation
    assert _gauges(runtime.serve_url)[mn.WINDOW_GENERATION] == float(generation)
    # The engine serves under the new window.
    completion = httpx.post(
        f"{runtime.serve_url}/v1/completions", json={"prompt": "after", "max_tokens": 3}, timeout=30.0
    )
    assert completion.status_code == 200


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
_window_like = st.fixed_dictionaries(
    {},
    optional={
        "targetBatchSize": _json_values | st.integers(-5, 5000),
        "hardCap": _json_values | st.integers(-5, 5000),
        "maxWaitMs": _json_values | st.integers(-5, 70_000),
        "tailMarkRatio": _json_values | st.floats(-2, 200),
        "generation": _json_values | st.integers(-3, 10**6),
    },
)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(_json_values, st.fixed_dictionaries({"window": _window_like}, optional={"lanes": _json_values})))
def test_fuzzed_admin_bodies_never_5xx(runtime: ThreadRuntime, admin: httpx.Client, body: Any) -> None:
    response = admin.put("/admin/window", json=body, headers=runtime.auth_headers())
    assert response.status_code in (200, 409, 422), response.text
    if response.status_code != 200:
        assert AdminError.model_validate(response.json()).detail
