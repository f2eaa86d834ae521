"""bench_gate's --gate-cpus: a CPU list the host has, some but not all of them, or a clear error."""

from __future__ import annotations

import argparse
import os

import pytest

from tests.bench.bench_gate import cpu_list

ALLOWED = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(ALLOWED) < 2, reason="pinning the gate apart needs two CPUs")
def test_a_cpu_list_names_single_cpus_and_ranges() -> None:
    assert cpu_list(str(ALLOWED[-1])) == {ALLOWED[-1]}
    if len(ALLOWED) >= 3 and ALLOWED[1] + 1 == ALLOWED[2]:
        assert cpu_list(f"{ALLOWED[1]}-{ALLOWED[2]}") == {ALLOWED[1], ALLOWED[2]}


@pytest.mark.parametrize(
    "text",
    ["x", "1-", ",".join(map(str, ALLOWED)), str(max(ALLOWED) + 1), ""],
    ids=["not-a-number", "open-range", "every-cpu", "not-this-hosts", "empty"],
)
def test_a_list_the_gate_cannot_be_pinned_to_apart_is_refused_with_what_to_write(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"--gate-cpus|not a CPU list"):
        cpu_list(text)
