"""Read BatchProfiles from YAML files or folders (``validate`` and local mode).

A file may hold several documents (``---``) and ``kind: List`` wrappers.
Documents of other kinds are skipped, so that a folder of mixed manifests
(a kustomization, a Deployment beside the profiles) can be pointed at as it is.
Every BatchProfile comes back, valid or not: a bad one carries the error naming
its fields instead of stopping the whole load. Files are read by
:func:`~batchpilot_operator.api.yaml_input.read_yaml_documents`, within its bounds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchpilot_operator import API_VERSION, GROUP, KIND
from batchpilot_operator.api.metadata import dns1123_label_errors, dns1123_subdomain_errors
from batchpilot_operator.api.profile import BatchProfileSpec, ProfileError, parse_manifest
from batchpilot_operator.api.yaml_input import YamlInputError, read_yaml_documents

YAML_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class LoadedProfile:
    """One BatchProfile document: ``spec`` when it validates, ``error`` otherwise (never both).

    ``problems`` holds the error's parts, one per bad field (``error`` joins them).
    """

    source: str
    namespace: str
    name: str | None
    spec: BatchProfileSpec | None = None
    error: str | None = None
    manifest: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    problems: tuple[str, ...] = field(default=(), compare=False)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def _yaml_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in YAML_SUFFIXES)
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"no such file or folder: {path}")


def _documents(document: Any) -> Iterator[Any]:
    """Flatten ``kind: List`` wrappers (what ``kubectl get -o yaml`` writes)."""
    if isinstance(document, dict) and document.get("kind") == "List" and isinstance(document.get("items"), list):
        for item in document["items"]:
            yield from _documents(item)
    elif document is not None:
        yield document


def _is_batch_profile(document: Any) -> bool:
    if not isinstance(document, dict):
        return False
    api_version = str(document.get("apiVersion") or "")
    return document.get("kind") == KIND or api_version.split("/")[0] == GROUP


def _identity(metadata: Any) -> tuple[str, str | None]:
    """The namespace and name a profile's problems are filed under: each only when valid, since an invalid
    one (maybe a megabyte long) is shown, cut short, by the problem that refuses it."""
    metadata = metadata if isinstance(metadata, dict) else {}
    name, namespace = metadata.get("name"), metadata.get("namespace")
    valid_name = isinstance(name, str) and bool(name) and not dns1123_subdomain_errors(name)
    valid_namespace = isinstance(namespace, str) and bool(namespace) and not dns1123_label_errors(namespace)
    return (namespace if valid_namespace else "default"), (name if valid_name else None)


def _load_document(source: str, document: dict[str, Any]) -> LoadedProfile:
    namespace, name = _identity(document.get("metadata"))
    try:
        namespace, parsed_name, spec = parse_manifest(document)
    except ProfileError as error:
        return LoadedProfile(
            source=source,
            namespace=namespace,
            name=name,
            error=str(error),
            manifest=document,
            problems=tuple(error.problems),
        )
    return LoadedProfile(source=source, namespace=namespace, name=parsed_name, spec=spec, manifest=document)


def load_profiles(path: Path) -> list[LoadedProfile]:
    """Every BatchProfile in ``path`` (a YAML file, or a folder searched recursively), in file order.

    A file that cannot be read, is not valid YAML or is past a bound of the YAML reader yields one
    entry with the reason.
    Raises FileNotFoundError when ``path`` does not exist.
    """
    loaded: list[LoadedProfile] = []
    for file in _yaml_files(path):
        source = str(file)
        try:
            documents = read_yaml_documents(file)
        except YamlInputError as error:
            loaded.append(
                LoadedProfile(
                    source=source, namespace="default", name=None, error=error.problem, problems=(error.problem,)
                )
            )
            continue
        for top in documents:
            for document in _documents(top):
                if not _is_batch_profile(document):
                    continue
                loaded.append(_load_document(source, document))
    return loaded


def profile_manifest(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A BatchProfile manifest as ``kubectl apply`` would take it (used by tests and the demo)."""
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace}, "spec": spec}
