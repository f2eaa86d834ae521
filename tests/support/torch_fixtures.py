"""Shared pieces of the torch model tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True)
class Seq:
    """A scheduled sequence as ``ForwardBatch.build`` reads it."""

    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool = True


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # threaded BLAS on an oversubscribed 2-core machine is ~20x slower, not faster
    with _torch_threads(1):
        yield


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_module() -> Iterator[None]:
    """:func:`one_thread` from the module's first fixture on, for modules whose module-scoped
    fixtures run the model or start an engine thread."""
    with _torch_threads(1):
        yield
