"""The runtime must not import kopf or the Kubernetes client; the operator must not
import torch; the wire contract imports neither torch nor a web framework.

Each check runs in a fresh interpreter where the forbidden packages cannot be
imported, which is what an install with only the matching extra looks like. An import inside a
function escapes that check until the function runs, so the operator's sources are also read for
any import of torch or of the runtime's engine and model, wherever it stands."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BLOCKER = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    class Block:
        def __init__(self, names):
            self.names = names
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.names:
                raise ImportError(f"blocked import of {name}")
            return None

    sys.meta_path.insert(0, Block(set(sys.argv[1].split(","))))
    for target in sys.argv[2].split(","):
        if target.endswith(".*"):
            package = importlib.import_module(target[:-2])
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                if info.name.split(".")[-1] not in set(sys.argv[3].split(",")):
                    importlib.import_module(info.name)
        else:
            importlib.import_module(target)
    print("ok")
    """
)

# matplotlib is the optional `report` extra: no operator module may need it at import time.
OPERATOR_FORBIDDEN = "torch,transformers,fastapi,uvicorn,starlette,safetensors,matplotlib"
RUNTIME_FORBIDDEN = "kopf,kubernetes,prometheus_api_client,kmock"
CONTRACT_FORBIDDEN = "torch,fastapi,uvicorn,starlette,kopf,kubernetes"
# The pure parts: tuning, the status they report, the simulator and the scheduler do no I/O.
PURE_FORBIDDEN = "torch,httpx,aiohttp,requests,kopf,kubernetes,kmock,prometheus_api_client,fastapi,uvicorn,starlette"
PURE_MODULES = (
    "batchpilot_operator.tuning.*,batchpilot_operator.sim.*,batchpilot_operator.control.status,"
    "batchpilot_runtime.scheduling.*"
)
# The controller's core beside its loop: what exists, the conditions and the status facts do no I/O either.
CONTROL_CORE_MODULES = (
    "batchpilot_operator.control.records,batchpilot_operator.control.registry,batchpilot_operator.control.plan,"
    "batchpilot_operator.control.settings,"
    "batchpilot_operator.control.conditions,batchpilot_operator.control.facts,batchpilot_operator.io.outcomes"
)
# batchpilot-gate runs as a sidecar beside an engine: no torch, no model, no tokenizer, no chat templates.
GATE_FORBIDDEN = "torch,transformers,safetensors,tokenizers,gguf,jinja2,numpy,kopf,kubernetes,prometheus_api_client"
GATE_MODULES = "batchpilot_runtime.gate.*"
# The gate's serving port is raw ASGI: it reads bodies with the runtime's decoder, not through fastapi.
WEB_FRAMEWORKS = "fastapi,starlette"
GATE_PROXY_MODULES = "batchpilot_runtime.gate.proxy,batchpilot_runtime.server.json_body"
CONTRACT_MODULES = "batchpilot_runtime,batchpilot_runtime.contract.window,batchpilot_runtime.contract.admin_api,batchpilot_runtime.contract.metric_names,batchpilot_runtime.replay.trace"


def _run(forbidden: str, targets: str, skip: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, forbidden, targets, skip or "-"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("forbidden", "targets"),
    [
        pytest.param(OPERATOR_FORBIDDEN, "batchpilot_operator.*", id="operator-without-torch"),
        pytest.param(RUNTIME_FORBIDDEN, "batchpilot_runtime.*", id="runtime-without-kopf"),
        pytest.param(CONTRACT_FORBIDDEN, CONTRACT_MODULES, id="contract-without-torch-or-web"),
        pytest.param(PURE_FORBIDDEN, PURE_MODULES, id="pure-parts-without-io"),
        pytest.param(PURE_FORBIDDEN, CONTROL_CORE_MODULES, id="control-core-without-io"),
        pytest.param(GATE_FORBIDDEN, GATE_MODULES, id="gate-without-torch-or-model"),
        pytest.param(WEB_FRAMEWORKS, GATE_PROXY_MODULES, id="gate-proxy-without-web-framework"),
    ],
)
def test_import_boundary(forbidden: str, targets: str) -> None:
    result = _run(forbidden, targets)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_blocker_really_blocks() -> None:
    result = _run("json", "json")
    assert result.returncode != 0
    assert "blocked import of json" in result.stderr


OPERATOR_SOURCES = Path(__file__).resolve().parents[2] / "operator" / "batchpilot_operator"
# The runtime's parts that load torch: the operator reaches them only through a runtime process.
TORCH_LOADING = ("torch", "batchpilot_runtime.engine", "batchpilot_runtime.model", "batchpilot_runtime.server")


def _imported_modules(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.append(node.module)
    return names


def test_no_operator_module_imports_torch_even_inside_a_function() -> None:
    offenders = [
        f"{path.relative_to(OPERATOR_SOURCES.parent)}: {name}"
        for path in sorted(OPERATOR_SOURCES.rglob("*.py"))
        for name in _imported_modules(ast.parse(path.read_text(), str(path)))
        if any(name == banned or name.startswith(banned + ".") for banned in TORCH_LOADING)
    ]
    assert sorted(OPERATOR_SOURCES.rglob("*.py")), f"no sources under {OPERATOR_SOURCES}"
    assert offenders == []
