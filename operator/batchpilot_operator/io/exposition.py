"""The Prometheus text exposition, read once for every reader of the runtimes' ``/metrics``. Pure: no I/O.

The scraping metric source (:mod:`batchpilot_operator.io.scrape`) and the demo's snapshots
(:mod:`batchpilot_operator.demo.series`) both start from :func:`parse_exposition` and read
counters with :func:`counter_increase`, so they agree on what a sample, a histogram bucket and
a counter reset are. The text itself is parsed by ``prometheus_client``'s parser (label
escaping, ``+Inf``, NaN); this module only fixes what its samples become.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping

from prometheus_client.parser import text_string_to_metric_families

# (series name, sorted label pairs): one sample of an exposition.
SeriesKey = tuple[str, tuple[tuple[str, str], ...]]

BUCKET_SUFFIX = "_bucket"


def parse_exposition(text: str) -> dict[SeriesKey, float]:
    """Every sample of a Prometheus text exposition, keyed by name and labels (NaN and infinities kept)."""
    series: dict[SeriesKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return series


def bucket_bound(name: str, labels: Mapping[str, str], histograms: Container[str]) -> tuple[str, float] | None:
    """``(histogram, upper bound)`` when the sample is a bucket of one of ``histograms``; None otherwise,
    and for a bucket whose ``le`` is missing or not a number."""
    if not name.endswith(BUCKET_SUFFIX):
        return None
    histogram = name.removesuffix(BUCKET_SUFFIX)
    if histogram not in histograms:
        return None
    try:
        bound = float(labels.get("le", "nan"))
    except ValueError:
        return None
    return None if math.isnan(bound) else (histogram, bound)


def counter_increase(now: float, before: float | None) -> float:
    """How much a counter (or a histogram bucket) grew since ``before``.

    A counter that went down means its process restarted: its current value is the increase,
    as Prometheus's ``increase()`` assumes. A series not seen before (``None``) grew by all of it.
    """
    if before is None or now < before:
        return now
    return now - before
