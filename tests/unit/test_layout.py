"""The code's shape, as issue 30 states it: modules under 600 lines, functions under 80, and no import
cycle between modules or between subpackages, so that each part can be read (and changed) on its own.

Imports are read from the source with ``ast``, those inside functions included (a lazy import still
ties two modules together); only imports under ``if TYPE_CHECKING:`` are left out, since nothing
runs them."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "batchpilot_operator": ROOT / "operator" / "batchpilot_operator",
    "batchpilot_runtime": ROOT / "runtime" / "batchpilot_runtime",
}
CHECKED = (ROOT / "operator", ROOT / "runtime", ROOT / "tests", ROOT / "scripts")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources() -> Iterator[Path]:
    for top in CHECKED:
        yield from sorted(p for p in top.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            modules[_module_name(package, root, path)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that module ``name`` (at ``path``) imports."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _subpackage(module: str) -> str:
    """``batchpilot_operator.tuning.policy`` -> ``batchpilot_operator.tuning``; a top-level module is its own."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_import_cycle_between_modules() -> None:
    assert _cycles(_graph()) == []


def test_no_import_cycle_between_subpackages() -> None:
    packages: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        edges = packages.setdefault(_subpackage(module), set())
        edges.update(_subpackage(t) for t in targets if _subpackage(t) != _subpackage(module))
    # A package's __init__ and its top-level modules are one node each; the package itself
    # (batchpilot_operator) importing a subpackage that imports it back would be a cycle too.
    assert _cycles(packages) == []


def test_every_module_is_under_the_line_limit() -> None:
    over = {
        str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) >= MAX_MODULE_LINES
    }
    assert over == {}


def test_every_function_is_under_the_line_limit() -> None:
    over = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines >= MAX_FUNCTION_LINES:
                    over[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert over == {}


def test_the_cycle_finder_finds_a_cycle_and_only_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from batchpilot_operator.tuning import policy", {"batchpilot_operator.tuning.policy"}),
        ("from batchpilot_operator.tuning.policy import decide", {"batchpilot_operator.tuning.policy"}),
        ("from . import policy", {"batchpilot_operator.tuning.policy"}),
        ("def f():\n    import batchpilot_operator.tuning.policy", {"batchpilot_operator.tuning.policy"}),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from batchpilot_operator.tuning import policy",
            set(),
        ),
    ],
)
def test_imports_are_resolved_to_modules(tmp_path: Path, source: str, expected: set[str]) -> None:
    path = tmp_path / "budget.py"
    path.write_text(source + "\n")
    modules = {"batchpilot_operator.tuning": tmp_path / "__init__.py", "batchpilot_operator.tuning.policy": path}
    assert _imported("batchpilot_operator.tuning.budget", path, modules) == expected
