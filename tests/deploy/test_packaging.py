"""The chart as an artifact: ``helm package`` makes the .tgz that ``helm push`` sends to an OCI
registry (docs/installing.md), and that package renders what the chart's folder renders."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from .tools import CHART, DEPLOY, KUBERNETES_VERSION, helm_path, helm_template, load_documents, run

QUICKSTART = DEPLOY / "helm" / "quickstart-values.yaml"


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chart")
    run([helm_path(), "package", CHART, "--destination", out])
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    path = out / f"batchpilot-{version}.tgz"
    assert [p.name for p in out.iterdir()] == [path.name]
    return path


def _without_random_token(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # The admin token is drawn afresh on every render without a cluster to look it up in.
    for doc in docs:
        if doc["kind"] == "Secret" and doc["metadata"]["name"].endswith("admin-token"):
            doc["data"] = {key: "<random>" for key in doc["data"]}
    return docs


def test_the_package_holds_the_chart_crd_schema_and_files_but_not_ci_values(package: Path) -> None:
    with tarfile.open(package) as archive:
        names = set(archive.getnames())
    for name in (
        "Chart.yaml",
        "values.yaml",
        "values.schema.json",
        "crds/batchpilot.dev_batchprofiles.yaml",
        "files/batchpilot.rules.yaml",
        "files/batchpilot-dashboard.json",
        "templates/runtimes.yaml",
        "templates/NOTES.txt",
    ):
        assert f"batchpilot/{name}" in names, name
    # ci/ holds the tests' values files: no use to an installer.
    assert not [n for n in names if n.startswith("batchpilot/ci/")]


@pytest.mark.parametrize("values", [None, QUICKSTART], ids=["defaults", "quickstart"])
def test_the_package_renders_what_the_folder_renders(package: Path, values: Path | None) -> None:
    args: list[str | Path] = [
        helm_path(),
        "template",
        "bp",
        package,
        "--namespace",
        "batchpilot-system",
        "--kube-version",
        KUBERNETES_VERSION,
        "--include-crds",
    ]
    if values is not None:
        args += ["--values", values]
    packaged = _without_random_token(load_documents(run(args).stdout))
    folder = _without_random_token(helm_template(*([values] if values else [])))
    assert packaged == folder
    assert {d["kind"] for d in packaged} >= {"CustomResourceDefinition", "Deployment"}


def test_the_package_passes_lint_and_names_its_version(package: Path) -> None:
    run([helm_path(), "lint", "--strict", package])
    shown = yaml.safe_load(run([helm_path(), "show", "chart", package]).stdout)
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (shown["version"], shown["appVersion"]) == (chart["version"], chart["appVersion"])
