"""Every command in the README and in docs/ runs as written.

Fenced blocks are tagged by what they need:
- ```bash            run here, as written, from the project root (the venv's bin first on PATH), with
                     no variable a reader would not have; what a command writes (crd.yaml,
                     token.txt) lands in a temporary copy of the root, not in the repository;
- ```bash long       the main jobs (the demo, full benchmarks): too long for a test, so each command's
                     entry point is resolved and its arguments parsed by the real argparse parser;
- ```bash cluster    needs a Kubernetes cluster: checked to name known tools, to name files that exist,
                     and to pass this project's own commands (also those run in its images) through
                     the real parsers;
- ```bash server     a call to the runtime serving the real chat model (```python server: the same in
                     Python), followed by a ```json or ```text block with what it prints: run against
                     one runtime started with the README's `batchpilot-runtime serve --checkpoint ...`
                     flags, on a free port in place of the page's http://localhost:8080, and its output
                     compared with the block's (a reply's id and timestamp aside).
The README's first two commands (`make demo`, `make test`) are the long/CI entry points.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(bash[^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _page_commands(page: Path, tag: str) -> list[str]:
    commands = []
    for info, body in BLOCK.findall(page.read_text()):
        if info.strip() != tag:
            continue
        joined = body.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _commands(tag: str) -> list[str]:
    return [command for page in PAGES for command in _page_commands(page, tag)]


def _cases(tag: str) -> list[Any]:
    """One test case per command, named by its page."""
    return [
        pytest.param(command, id=f"{page.relative_to(ROOT)}: {command[:80]}")
        for page in PAGES
        for command in _page_commands(page, tag)
    ]


def test_the_pages_hold_commands() -> None:
    # A renamed tag or a moved page would otherwise leave these tests with nothing to check.
    assert len(PAGES) >= 10
    assert _commands("bash") and _commands("bash long") and _commands("bash cluster")


def test_the_readme_opens_with_the_two_commands() -> None:
    first_block = BLOCK.search(README.read_text())
    assert first_block is not None
    lines = [line.split("#", 1)[0].strip() for line in first_block.group(2).splitlines() if line.strip()]
    assert lines == ["make demo", "make test"]


def _reader_root(tmp_path: Path) -> Path:
    """A folder that reads as the project root (each top-level entry a symlink to the real one), so
    that a command reads ``deploy/examples/`` as written and what it writes stays out of the tree."""
    root = tmp_path / "batchpilot"
    root.mkdir()
    for entry in ROOT.iterdir():
        (root / entry.name).symlink_to(entry)
    return root


def test_commands_need_no_variable_of_the_test_harness() -> None:
    # A reader has no BATCHPILOT_README_TMP: unset, "$BATCHPILOT_README_TMP/crd.yaml" writes /crd.yaml.
    assert "$BATCHPILOT_" not in "\n".join(_commands("bash") + _commands("bash long"))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_files_a_long_command_reads_are_made_by_a_command_on_its_page(page: Path) -> None:
    made = {m for command in _page_commands(page, "bash") for m in re.findall(r">\s*(\S+)$", command)}
    for command in _page_commands(page, "bash long"):
        for path in re.findall(r"(?:--admin-token-file |token-file=)(\S+?)(?:,|\s|$)", command):
            assert path in made, f"{command}: nothing on {page.name} creates {path}"


@pytest.mark.parametrize("command", _cases("bash"))
def test_runnable_commands_succeed(command: str, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("BATCHPILOT_README_TMP", None)
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", command],
        cwd=_reader_root(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"


def _parse_with_real_parser(argv: list[str]) -> None:
    if argv[0] == "batchpilot-operator":
        from batchpilot_operator.cli.main import build_parser

        build_parser().parse_args(argv[1:])
    elif argv[0] == "batchpilot-runtime":
        from batchpilot_runtime.cli.main import build_parser as runtime_parser

        runtime_parser().parse_args(argv[1:])
    elif argv[0] == "make":
        targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
        assert all(t in targets for t in argv[1:] if "=" not in t), argv
    elif argv[0] in ("python", ".venv/bin/python") and argv[1].startswith("tests/bench/"):
        script = ROOT / argv[1]
        assert script.exists(), script
        result = subprocess.run(
            [sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 0, result.stderr[-2000:]
        options = set(re.findall(r"(--[a-z][a-z0-9-]*)", result.stdout))
        used = {a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")}
        assert used <= options, f"{argv[1]} does not take {sorted(used - options)}"
    else:
        raise AssertionError(f"unknown long command: {argv}")


@pytest.mark.parametrize("command", _cases("bash long"))
def test_long_commands_parse(command: str) -> None:
    argv = shlex.split(re.sub(r"^[A-Z_]+=\S+\s+", "", command))
    _parse_with_real_parser(argv)


CLUSTER_TOOLS = {"helm", "kubectl", "kind", "k3d", "docker", "make", "batchpilot-operator", "batchpilot-runtime"}


@pytest.mark.parametrize("command", _cases("bash cluster"))
def test_cluster_commands_name_known_tools_and_files(command: str) -> None:
    argv = shlex.split(re.sub(r"^[A-Z_]+=\S+\s+", "", command))
    assert argv[0] in CLUSTER_TOOLS, command
    for flag, path in itertools.pairwise(argv):
        if flag in ("-f", "--values", "-k") and not path.startswith(("-", "http")):
            assert (ROOT / path).exists(), f"{command}: {path} does not exist"
    if argv[0].startswith("batchpilot-"):
        _parse_with_real_parser(argv)
    if argv[:2] == ["kubectl", "run"] and "--" in argv:
        # A command run in one of the images: its entry point is the image's CLI.
        image = next(a.split("=", 1)[1] for a in argv if a.startswith("--image="))
        cli = "batchpilot-runtime" if "runtime" in image else "batchpilot-operator"
        _parse_with_real_parser([cli, *argv[argv.index("--") + 1 :]])


SERVER_TAGS = ("bash server", "python server")
PAGE_SERVER_URL = "http://localhost:8080"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _server_calls() -> list[Any]:
    """Each ```bash server / ```python server block with the block after it (what it prints)."""
    cases = []
    for page in PAGES:
        blocks = [(match.group(1).strip(), match.group(2)) for match in FENCE.finditer(page.read_text())]
        for (tag, body), (shown_tag, shown) in itertools.pairwise([*blocks, ("", "")]):
            if tag in SERVER_TAGS:
                name = f"{page.relative_to(ROOT)}: {body.strip()[:60]}"
                cases.append(pytest.param(tag, body, shown_tag, shown, id=name))
    return cases


def _real_model_serve_flags() -> list[str]:
    for command in _page_commands(README, "bash long"):
        argv = shlex.split(command)
        if argv[:2] == ["batchpilot-runtime", "serve"] and "--checkpoint" in argv:
            return argv[2:]
    raise AssertionError("README.md shows no `batchpilot-runtime serve --checkpoint ...` command")


def test_the_readme_calls_the_real_model_with_curl_and_the_openai_client() -> None:
    readme_tags = [case.values[0] for case in _server_calls() if str(case.id).startswith("README.md")]
    assert sorted(readme_tags) == ["bash server", "python server"]
    assert "--checkpoint" in _real_model_serve_flags()


@pytest.fixture(scope="module")
def real_model_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The runtime as the README starts it (its flags), on free ports."""
    from tests.integration.runtime_process import runtime_process

    flags = _real_model_serve_flags()
    name = flags[flags.index("--checkpoint") + 1]
    with runtime_process(tmp_path_factory.mktemp("real-model"), *flags, model_name=name) as runtime:
        yield runtime.serve_url


def _stable(reply: dict[str, Any]) -> dict[str, Any]:
    """A chat reply without what differs from run to run."""
    return {key: value for key, value in reply.items() if key not in ("id", "created")}


@pytest.mark.slow
@pytest.mark.parametrize(("tag", "body", "shown_tag", "shown"), _server_calls())
def test_calls_to_the_real_model_print_what_the_page_shows(
    tag: str, body: str, shown_tag: str, shown: str, real_model_url: str
) -> None:
    assert shown_tag in ("json", "text"), f"a ```{tag} block must be followed by a ```json or ```text block"
    assert PAGE_SERVER_URL in body, f"the call does not go to {PAGE_SERVER_URL}"
    code = body.replace(PAGE_SERVER_URL, real_model_url)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    argv = ["bash", "-euo", "pipefail", "-c", code] if tag == "bash server" else [sys.executable, "-c", code]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"{body}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    if shown_tag == "json":
        assert _stable(json.loads(result.stdout)) == _stable(json.loads(shown))
    else:
        assert result.stdout.strip() == shown.strip()
