"""Observations from Prometheus: three grouped PromQL queries per interval for all profiles.

Every query aggregates ``by (namespace, model)`` over all runtime pods, so the
number of queries does not grow with the number of profiles: one for the three
latency histograms' quantiles (``histogram_quantile``, so a few series per model
come back, not whole histograms) and observation rates, one for every counter
rate, one for the gauges. Each sub-expression is tagged with a ``bp_series`` label through
``label_replace`` and joined with ``or``, which keeps their results apart.
A quantile in the ``+Inf`` bucket comes back as the top finite bound, which
:func:`batchpilot_operator.tuning.observations.is_saturated` recognises as saturated.

prometheus-api-client is synchronous (requests); it runs on a small dedicated
thread pool with a timeout so that a slow Prometheus never blocks the event
loop, and never piles up more threads than the pool holds. A response hook
reads each answer's body itself, under a cap and within the same deadline, so
that an answer that never ends, or a huge one, frees its thread at the deadline
instead of holding it (and the pool) forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchpilot_operator.api.kinds import EngineKind
from batchpilot_operator.io.engine_metrics import (
    ENGINES,
    FOREIGN_ENGINES,
    GATED_ENGINES,
    EngineMetricNames,
)
from batchpilot_operator.io.observe import RATE_COUNTERS, MetricsUnavailable
from batchpilot_operator.io.outbound import format_bytes
from batchpilot_operator.tuning.model_metrics import (
    ERROR_BUDGET_WINDOW_S,
    INTER_TOKEN,
    LATENCY_HISTOGRAMS,
    MetricsBuilder,
    ModelKey,
    ModelMetrics,
)
from batchpilot_runtime.contract import metric_names as rm

log = logging.getLogger(__name__)

SERIES_LABEL = "bp_series"
QUANTILE_LABEL = "bp_quantile"
COUNT_SUFFIX = "_count"
QUANTILES = (0.5, 0.99, 0.999)
DEFAULT_NAMESPACE_LABEL = "namespace"
ITL_WINDOW_SERIES = "interTokenWindow"  # the gaps' buckets over the error budget's hour
GAP_HOUR_QUERY = "gapHour"  # its query's name among the answers parse_results takes
GAP_HOUR_REFRESH_S = 60.0  # the hour moves little in a minute; its query reads every sample of it
# The pod's name on every series Prometheus scraped from a pod (prometheus-operator's PodMonitor and
# ServiceMonitor, and Prometheus's own kubernetes_sd examples, set it): the per-pod query groups by it.
DEFAULT_POD_LABEL = "pod"
# One answer holds about 200 bytes per series: 1,000 models x 13 latency series is ~2.5 MiB. 64 MiB is room
# for 20x that, and bounds what a broken or hostile endpoint can make the three query threads hold.
MAX_ANSWER_BYTES = 64 << 20
_READ_CHUNK_BYTES = 64 << 10


def rate_window_s(scrape_interval_s: float, interval_s: float) -> int:
    """The rate window: at least 4 scrape intervals (so a missed scrape never empties it), at least one tick."""
    return math.ceil(max(4.0 * scrape_interval_s, interval_s))


def _tag(expr: str, series: str) -> str:
    return f'label_replace({expr}, "{SERIES_LABEL}", "{series}", "", "")'


def _as_model(expr: str, model_label: str) -> str:
    """An engine's model label copied to ``model``, the label every answer is parsed by."""
    if model_label == rm.LABEL_MODEL:
        return expr
    return f'label_replace({expr}, "{rm.LABEL_MODEL}", "$1", "{model_label}", "(.+)")'


def _newest_first(template: str, names: Sequence[str]) -> str:
    """``template`` (with ``{}`` for a name) over several names of one metric joined by ``or``: where two
    names carry the same labels (rate() and sum() drop the name), the newer name's series is the one kept."""
    return " or ".join(template.format(name) for name in names)


def _grouping(namespace_label: str | None, model_label: str) -> str:
    """The labels every grouped query sums by: namespace (when profiles are matched by it) and model."""
    return f"{namespace_label}, {model_label}" if namespace_label else model_label


