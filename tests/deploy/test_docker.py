"""The container images: their install steps run, in a fresh virtual environment, exactly as the Dockerfiles say.

docker is not available here, so the build stage is replayed: its COPY lines copy the same files
into a scratch source tree, its RUN lines run there with the stage's ARG defaults and ENV (the venv
path moved into a temporary directory), then the result is smoke-tested. torch comes from the
machine's local wheel (TORCH_INDEX_URL set empty) instead of the PyTorch index. Downloads are kept
in a wheelhouse (``~/.cache/batchpilot/wheelhouse``, or ``$BATCHPILOT_WHEELHOUSE``) so that a second
run installs offline.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from batchpilot_operator.cli import main as operator_cli
from batchpilot_runtime.cli import main as runtime_cli

from .tools import CHART, REPO

DOCKER = REPO / "docker"
VENV_IN_IMAGE = "/opt/batchpilot"
WHEELHOUSE = Path(os.environ.get("BATCHPILOT_WHEELHOUSE", Path.home() / ".cache" / "batchpilot" / "wheelhouse"))
INSTALL_TIMEOUT_S = 900


@dataclass
class Stage:
    name: str | None
    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    copies: list[tuple[list[str], str]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    user: str | None = None
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    expose: list[int] = field(default_factory=list)


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    joined: list[str] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    out = []
    for line in joined:
        keyword, _, rest = line.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def _substitute(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def parse_dockerfile(path: Path) -> list[Stage]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in _instructions(path):
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(name=name))
            continue
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            if stages:
                stages[-1].args[name] = default or global_args.get(name, "")
            else:
                global_args[name] = default
            continue
        if not stages:
            raise AssertionError(f"{path.name}: {keyword} before FROM")
        stage = stages[-1]
        variables = {**stage.args, **stage.env}
        if keyword == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                stage.env[key] = _substitute(value, variables)
        elif keyword == "WORKDIR":
            stage.workdir = rest
        elif keyword == "COPY":
            if not rest.startswith("--from"):
                *sources, destination = rest.split()
                stage.copies.append((sources, destination))
        elif keyword == "RUN":
            stage.runs.append(_substitute(rest, variables))
        elif keyword == "USER":
            stage.user = rest
        elif keyword == "ENTRYPOINT":
            stage.entrypoint = _json_list(rest)
        elif keyword == "CMD":
            stage.cmd = _json_list(rest)
        elif keyword == "EXPOSE":
            stage.expose = [int(p.split("/")[0]) for p in rest.split()]
    return stages


def _json_list(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list), text
    return [str(v) for v in value]


IMAGES = {"operator": DOCKER / "Dockerfile.operator", "runtime": DOCKER / "Dockerfile.runtime"}
# The extras docker/install.sh installs into each image.
IMAGE_EXTRAS = {"operator": "operator", "runtime": "runtime,model"}


@pytest.mark.parametrize("image", list(IMAGES))
def test_image_runs_as_non_root_with_the_project_entrypoint(image: str) -> None:
    stages = parse_dockerfile(IMAGES[image])
    build, final = stages[0], stages[-1]
    assert build.name == "build" and len(stages) == 2
    # Numeric, so that the kubelet can enforce runAsNonRoot; the chart runs as the same uid.
    assert final.user == "10001:10001"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert final.entrypoint == [f"batchpilot-{image}"] and final.entrypoint[0] in scripts
    assert final.env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert final.env["PATH"].startswith(f"{VENV_IN_IMAGE}/bin:")
    parser = (operator_cli if image == "operator" else runtime_cli).build_parser()
    parser.parse_args(final.cmd)  # the default command is valid
    for sources, _ in build.copies:
        for source in sources:
            assert (REPO / source).exists(), source


def test_exposed_ports_are_the_charts_ports() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    operator = parse_dockerfile(IMAGES["operator"])[-1]
    runtime = parse_dockerfile(IMAGES["runtime"])[-1]
    assert sorted(operator.expose) == sorted(values["operator"]["ports"].values())
    assert sorted(runtime.expose) == sorted(values["runtime"]["ports"].values())
    assert "--port=8080" in runtime.cmd and "--admin-port=8081" in runtime.cmd


def test_runtime_variant_is_a_build_argument() -> None:
    build = parse_dockerfile(IMAGES["runtime"])[0]
    assert build.args["VARIANT"] == "cpu"
    (run,) = build.runs
    assert "VARIANT=cpu" in run
    script = (DOCKER / "install.sh").read_text()
    assert "cpu)" in script and "cuda)" in script


def _replay_build(image: str, scratch: Path) -> Path:
    """Run the build stage of ``image`` in ``scratch``; return the virtual environment it made."""
    build = parse_dockerfile(IMAGES[image])[0]
    source = scratch / "src"
    source.mkdir(parents=True)
    for sources, destination in build.copies:
        # Relative to WORKDIR; Docker copies a directory's contents, and a file into a directory
        # when the destination ends with "/" or there are several sources.
        base = source / destination.removeprefix(build.workdir).lstrip("/")
        for name in sources:
            origin = REPO / name
            if origin.is_dir():
                shutil.copytree(origin, base, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                target = base / origin.name if destination.endswith("/") or len(sources) > 1 else base
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)
    venv = scratch / "venv"
    env = {**os.environ, **build.env, "TORCH_INDEX_URL": ""}
    find_links = " ".join(filter(None, [os.environ.get("PIP_FIND_LINKS", ""), str(WHEELHOUSE)]))
    offline = {**env, "PIP_FIND_LINKS": find_links, "PIP_NO_INDEX": "1"}
    for run in build.runs:
        command = run.replace(VENV_IN_IMAGE, str(venv))
        result = subprocess.run(
            ["sh", "-c", command],
            cwd=source,
            env=offline,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            # Not everything is in the wheelhouse yet: fetch what the same requirements need, then run again.
            _fill_wheelhouse(image, source, env)
            shutil.rmtree(venv, ignore_errors=True)
            result = subprocess.run(
                ["sh", "-c", command],
                cwd=source,
                env=offline,
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT_S,
                check=False,
            )
        assert result.returncode == 0, f"{image}: {command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return venv


def _fill_wheelhouse(image: str, source: Path, env: dict[str, str]) -> None:
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    requirements = ["setuptools>=68", f"{source}[{IMAGE_EXTRAS[image]}]"]
    if image == "runtime":
        requirements.insert(0, "torch==2.13.0")
    env = {k: v for k, v in env.items() if k != "PIP_NO_CACHE_DIR"}
    subprocess.run(
        ["python3", "-m", "pip", "download", "--dest", str(WHEELHOUSE), *requirements],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S * 2 + 60)
def test_install_steps_run_in_fresh_venvs(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {image: pool.submit(_replay_build, image, tmp_path / image) for image in IMAGES}
        venvs = {image: future.result() for image, future in futures.items()}

    def check(venv: Path, *args: str) -> str:
        result = subprocess.run(
            [str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 0, f"{args}: {result.stdout}\n{result.stderr}"
        return result.stdout

    operator = venvs["operator"]
    check(operator, "batchpilot-operator", "run", "--help")
    # The operator image has kopf and the Kubernetes client, and no torch (DESIGN: the operator never imports it).
    check(
        operator,
        "python",
        "-c",
        "import importlib.util, kopf, kubernetes, prometheus_api_client, batchpilot_operator.frontends.kopf_app;"
        "assert importlib.util.find_spec('torch') is None, 'torch in the operator image'",
    )
    runtime = venvs["runtime"]
    check(runtime, "batchpilot-runtime", "serve", "--help")
    version = check(runtime, "python", "-c", "import torch, fastapi, uvicorn; print(torch.__version__)")
    assert version.startswith("2.13.0"), version
    # GGUF checkpoints load in the runtime image (the model extra), the weights mounted like any checkpoint.
    check(runtime, "python", "-c", "import gguf, batchpilot_runtime.model.gguf_checkpoint")
