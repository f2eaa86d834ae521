"""Fixtures shared by the integration suites."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.llama_server_process import LlamaServerMissing, llama_server_binary


@pytest.fixture(scope="module")
def llama_server_built() -> Path:
    """The built llama-server. A missing one fails the module, saying to run ``make llama-server``: CI
    must run the tests against the real engine, so they never skip."""
    try:
        return llama_server_binary()
    except LlamaServerMissing as missing:
        pytest.fail(str(missing), pytrace=False)
