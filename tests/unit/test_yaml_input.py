"""The bounded YAML reader: hostile files are refused naming the file, within a memory bound measured in bytes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchpilot_operator.api.yaml_input import MAX_DEPTH, MAX_FILE_BYTES, MAX_NODES, YamlInputError, read_yaml_documents

MiB = 1024 * 1024


def peak_bytes(action: Callable[[], Any]) -> int:
    """The peak of Python allocations while ``action`` runs (it may raise; the peak is measured anyway)."""
    tracemalloc.start()
    try:
        action()
    except YamlInputError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def refusal(path: Path) -> str:
    with pytest.raises(YamlInputError) as caught:
        read_yaml_documents(path)
    assert caught.value.source == str(path)
    assert str(caught.value).startswith(f"{path}: ")
    return caught.value.problem


def billion_laughs(levels: int) -> str:
    """Each anchor is nine aliases of the one before: 9**levels strings once expanded, from a few hundred bytes."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_deep_nesting_is_refused_naming_the_file_in_little_memory(tmp_path: Path) -> None:
    # The file: PyYAML's composer recursed once per '[' and ended in a RecursionError.
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 500 + "]" * 500 + "\n")
    problem = refusal(deep)
    assert problem.startswith(f"refused: nested deeper than {MAX_DEPTH} levels (aliases expanded)\n")
    assert f'in "{deep}", line 1, column 103' in problem  # the 101st '[' (column 4 holds the first)
    assert peak_bytes(lambda: read_yaml_documents(deep)) < 2 * MiB


def test_nesting_is_accepted_up_to_the_bound_and_refused_one_past_it(tmp_path: Path) -> None:
    at_bound = tmp_path / "at.yaml"
    at_bound.write_text("[" * MAX_DEPTH + "]" * MAX_DEPTH + "\n")
    past = tmp_path / "past.yaml"
    past.write_text("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n")
    (document,) = read_yaml_documents(at_bound)
    depth = 0
    while isinstance(document, list):
        document, depth = (document[0] if document else None), depth + 1
    assert depth == MAX_DEPTH
    assert refusal(past).startswith(f"refused: nested deeper than {MAX_DEPTH} levels")


def test_aliases_count_the_depth_of_what_they_name(tmp_path: Path) -> None:
    # 60 levels under an anchor, named 50 levels down: 111 levels for anything that walks the result.
    path = tmp_path / "deep-alias.yaml"
    path.write_text("a: &a " + "[" * 60 + "]" * 60 + "\nb: " + "[" * 50 + "*a" + "]" * 50 + "\n")
    problem = refusal(path)
    assert problem.startswith(f"refused: nested deeper than {MAX_DEPTH} levels (aliases expanded)\n")
    assert f'in "{path}", line 2, column 54' in problem  # at the alias


def test_a_file_over_3_mib_is_refused_by_its_size_before_it_is_read(tmp_path: Path) -> None:
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as stream:
        stream.truncate(100 * MiB)  # sparse: 100 MB to stat, nothing on disk
    assert refusal(huge) == (
        f"too large: {100 * MiB} bytes, over the limit of {MAX_FILE_BYTES} bytes "
        "(3 MiB, the largest request the API server accepts)"
    )
    assert peak_bytes(lambda: read_yaml_documents(huge)) < 64 * 1024


def test_a_file_of_exactly_3_mib_is_read(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "x" * (MAX_FILE_BYTES - 4) + "\n")
    assert read_yaml_documents(path) == [{"a": "x" * (MAX_FILE_BYTES - 4)}]


def test_billion_laughs_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    bomb = tmp_path / "laughs.yaml"
    bomb.write_text(billion_laughs(9))  # 9**9 = 387,420,489 strings
    problem = refusal(bomb)
    assert problem.startswith(f"refused: more than {MAX_NODES} nodes (aliases expanded)\n")
    assert f'in "{bomb}", line 6, column ' in problem  # l5 holds 9**5 + ... nodes: the count passes there
    assert peak_bytes(lambda: read_yaml_documents(bomb)) < 256 * 1024


