"""Server-side apply for the emulator's Deployments and StatefulSets, close enough for the restart path.

kmock's PATCH merges dicts, replaces lists wholesale and passes JSON patches through unapplied; it keeps no
``managedFields``. What the restart path relies on, and this module does, as the API server would:

- **Apply** (``PATCH`` with ``application/apply-patch+yaml`` and ``?fieldManager=``): the apply
  configuration is merged into the object, ``containers``/``initContainers``/``env``/``volumes``/
  ``volumeMounts``/``ports`` merged item by item on their ``name`` (the merge key of their schema), any
  other list replaced as one atomic field. Every leaf the configuration names becomes the manager's. A
  field another manager owns with a different value is a ``409 Conflict`` naming both, unless
  ``force=true``, which takes it over. Fields the manager applied before and leaves out now are removed
  unless another manager owns them.
- **Update** (``PUT``, a whole object, as ``kubectl replace`` or a GitOps sync without server-side apply):
  the object is replaced; the leaves it changed become the updater's (``?fieldManager=``, else
  ``kubectl-replace``), leaves it dropped leave every owner.
- ``metadata.managedFields`` written in the API's shape (``FieldsV1``: ``f:<field>`` and
  ``k:{"name":...}`` for items of keyed lists), one entry per manager and operation.

Not emulated: strategic merge patches (kmock's dict merge still handles every other PATCH of a workload,
and tracks no ownership), defaulting and validation of the result (tests validate it with
kubernetes-validate), ``managedFields`` of other resources, dry runs, and the rollout itself (no
ReplicaSet or pod follows a template change).
"""

from __future__ import annotations

import copy
import datetime
import json
from collections.abc import Iterator, Mapping
from typing import Any

KEYED_LISTS = frozenset({"containers", "initContainers", "env", "volumes", "volumeMounts", "ports"})
Path = tuple[Any, ...]  # str for a field, ("name", value) for an item of a keyed list
Owners = dict[str, tuple[str, set[Path]]]  # manager -> (operation, the leaves it owns)


class ApplyConflict(Exception):
    """Fields another manager owns with other values: the API server's 409 for an apply without force."""


def _keyed(key: Any, value: Any) -> bool:
    return key in KEYED_LISTS and isinstance(value, list) and all(isinstance(i, dict) and "name" in i for i in value)


def leaves(obj: Mapping[str, Any], prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every leaf of ``obj`` (a scalar, an atomic list, an empty dict) with its path; metadata's server-set
    fields and status are no one's."""
    for key, value in obj.items():
        if not prefix and key in ("status", "apiVersion", "kind"):
            continue
        if prefix == ("metadata",) and key not in ("labels", "annotations"):
            continue
        path = (*prefix, key)
        if isinstance(value, dict) and value:
            yield from leaves(value, path)
        elif _keyed(key, value):
            for item in value:
                item_path = (*path, ("name", item["name"]))
                yield (*item_path, "name"), item["name"]
                yield from leaves({k: v for k, v in item.items() if k != "name"}, item_path)
        else:
            yield path, value


def get(obj: Any, path: Path) -> Any:
    for part in path:
        if isinstance(part, tuple):
            obj = next((i for i in obj or [] if isinstance(i, dict) and i.get("name") == part[1]), None)
        elif isinstance(obj, dict):
            obj = obj.get(part)
        else:
            return None
        if obj is None:
            return None
    return obj


def remove(obj: dict[str, Any], path: Path) -> None:
    parent = get(obj, path[:-1]) if len(path) > 1 else obj
    if isinstance(parent, dict):
        parent.pop(path[-1], None)


def merge(target: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` merged into ``target``: dicts recursively, keyed lists item by item, other lists replaced."""
    for key, value in config.items():
        current = target.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            merge(current, value)
        elif _keyed(key, value) and isinstance(current, list):
            for item in value:
                match = next((i for i in current if isinstance(i, dict) and i.get("name") == item["name"]), None)
                if match is None:
                    current.append(copy.deepcopy(item))
                else:
                    merge(match, item)
        else:
            target[key] = copy.deepcopy(value)
    return target


def apply(
    current: Mapping[str, Any], config: Mapping[str, Any], owners: Owners, manager: str, force: bool
) -> dict[str, Any]:
    """The object after ``manager`` applies ``config`` (``owners`` updated in place)."""
    wanted = dict(leaves(config))
    conflicts = [
        (other, path)
        for other, (_, paths) in owners.items()
        if other != manager
        for path in paths & wanted.keys()
        if get(current, path) != wanted[path]
    ]
    if conflicts and not force:
        names = "; ".join(f"{_dotted(path)} owned by {other}" for other, path in conflicts)
        raise ApplyConflict(f"Apply failed with {len(conflicts)} conflicts: {names}")
    for other, path in conflicts:
        owners[other][1].discard(path)
    after = merge(copy.deepcopy(dict(current)), config)
    _, before = owners.get(manager, ("Apply", set()))
    still_owned = {p for other, (_, paths) in owners.items() if other != manager for p in paths}
    for path in sorted(before - wanted.keys() - still_owned, key=len, reverse=True):
        remove(after, path)
    owners[manager] = ("Apply", set(wanted))
    return after


def update(current: Mapping[str, Any], new: Mapping[str, Any], owners: Owners, manager: str) -> dict[str, Any]:
    """The object after ``manager`` replaces it with ``new``: changed leaves become its, dropped ones no one's."""
    new_leaves = dict(leaves(new))
    changed = {path for path, value in new_leaves.items() if get(current, path) != value}
    for _, paths in owners.values():
        paths.difference_update(changed)
        paths.intersection_update(new_leaves.keys())
    operation, mine = owners.get(manager, ("Update", set()))
    owners[manager] = (operation, mine | changed)
    return copy.deepcopy(dict(new))


def _dotted(path: Path) -> str:
    return ".".join(f"[name={p[1]}]" if isinstance(p, tuple) else str(p) for p in path)


def fields_v1(paths: set[Path]) -> dict[str, Any]:
    """The FieldsV1 map of a set of leaf paths (what ``metadata.managedFields[].fieldsV1`` holds)."""
    root: dict[str, Any] = {}
    for path in paths:
        node = root
        for part in path:
            if isinstance(part, tuple):
                key = "k:" + json.dumps({part[0]: part[1]}, separators=(",", ":"))
                node = node.setdefault(key, {".": {}})
            else:
                node = node.setdefault(f"f:{part}", {})
    return root


def managed_fields(owners: Owners, api_version: str) -> list[dict[str, Any]]:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return [
        {"manager": manager, "operation": operation, "apiVersion": api_version, "time": now,
         "fieldsType": "FieldsV1", "fieldsV1": fields_v1(paths)}
        for manager, (operation, paths) in sorted(owners.items())
        if paths
    ]  # fmt: skip
