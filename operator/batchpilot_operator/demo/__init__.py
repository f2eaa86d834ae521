"""The demo behind ``make demo``: two runtimes, a trace replay, the operator in local mode,
first with static windows and then adaptive ones on the same arrivals, a live view, and a
self-contained HTML report whose figures are also written as JSON."""