def test_expanded_nodes_are_accepted_up_to_the_bound_and_refused_one_past_it(tmp_path: Path) -> None:
    # The outer list, a list of 1 + 999 nodes under an anchor, aliases of it, and scalars to make up the rest:
    # exactly MAX_NODES nodes once expanded, from about 3,000 composed.
    inner = 999
    aliases, rest = divmod(MAX_NODES - 1 - (1 + inner), 1 + inner)
    items = ["&a [" + ", ".join(["x"] * inner) + "]", *["*a"] * aliases, *["y"] * rest]
    exact = tmp_path / "exact.yaml"
    exact.write_text("[" + ", ".join(items) + "]\n")
    one_more = tmp_path / "one-more.yaml"
    one_more.write_text("[" + ", ".join([*items, "z"]) + "]\n")
    (document,) = read_yaml_documents(exact)
    assert 1 + len(document) + sum(len(item) for item in document if isinstance(item, list)) == MAX_NODES
    assert refusal(one_more).startswith(f"refused: more than {MAX_NODES} nodes (aliases expanded)\n")


def test_the_node_count_is_for_the_whole_file_across_documents(tmp_path: Path) -> None:
    # Each document expands to 1 + 1,000 + 60 x 1,000 = 61,001 nodes, under the bound; the two together are not.
    document = "[&a [" + ", ".join(["x"] * 999) + "], " + ", ".join(["*a"] * 60) + "]\n"
    one = tmp_path / "one.yaml"
    one.write_text(document)
    two = tmp_path / "two.yaml"
    two.write_text(document + "---\n" + document)
    assert len(read_yaml_documents(one)) == 1
    problem = refusal(two)
    assert problem.startswith(f"refused: more than {MAX_NODES} nodes (aliases expanded)\n")
    assert f'in "{two}", line 3, column ' in problem


def test_an_alias_inside_the_node_it_names_is_refused(tmp_path: Path) -> None:
    # PyYAML builds a list that contains itself; no walk of it ends.
    path = tmp_path / "cycle.yaml"
    path.write_text("a: &a [1, *a]\n")
    assert refusal(path).startswith("refused: alias *a is inside the node it names (a cycle)\n")


def test_ordinary_aliases_and_documents_load_as_before(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("base: &base {a: 1}\nmerged: {<<: *base, b: 2}\nsame: *base\n---\nkind: List\n---\n")
    assert read_yaml_documents(path) == [
        {"base": {"a": 1}, "merged": {"a": 1, "b": 2}, "same": {"a": 1}},
        {"kind": "List"},
        None,
    ]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        pytest.param(b"a: [unclosed\n", "invalid YAML: while parsing a flow sequence", id="syntax"),
        pytest.param(b"a: \xff\xfe\n", "not UTF-8 text: byte 3 cannot be decoded", id="not-utf8"),
        pytest.param(b"a: 2001-13-01\n", "invalid YAML value: month must be in 1..12", id="bad-date"),
        pytest.param(
            b"a: 1" + b"0" * 5000 + b"\n",
            "invalid YAML value: Exceeds the limit (4300 digits) for integer string conversion",
            id="int-over-4300-digits",
        ),
        pytest.param(b"a: !!python/object:os.system {}\n", "invalid YAML: could not determine a constructor", id="tag"),
    ],
)
def test_unreadable_files_are_refused_naming_the_file(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    assert refusal(path).startswith(problem)


@pytest.mark.slow
def test_a_flood_of_nodes_under_3_mib_is_refused_within_a_bounded_resident_size(tmp_path: Path) -> None:
    # 1.5 million scalars in 3 MB: PyYAML's nodes cost ~650 bytes each, ~1 GB were they all composed.
    flood = tmp_path / "flood.yaml"
    flood.write_text("[" + ",".join(["x"] * 1_500_000) + "]\n")
    assert flood.stat().st_size <= MAX_FILE_BYTES
    script = textwrap.dedent(
        """
        import resource, sys
        from pathlib import Path
        from batchpilot_operator.api.yaml_input import YamlInputError, read_yaml_documents
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            read_yaml_documents(Path(sys.argv[1]))
        except YamlInputError as error:
            print(error.problem.splitlines()[0])
        print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(flood)], capture_output=True, text=True, check=True, timeout=600
    )
    problem, sizes = result.stdout.splitlines()
    assert problem == f"refused: more than {MAX_NODES} nodes (aliases expanded)"
    before_kib, after_kib = (int(size) for size in sizes.split())  # ru_maxrss is in KiB on Linux
    assert (after_kib - before_kib) * 1024 < 128 * MiB
