"""The API fuzzer: schemathesis against the runtime's serving and admin apps and the gate's, each
from its own OpenAPI document (``/openapi.json``), with the admin token, bounded in examples and
seeded so that a run reproduces.

Checks (``st run --checks all`` less one): no 5xx; every status, media type, header and body as
the document says; input the document rules out is refused; a 405 names the path's methods; and,
after the run, the app still answers ``/healthz``. Left out: ``positive_data_acceptance``, since
the API has rules a JSON schema cannot state (a prompt longer than the pod's context, a cap above
its KV capacity, ``targetBatchSize <= hardCap``, ``max_tokens`` against ``max_completion_tokens``),
each refused with a 4xx naming the field; its findings where the document could say more were
fixed (non-empty stop strings and prompts).

A failure prints schemathesis's report: each case with a ``curl`` line that replays it. Keep what
it finds as a test beside the code it broke (tests/integration/test_server_*.py, test_gate*.py).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from batchpilot_runtime.contract.admin_api import ADMIN_WINDOW_PATH
from batchpilot_runtime.contract.window import Window
from tests.integration.gate_process import GateThread, gate_thread
from tests.integration.runtime_process import ThreadRuntime, runtime_thread

CONFIG = Path(__file__).resolve().parents[1] / "fuzz" / "schemathesis.toml"
SCHEMATHESIS = Path(sys.executable).parent / "st"
# Per operation; about 40 s for the serving app's 7 operations on the 2-core CI machine.
MAX_EXAMPLES = 120
SEED = 20261203

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    """The tiny model, admitting at once, with a short context so that long prompts are refused."""
    with runtime_thread(
        tmp_path_factory.mktemp("fuzz"), target_batch_size=1, hard_cap=8, max_wait_ms=0, max_model_len=256
    ) as started:
        yield started


@pytest.fixture(scope="module")
def gated(runtime: ThreadRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateThread]:
    window = Window(target_batch_size=1, hard_cap=4, max_wait_ms=0)
    with gate_thread(tmp_path_factory.mktemp("fuzz-gate"), runtime.serve_url, window, max_hard_cap=8) as gate:
        yield gate


def fuzz(base_url: str, alive_path: str, headers: dict[str, str] | None = None) -> None:
    """Run schemathesis against the app at ``base_url``; fail with its report when it finds anything,
    and when the app no longer answers 200 on ``alive_path`` afterwards."""
    command = [
        str(SCHEMATHESIS),
        "--config-file",
        str(CONFIG),
        "run",
        f"{base_url}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        str(SEED),
        "--continue-on-failure",
        "--request-timeout",
        "60",
        "--no-color",
    ]
    for name, value in (headers or {}).items():
        command += ["--header", f"{name}: {value}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    report = run.stdout[-20_000:] + run.stderr[-5_000:]
    assert run.returncode == 0, report
    assert " passed" in report and "failure" not in report.split("SUMMARY")[-1], report
    assert httpx.get(f"{base_url}{alive_path}", headers=headers, timeout=30.0).status_code == 200


def test_runtime_serving_app(runtime: ThreadRuntime) -> None:
    fuzz(runtime.serve_url, "/healthz")


def test_runtime_admin_app(runtime: ThreadRuntime) -> None:
    fuzz(runtime.admin_url, ADMIN_WINDOW_PATH, runtime.auth_headers())


def test_gate_admin_app(gated: GateThread) -> None:
    fuzz(gated.admin_url, ADMIN_WINDOW_PATH, gated.auth_headers())


def test_gate_serving_app(gated: GateThread) -> None:
    # In front of the runtime: the gate's own refusals and the runtime's answers, passed through.
    fuzz(gated.serve_url, "/healthz")
