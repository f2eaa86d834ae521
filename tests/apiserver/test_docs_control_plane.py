"""docs/development.md's ```bash control-plane block runs as written: the build (reused), ``up``, the CRD
applied with kubectl, an example profile applied and listed, ``down``.

Its folder is a fresh one of this test's (the page's /tmp path replaced), so that it starts a control
plane of its own beside the session's; kubectl is the one the deployment tests use."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.tools import kubectl_path
from tests.support.control_plane import BINARIES_ENV, control_plane_binaries

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "development.md"
PAGE_DIR = "/tmp/bp-control-plane"


def _block() -> list[str]:
    found = re.search(r"^```bash control-plane\n(.*?)^```", PAGE.read_text(), re.MULTILINE | re.DOTALL)
    assert found, f"{PAGE} has no ```bash control-plane block"
    return [line for line in found.group(1).splitlines() if line.strip()]


def test_the_pages_control_plane_commands_run_as_written(tmp_path: Path) -> None:
    lines = _block()
    assert (
        lines[1] == f"scripts/control-plane.sh up {PAGE_DIR}"
        and lines[-1] == f"scripts/control-plane.sh down {PAGE_DIR}"
    )
    folder = tmp_path / "cp"
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(kubectl_path().parent), str(Path(sys.executable).parent), os.environ["PATH"]]),
        BINARIES_ENV: str(control_plane_binaries()),
    }
    outputs = []
    try:
        for line in lines:
            command = line.replace(PAGE_DIR, str(folder))
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                timeout=240, check=False,
            )  # fmt: skip
            assert result.returncode == 0, f"{line}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
            outputs.append(result.stdout)
    finally:
        subprocess.run(["scripts/control-plane.sh", "down", str(folder)], cwd=ROOT, env=env, check=False, timeout=60)
    assert outputs[1].strip() == f"{folder}/kubeconfig"  # `up` prints the kubeconfig's path
    listed = outputs[-2].splitlines()
    assert listed[0].split()[:3] == ["NAMESPACE", "NAME", "MODEL"] and listed[1].split()[:2] == [
        "default",
        "chat-assistant",
    ]
