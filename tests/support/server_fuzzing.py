"""What the runtime's bad-input and fuzzing suites share: the small runtime they send bad requests
to, its serving client, the hypothesis settings for drawing against a live server, arbitrary JSON
values, and the check that a refusal names what it refuses.

Each suite imports the two fixtures, ``runtime`` and ``serve`` (module scope: one runtime per suite).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.integration.runtime_process import ThreadRuntime, runtime_thread

# A live server is one fixture for every example, and its answers take longer than hypothesis expects.
FUZZ_SETTINGS = settings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.fixture(scope="module", name="runtime")
def runtime_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    """The tiny model, admitting each request at once (target 1, no wait) up to 8, with a context of
    512 tokens, so that bad input is answered quickly and long input is refused."""
    with runtime_thread(
        tmp_path_factory.mktemp("bad-input"), target_batch_size=1, hard_cap=8, max_wait_ms=0, max_model_len=512
    ) as started:
        yield started


@pytest.fixture(scope="module", name="serve")
def serve_fixture(runtime: ThreadRuntime) -> Iterator[httpx.Client]:
    """A client of the runtime's serving app."""
    with httpx.Client(base_url=runtime.serve_url, timeout=60.0) as http:
        yield http


def json_values(*, text_size: int, key_size: int, collection_size: int, max_leaves: int) -> st.SearchStrategy[Any]:
    """Any JSON value: scalars (integers past 64 bits, every float, text up to ``text_size``), and lists
    and objects (keys up to ``key_size``) of up to ``collection_size`` members, ``max_leaves`` scalars in all."""
    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=text_size)
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=collection_size)
            | st.dictionaries(st.text(max_size=key_size), inner, max_size=collection_size)
        ),
        max_leaves=max_leaves,
    )


def check_named_refusal(payload: bytes) -> None:
    """An OpenAI-style error body whose message is not empty and which names the parameter it refuses."""
    error = json.loads(payload)["error"]
    assert error["message"]
    assert error["param"] is not None, error