def _foreign_engines(engines: Collection[str]) -> list[EngineMetricNames]:
    """The names of each engine in ``engines`` other than batchpilot, in a stable order; ValueError
    naming an unknown one."""
    known = []
    for engine in sorted(set(engines) - {EngineKind.BATCHPILOT}):
        names = FOREIGN_ENGINES.get(engine)
        if names is None:
            raise ValueError(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
        known.append(names)
    return known


def _gap_window(histograms: Sequence[str], by: str) -> str:
    """The gaps' buckets over the error budget's hour, as counts, tagged: the policy reads the share
    over each profile's own target from them (Prometheus cannot: the targets differ by profile)."""
    window = f"[{ERROR_BUDGET_WINDOW_S}s]"
    return _tag(
        f"sum by ({by}, le) ({_newest_first('increase({}_bucket' + window + ')', histograms)})", ITL_WINDOW_SERIES
    )


def build_gap_hour_query(
    namespace_label: str | None = DEFAULT_NAMESPACE_LABEL, engines: Collection[str] = (EngineKind.BATCHPILOT,)
) -> str:
    """The gaps' histogram over the error budget's hour, every model of every engine in one query.

    A query of its own, run at most every ``GAP_HOUR_REFRESH_S``: it reads every sample of the hour
    (pods x buckets x samples an hour), which at thousands of pods can pass Prometheus'
    ``--query.max-samples``; its failure then only leaves the policy without the hour."""
    parts = []
    if _reads_batchpilot(engines):
        parts.append(_gap_window((rm.INTER_TOKEN_SECONDS,), _grouping(namespace_label, rm.LABEL_MODEL)))
    for names in _foreign_engines(engines):
        if INTER_TOKEN in names.latency:
            by = _grouping(namespace_label, names.model_label)
            parts.append(_as_model(_gap_window(names.latency[INTER_TOKEN], by), names.model_label))
    return " or ".join(parts)


def _reads_batchpilot(engines: Collection[str]) -> bool:
    """Whether the queries read batchpilot's names: for its runtime, and for the gate in front of an engine."""
    return EngineKind.BATCHPILOT in engines or bool(GATED_ENGINES & set(engines))


def _increase(factors: Sequence[str], window_s: int) -> str:
    """How much the product of ``factors`` (metric names) grew over the window: now less a window ago (each
    factor ``offset``: the modifier takes a selector, not an expression), 0 where it went down (the pod
    restarted). Unlike ``rate()`` it takes a product, and it does not extrapolate, so two of them over the
    same window divide exactly."""
    now = " * ".join(factors)
    before = " * ".join(f"({name} offset {window_s}s)" for name in factors)
    return f"clamp_min({now} - {before}, 0)"


def _decode_parts(names: EngineMetricNames, by: str, window_s: int) -> list[str]:
    """The mean batch size's two rates from an engine's decode calls and its busy slots per call since start
    (llama-server): busy slots and decode calls over the window, per second."""
    if names.decodes is None or names.busy_slots_per_decode is None:
        return []
    busy = _increase((names.busy_slots_per_decode, names.decodes), window_s)
    decodes = _increase((names.decodes,), window_s)
    return [
        _as_model(_tag(f"sum by ({by}) ({busy}) / {window_s}", "batch_sum"), names.model_label),
        _as_model(_tag(f"sum by ({by}) ({decodes}) / {window_s}", "batch_count"), names.model_label),
    ]


def _foreign_parts(names: EngineMetricNames, namespace_label: str | None, window_s: int) -> tuple[list[str], ...]:
    """One foreign engine's sub-expressions of the latency, rates and gauges queries, tagged like batchpilot's."""
    w = f"[{window_s}s]"
    by = _grouping(namespace_label, names.model_label)
    latency = []
    for slo_name, histograms in names.latency.items():
        buckets = f"sum by ({by}, le) ({_newest_first('rate({}_bucket' + w + ')', histograms)})"
        for q in QUANTILES:
            quantile = f"histogram_quantile({q}, {buckets})"
            tagged = f'label_replace({_tag(quantile, slo_name)}, "{QUANTILE_LABEL}", "{q}", "", "")'
            latency.append(_as_model(tagged, names.model_label))
        count = f"sum by ({by}) ({_newest_first('rate({}_count' + w + ')', histograms)})"
        latency.append(_as_model(_tag(count, f"{slo_name}{COUNT_SUFFIX}"), names.model_label))
    rates = [
        _as_model(_tag(f"sum by ({by}) (rate({counter}{w}))", series), names.model_label)
        for series, counter in names.counters.items()
    ]
    rates.extend(_decode_parts(names, by, window_s))
    aggregation = {"queue_depth": "sum", "running": "sum", "engine_running": "sum", "kv_usage": "max"}
    gauges = [
        _as_model(_tag(f"{aggregation[series]} by ({by}) ({_newest_first('{}', gauge)})", series), names.model_label)
        for series, gauge in names.gauges.items()
    ]
    if names.pods_gauge is not None:
        gauges.append(_as_model(_tag(f"count by ({by}) ({names.pods_gauge})", "pods"), names.model_label))
    return latency, rates, gauges


def build_queries(
    window_s: int,
    namespace_label: str | None = DEFAULT_NAMESPACE_LABEL,
    engines: Collection[str] = (EngineKind.BATCHPILOT,),
) -> dict[str, str]:
    """The grouped queries of one interval, by name: three, whatever the number of profiles and engines.
    batchpilot's names come from the runtime's contract, the other engines' from
    :mod:`batchpilot_operator.io.engine_metrics`; each engine in ``engines`` adds its sub-expressions (an
    engine behind the gate, llamacpp, batchpilot's too: the gate's latency, requests and queue).

    ``namespace_label`` None groups by model alone (local mode matches profiles by model).
    """
    queries = _batchpilot_queries(window_s, namespace_label) if _reads_batchpilot(engines) else {}
    for names in _foreign_engines(engines):
        parts_by_query = _foreign_parts(names, namespace_label, window_s)
        for name, parts in zip(("latency", "rates", "gauges"), parts_by_query, strict=True):
            if not parts:
                continue
            queries[name] = " or ".join([queries[name], *parts] if name in queries else parts)
    return queries


def _batchpilot_queries(window_s: int, namespace_label: str | None) -> dict[str, str]:
    """batchpilot's own sub-expressions of the three queries (it alone exports step times and admissions)."""
    by = _grouping(namespace_label, rm.LABEL_MODEL)
    w = f"[{window_s}s]"
    # Prometheus computes the quantiles (a few series per model, not a whole histogram's buckets).
    latency_parts = []
    for slo_name, histogram in LATENCY_HISTOGRAMS.items():
        buckets = f"sum by ({by}, le) (rate({histogram}_bucket{w}))"
        for q in QUANTILES:
            quantile = f"histogram_quantile({q}, {buckets})"
            latency_parts.append(f'label_replace({_tag(quantile, slo_name)}, "{QUANTILE_LABEL}", "{q}", "", "")')
        latency_parts.append(_tag(f"sum by ({by}) (rate({histogram}_count{w}))", f"{slo_name}{COUNT_SUFFIX}"))
    latency = " or ".join(latency_parts)
    decode = f'{{{rm.LABEL_PHASE}="decode"}}'
    prefill = f'{{{rm.LABEL_PHASE}="prefill"}}'
    counter_rates = []
    for series, counter in RATE_COUNTERS.items():
        grouping = f"{by}, {rm.LABEL_REASON}" if series == "admissions" else by
        counter_rates.append(_tag(f"sum by ({grouping}) (rate({counter}{w}))", series))
    rates = " or ".join(
        [
            *counter_rates,
            _tag(f"sum by ({by}) (rate({rm.BATCH_SIZE}_sum{decode}{w}))", "batch_sum"),
            _tag(f"sum by ({by}) (rate({rm.BATCH_SIZE}_count{decode}{w}))", "batch_count"),
            _tag(f"sum by ({by}, {rm.LABEL_BATCH_BUCKET}) (rate({rm.STEP_SECONDS}_sum{decode}{w}))", "step_sum"),
            _tag(f"sum by ({by}, {rm.LABEL_BATCH_BUCKET}) (rate({rm.STEP_SECONDS}_count{decode}{w}))", "step_count"),
            _tag(
                f"sum by ({by}, {rm.LABEL_BATCH_BUCKET}) (rate({rm.STEP_SECONDS}_sum{prefill}{w}))", "prefill_step_sum"
            ),
            _tag(
                f"sum by ({by}, {rm.LABEL_BATCH_BUCKET}) (rate({rm.STEP_SECONDS}_count{prefill}{w}))",
                "prefill_step_count",
            ),
        ]
    )
    gauges = " or ".join(
        [
            _tag(f"sum by ({by}) ({rm.QUEUE_DEPTH})", "queue_depth"),
            _tag(f"sum by ({by}) ({rm.RUNNING_SEQUENCES})", "running"),
            _tag(f"max by ({by}) ({rm.KV_CACHE_USAGE_RATIO})", "kv_usage"),
            _tag(f"count by ({by}) ({rm.QUEUE_DEPTH})", "pods"),
        ]
    )
    return {"latency": latency, "rates": rates, "gauges": gauges}


def _promql_regex(text: str) -> str:
    """``text`` matched literally by an RE2 regex, inside a double-quoted PromQL string."""
    regex = re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text)
    return regex.replace("\\", "\\\\").replace('"', '\\"')


