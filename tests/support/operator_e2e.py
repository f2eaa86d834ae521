"""What the end-to-end operator tests share: their marks, and the operator's decisions counted from its own
metrics.

Intervals in these tests are counted in the operator's decisions (one per interval), never in
seconds, so that a slow machine only makes a test longer.
"""

from __future__ import annotations

import re

import pytest

from tests.integration.prometheus_process import prometheus_binary

_DECISIONS = re.compile(r"^batchpilot_operator_decisions_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def marks(timeout_s: int) -> list[pytest.MarkDecorator]:
    """A slow test, failed after ``timeout_s``, skipped where Prometheus is not installed."""
    return [
        pytest.mark.slow,
        pytest.mark.timeout(timeout_s),
        pytest.mark.skipif(prometheus_binary() is None, reason="prometheus not installed (scripts/system-deps.sh)"),
    ]


def decisions_total(metrics_text: str) -> float:
    """The operator's decisions so far, over every profile, from its ``/metrics`` text."""
    return sum(float(match.group(1)) for match in _DECISIONS.finditer(metrics_text))
