"""The demo behind ``make demo``: two runtimes, a trace replay, the operator in local mode,
first with static windows and then adaptive ones on the same arrivals, a live view, and a
self-contained HTML report whose figures are also written as JSON.

The demo stays in the operator package, since it runs the operator's own local mode in-process,
but it never loads torch: it already runs every runtime as a child process, and the one
measurement that needs the engine, how long a prefill step takes on this host (``sizing.py``), is
made the same way, by ``batchpilot-runtime time-step`` processes whose printed median it reads.
"""
