"""Shared pieces of the torch model tests."""

from __future__ import annotations

from collections.abc import Iterator
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


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # threaded BLAS on an oversubscribed 2-core machine is ~20x slower, not faster
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
