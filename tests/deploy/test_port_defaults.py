"""One pair of default ports everywhere a runtime's ports are named: ``batchpilot-runtime serve``,
the BatchProfile CRD (``spec.runtime``, what the operator dials), the chart's values and the image.

A runtime started on its defaults must be where a profile on its defaults looks; before, serve
listened on 8000/8001 while the CRD dialled 8080/8081 ("connection refused").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from batchpilot_runtime.cli.main import build_parser
from batchpilot_runtime.contract.admin_api import DEFAULT_ADMIN_PORT, DEFAULT_SERVE_PORT
from tests.deploy.tools import CHART, REPO

CRD_FILES = [
    REPO / "crds" / "batchpilot.dev_batchprofiles.yaml",
    CHART / "crds" / "batchpilot.dev_batchprofiles.yaml",
    REPO / "deploy" / "base" / "crds" / "batchpilot.dev_batchprofiles.yaml",
]


def serve_defaults(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    # The flags' defaults come from BATCHPILOT_PORT / BATCHPILOT_ADMIN_PORT when set: read them unset.
    monkeypatch.delenv("BATCHPILOT_PORT", raising=False)
    monkeypatch.delenv("BATCHPILOT_ADMIN_PORT", raising=False)
    args = build_parser().parse_args(["serve"])
    return args.port, args.admin_port


def crd_defaults(path: Path) -> tuple[int, int]:
    crd = yaml.safe_load(path.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    runtime = schema["properties"]["spec"]["properties"]["runtime"]["properties"]
    return runtime["servePort"]["default"], runtime["adminPort"]["default"]


def chart_defaults() -> tuple[int, int]:
    ports = yaml.safe_load((CHART / "values.yaml").read_text())["runtime"]["ports"]
    return ports["http"], ports["admin"]


def image_defaults() -> tuple[int, int]:
    dockerfile = (REPO / "docker" / "Dockerfile.runtime").read_text()
    command = next(line for line in dockerfile.splitlines() if line.startswith("CMD"))
    serve = re.search(r"--port=(\d+)", command)
    admin = re.search(r"--admin-port=(\d+)", command)
    assert serve and admin, command
    return int(serve.group(1)), int(admin.group(1))


def test_serve_the_crd_the_chart_and_the_image_default_to_the_same_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = (DEFAULT_SERVE_PORT, DEFAULT_ADMIN_PORT)
    found = {
        "batchpilot-runtime serve": serve_defaults(monkeypatch),
        **{f"CRD {path.relative_to(REPO)}": crd_defaults(path) for path in CRD_FILES},
        "chart values runtime.ports": chart_defaults(),
        "docker/Dockerfile.runtime CMD": image_defaults(),
    }
    assert {where: ports for where, ports in found.items() if ports != expected} == {}
    assert expected == (8080, 8081)