def build_pod_query(
    window_s: int,
    models: Collection[str],
    namespace_label: str | None = DEFAULT_NAMESPACE_LABEL,
    pod_label: str = DEFAULT_POD_LABEL,
) -> str:
    """One query for the profiles with a canary in progress (batchpilot's runtime only): the P99 and the
    observation rate of each latency histogram per pod, for ``models`` alone, tagged as in
    :func:`build_queries`'s latency query so that the same parser reads it."""
    by = ", ".join(label for label in (namespace_label, rm.LABEL_MODEL, pod_label) if label)
    selector = f'{{{rm.LABEL_MODEL}=~"{"|".join(_promql_regex(m) for m in sorted(set(models)))}"}}'
    w = f"[{window_s}s]"
    parts = []
    for slo_name, histogram in LATENCY_HISTOGRAMS.items():
        buckets = f"sum by ({by}, le) (rate({histogram}_bucket{selector}{w}))"
        quantile = _tag(f"histogram_quantile(0.99, {buckets})", slo_name)
        parts.append(f'label_replace({quantile}, "{QUANTILE_LABEL}", "0.99", "", "")')
        parts.append(_tag(f"sum by ({by}) (rate({histogram}_count{selector}{w}))", f"{slo_name}{COUNT_SUFFIX}"))
    return " or ".join(parts)


