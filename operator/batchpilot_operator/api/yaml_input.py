"""Reading the YAML files a user hands the operator (``validate``, local mode, the simulator), within bounds.

Every file goes through :func:`read_yaml_documents`, which refuses it with a :class:`YamlInputError` naming
the file, in bounded time and memory, when it is:

- larger than ``MAX_FILE_BYTES`` (checked before it is read, and again while reading at most one byte more);
- not UTF-8, or not YAML (PyYAML's own error, with the file's name, line and column);
- nested deeper than ``MAX_DEPTH`` collections, counting what its aliases stand for (PyYAML's composer
  recurses once per level, so a deep file would otherwise end in a ``RecursionError``);
- larger than ``MAX_NODES`` nodes once every alias is expanded (a "billion laughs" file shares one node per
  anchor and loads cheaply, but anything that walks the result walks the expansion), or holding an alias
  inside the node it names (a cycle, which no walk ends).

Both counts are taken while the document is composed, so a hostile file is stopped before it is built.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import Node

# kube-apiserver refuses a request body over 3 MiB (its MaxRequestBodyBytes), so no manifest it accepts is larger.
MAX_FILE_BYTES = 3 * 1024 * 1024
# A BatchProfile nests 6 collections deep and our CRD 17; 100 leaves room for any manifest kept beside them,
# while PyYAML's composer, at about 2 Python frames a level, stays far from the interpreter's limit of 1000.
MAX_DEPTH = 100
# All documents of a file together, aliases expanded. A BatchProfile has about 50 nodes and our 53 KB CRD 2,114
# (25 bytes a node), so 100,000 admits any file of profiles and most manifests up to 2.5 MB. PyYAML's nodes cost
# about 650 bytes each, so composing stays under ~70 MB, and a file past the bound is refused when it passes it.
MAX_NODES = 100_000


class YamlInputError(ValueError):
    """A YAML file refused as a whole; ``problem`` says why, and the message names the file."""

    def __init__(self, source: str, problem: str) -> None:
        self.source = source
        self.problem = problem
        super().__init__(f"{source}: {problem}")


class YamlLimitError(yaml.YAMLError):
    """A document past :data:`MAX_DEPTH` or :data:`MAX_NODES`, or with a cyclic alias."""

    def __init__(self, problem: str, mark: object) -> None:
        # PyYAML's marks print the file, line and column, and a snippet of the line with a caret under the place.
        super().__init__(f"{problem}\n{mark}")


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, counting the depth and the nodes of what it composes with every alias expanded.

    An alias counts as the nodes and the height of the node it names (kept in ``_extent`` per anchor), so
    the counts are those a walk of the loaded data meets, while the composer itself stays linear in the file.
    """

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self.name = source  # PyYAML's marks (and so its messages) name the file
        self._depth = 0  # collections open around the node being composed
        self._reach = 0  # deepest level the open subtree reaches, aliases expanded
        self._nodes = 0  # nodes composed so far in the file, aliases expanded
        self._extent: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, height) of its finished node

    def compose_document(self) -> Node | None:
        node: Node | None = super().compose_document()
        self._extent = {}  # anchors are per document, as in the composer
        return node

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        depth = self._depth + 1
        # A node starts here: an alias, a scalar, or a collection's start (the stubs leave peek_event untyped).
        event: yaml.NodeEvent = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            anchor = str(event.anchor)  # an alias always names one
            if anchor in self.anchors and anchor not in self._extent:
                raise YamlLimitError(f"alias *{anchor} is inside the node it names (a cycle)", event.start_mark)
            nodes, height = self._extent.get(anchor, (1, 1))  # an unknown anchor: the composer's error follows
            self._count(nodes, depth + height - 1, event)
            aliased: Node | None = super().compose_node(parent, index)
            return aliased
        self._count(1, depth, event)
        nodes_before, outer_reach = self._nodes - 1, self._reach
        self._depth, self._reach = depth, depth
        try:
            node: Node | None = super().compose_node(parent, index)
        finally:
            self._depth = depth - 1
        if event.anchor is not None:
            self._extent[event.anchor] = (self._nodes - nodes_before, self._reach - depth + 1)
        self._reach = max(outer_reach, self._reach)
        return node

    def _count(self, nodes: int, reach: int, event: yaml.Event) -> None:
        self._nodes += nodes
        self._reach = max(self._reach, reach)
        if reach > MAX_DEPTH:
            raise YamlLimitError(f"nested deeper than {MAX_DEPTH} levels (aliases expanded)", event.start_mark)
        if self._nodes > MAX_NODES:
            raise YamlLimitError(f"more than {MAX_NODES} nodes (aliases expanded)", event.start_mark)


def _read_bounded(path: Path) -> bytes:
    """The file's bytes, refused by its size before reading, and read no further than one byte past the bound."""
    source = str(path)
    try:
        with path.open("rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            if size > MAX_FILE_BYTES:
                raise YamlInputError(source, f"too large: {size} bytes, over the limit of {_limit_text()}")
            # read(n) allocates n bytes up front: ask for the size the file has, and for more only when
            # it gives more (it grew meanwhile, or it is a device whose size reads 0), to the bound.
            data = stream.read(size + 1)
            if len(data) > size:
                data += stream.read(MAX_FILE_BYTES + 1 - len(data))
    except OSError as error:
        raise YamlInputError(source, f"cannot read: {error.strerror or error}") from None
    if len(data) > MAX_FILE_BYTES:
        raise YamlInputError(source, f"too large: more than {_limit_text()}")
    return data


def _limit_text() -> str:
    return f"{MAX_FILE_BYTES} bytes (3 MiB, the largest request the API server accepts)"


def read_yaml_documents(path: Path) -> list[Any]:
    """Every document of the YAML file at ``path``, loaded safely; raise :class:`YamlInputError` naming the
    file when it cannot be read, is not YAML, or is past a bound (see the module's docstring)."""
    source = str(path)
    data = _read_bounded(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise YamlInputError(source, f"not UTF-8 text: byte {error.start} cannot be decoded") from None
    loader = _BoundedLoader(text, source)
    try:
        documents = []
        while loader.check_data():  # type: ignore[no-untyped-call]  # untyped in the stubs
            documents.append(loader.get_data())
        return documents
    except YamlLimitError as error:
        raise YamlInputError(source, f"refused: {error}") from None
    except yaml.YAMLError as error:
        raise YamlInputError(source, f"invalid YAML: {error}") from None
    except ValueError as error:
        # A scalar PyYAML resolves but Python refuses: an int of more than 4300 digits, a 13th month.
        raise YamlInputError(source, f"invalid YAML value: {error}") from None
    finally:
        loader.dispose()