def parse_pod_results(
    samples: Sequence[Mapping[str, Any]],
    window_s: float,
    namespace_label: str | None = DEFAULT_NAMESPACE_LABEL,
    pod_label: str = DEFAULT_POD_LABEL,
) -> dict[ModelKey, dict[str, ModelMetrics]]:
    """The answer of :func:`build_pod_query` per (namespace, model), then per pod name."""
    by_pod: dict[str, list[Mapping[str, Any]]] = {}
    for sample in samples:
        pod = (sample.get("metric") or {}).get(pod_label)
        if pod:
            by_pod.setdefault(str(pod), []).append(sample)
    per_key: dict[ModelKey, dict[str, ModelMetrics]] = {}
    for pod, pod_samples in sorted(by_pod.items()):
        for key, metrics in parse_results({"latency": pod_samples}, window_s, namespace_label).items():
            per_key.setdefault(key, {})[pod] = metrics
    return per_key


def _value(sample: Mapping[str, Any]) -> float:
    raw = sample.get("value")
    if not isinstance(raw, list | tuple) or len(raw) != 2:
        return math.nan
    try:
        return float(raw[1])
    except (TypeError, ValueError):
        return math.nan


def _float_or_nan(text: object) -> float:
    """A label's number (a bucket's ``le``, a quantile); NaN when the label is missing or not one."""
    try:
        return float(str(text))
    except ValueError:
        return math.nan


def parse_results(
    results: Mapping[str, Sequence[Mapping[str, Any]]],
    window_s: float,
    namespace_label: str | None = DEFAULT_NAMESPACE_LABEL,
) -> dict[ModelKey, ModelMetrics]:
    """Turn the instant-vector answers of :func:`build_queries` into ModelMetrics per (namespace, model)."""
    builder = MetricsBuilder(window_s)
    for name, samples in results.items():
        for sample in samples:
            labels = sample.get("metric") or {}
            model = labels.get(rm.LABEL_MODEL)
            series = labels.get(SERIES_LABEL)
            if not model or not series:
                continue
            key = (str(labels.get(namespace_label, "")) if namespace_label else "", str(model))
            value = _value(sample)
            if name == GAP_HOUR_QUERY:
                upper_bound = _float_or_nan(labels.get("le"))
                if series == ITL_WINDOW_SERIES and not math.isnan(upper_bound):
                    builder.add_window_bucket(key, upper_bound, value)
            elif name == "latency":
                if series.endswith(COUNT_SUFFIX) and series.removesuffix(COUNT_SUFFIX) in LATENCY_HISTOGRAMS:
                    builder.add_latency_count(key, series.removesuffix(COUNT_SUFFIX), value)
                elif series in LATENCY_HISTOGRAMS and not math.isnan(q := _float_or_nan(labels.get(QUANTILE_LABEL))):
                    builder.add_quantile(key, series, q, value)
            elif name == "rates":
                detail = str(labels.get(rm.LABEL_REASON) or labels.get(rm.LABEL_BATCH_BUCKET) or "")
                builder.add_rate(key, series, value, detail)
            elif name == "gauges":
                builder.add_gauge(key, series, value)
    return builder.build()


@dataclass(frozen=True)
class QueryStats:
    queries: int
    seconds: float


class PrometheusSource:
    """Reads every profile's metrics with the three grouped queries of :func:`build_queries`, and the
    gaps' hour with :func:`build_gap_hour_query` at most once every ``GAP_HOUR_REFRESH_S``."""

    def __init__(
        self,
        url: str,
        *,
        scrape_interval_s: float = 15.0,
        interval_s: float = 15.0,
        timeout_s: float = 5.0,
        namespace_label: str | None = DEFAULT_NAMESPACE_LABEL,
        headers: Mapping[str, str] | None = None,
        max_body_bytes: int = MAX_ANSWER_BYTES,
        pod_label: str = DEFAULT_POD_LABEL,
    ) -> None:
        import requests
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        self.url = url
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self.namespace_label = namespace_label
        self.pod_label = pod_label
        self.window_s = rate_window_s(scrape_interval_s, interval_s)
        self.queries_total = 0
        self.last_stats = QueryStats(0, 0.0)
        # No retries inside the client: the next tick is the retry, and a retry loop
        # here would hold the thread past our timeout.
        session = requests.Session()
        session.hooks["response"].append(self._read_body)
        self._client = PrometheusConnect(
            url=url,
            headers=dict(headers or {}),
            retry=Retry(total=0, connect=0, read=0),
            timeout=timeout_s,
            session=session,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="promql")
        # The gaps' hour, kept between its refreshes (build_gap_hour_query).
        self._gap_hour_samples: list[dict[str, Any]] = []
        self._gap_hour_at = -math.inf
        self._gap_hour_engines: frozenset[str] = frozenset()
        self._gap_hour_warned = False

    def close(self, wait: bool = False) -> None:
        """Stop the query threads; ``wait`` joins a query still running (tests do, to leave no thread behind)."""
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def _read_body(self, response: Any, **_: Any) -> Any:
        """requests' response hook (it runs before requests reads the body): read the body here, under the cap
        and within what the deadline leaves after the headers; otherwise close the connection and raise."""
        deadline = time.monotonic() + max(0.0, self.timeout_s - response.elapsed.total_seconds())
        chunks: list[bytes] = []
        seen = 0
        try:
            # read1: whatever one socket read brings, so that a dripped body meets the deadline check.
            while chunk := response.raw.read1(_READ_CHUNK_BYTES, decode_content=True):
                seen += len(chunk)
                if seen > self.max_body_bytes:
                    raise MetricsUnavailable(
                        f"Prometheus at {self.url}: answer over the {format_bytes(self.max_body_bytes)} cap"
                    )
                if time.monotonic() > deadline:
                    raise MetricsUnavailable(
                        f"Prometheus at {self.url}: answer not complete within {self.timeout_s:g} s"
                    )
                chunks.append(chunk)
        except BaseException:
            response.close()
            raise
        response._content = b"".join(chunks)
        response._content_consumed = True
        return response

    def _query(self, expr: str) -> list[dict[str, Any]]:
        result = self._client.custom_query(expr, params={"timeout": f"{self.timeout_s:g}s"})
        if not isinstance(result, list):
            raise MetricsUnavailable(f"Prometheus answered a {type(result).__name__}, not a vector")
        return result

    async def collect(
        self, targets: Mapping[ModelKey, Sequence[str]], engines: Collection[str] = (EngineKind.BATCHPILOT,)
    ) -> dict[ModelKey, ModelMetrics]:
        """Run the grouped queries concurrently; raise MetricsUnavailable naming the cause on any failure.

        ``targets`` is ignored: the queries cover every model at once; ``engines``: the engine kinds of the
        due profiles, whose names the queries read.
        """
        del targets
        main = self._run(build_queries(self.window_s, self.namespace_label, engines))
        answers, _ = await asyncio.gather(main, self._refresh_gap_hour(frozenset(engines)))
        return parse_results({**answers, GAP_HOUR_QUERY: self._gap_hour_samples}, self.window_s, self.namespace_label)

    async def _refresh_gap_hour(self, engines: frozenset[str]) -> None:
        """Read the gaps' hour again when ``GAP_HOUR_REFRESH_S`` has passed or the engines changed.
        Its failure is not the interval's: without the hour the policy cuts every interval over target,
        as it did before it had one."""
        now = time.monotonic()
        if engines == self._gap_hour_engines and now - self._gap_hour_at < GAP_HOUR_REFRESH_S:
            return
        self._gap_hour_at, self._gap_hour_engines = now, engines
        try:
            query = build_gap_hour_query(self.namespace_label, engines)
            answer = await self._run({GAP_HOUR_QUERY: query}, record_stats=False)
        except MetricsUnavailable as error:
            if self._gap_hour_samples or not self._gap_hour_warned:
                log.warning("the gaps' hour is unavailable, so no error budget for the gaps: %s", error)
                self._gap_hour_warned = True
            self._gap_hour_samples = []
            return
        self._gap_hour_samples = answer[GAP_HOUR_QUERY]

    async def collect_pods(
        self, targets: Mapping[ModelKey, Mapping[str, str]]
    ) -> dict[ModelKey, dict[str, ModelMetrics]]:
        """Per-pod latency of the models of ``targets`` (profiles with a canary in progress), in one query."""
        models = {model for _, model in targets}
        if not models:
            return {}
        query = build_pod_query(self.window_s, models, self.namespace_label, self.pod_label)
        answers = await self._run({"pods": query}, record_stats=False)
        return parse_pod_results(answers["pods"], self.window_s, self.namespace_label, self.pod_label)

    async def _run(self, queries: Mapping[str, str], *, record_stats: bool = True) -> dict[str, list[dict[str, Any]]]:
        """Run ``queries`` concurrently; their answers by name, or MetricsUnavailable naming the cause."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        futures = {name: loop.run_in_executor(self._pool, self._query, expr) for name, expr in queries.items()}
        self.queries_total += len(futures)
        too_slow = f"Prometheus at {self.url} did not answer within {self.timeout_s:g} s"
        try:
            async with asyncio.timeout(self.timeout_s):
                # return_exceptions: every answer is retrieved, so no failed future is left unobserved.
                outcomes = await asyncio.gather(*futures.values(), return_exceptions=True)
        except TimeoutError:
            raise MetricsUnavailable(too_slow) from None
        finally:
            if record_stats:
                self.last_stats = QueryStats(len(futures), time.monotonic() - started)
        answers: dict[str, list[dict[str, Any]]] = {}
        for name, outcome in zip(futures, outcomes, strict=True):
            if isinstance(outcome, MetricsUnavailable):
                raise outcome
            if isinstance(outcome, BaseException) and timed_out(
                outcome
            ):  # the thread's own read timeout can beat the one above
                raise MetricsUnavailable(too_slow) from None
            if isinstance(outcome, BaseException):  # requests/urllib3/prometheus-api-client raise many types
                raise MetricsUnavailable(f"Prometheus at {self.url} failed ({name}): {_short(outcome)}") from None
            answers[name] = outcome
        return answers


def timed_out(error: BaseException) -> bool:
    """Whether a query failed on its own read or connect timeout. With ``Retry(total=0)`` urllib3
    wraps a read timeout in ``MaxRetryError``, which requests raises as a ``ConnectionError``, not
    as a ``Timeout``: it is still a Prometheus that did not answer in time."""
    import requests
    from urllib3.exceptions import MaxRetryError, NewConnectionError
    from urllib3.exceptions import TimeoutError as TransportTimeout

    if isinstance(error, requests.Timeout):
        return True
    # urllib3 derives NewConnectionError (a refused connection) from its connect timeout.
    return any(
        isinstance(arg, MaxRetryError)
        and isinstance(arg.reason, TransportTimeout)
        and not isinstance(arg.reason, NewConnectionError)
        for arg in error.args
    )


def _short(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."
