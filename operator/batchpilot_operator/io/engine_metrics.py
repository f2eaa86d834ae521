"""Each engine's own metric names for what the policy observes.

Both metric sources read a vLLM or SGLang pod through these tables and feed the
same :class:`~batchpilot_operator.tuning.model_metrics.MetricsBuilder` series as for
batchpilot's runtime, so one builder (:func:`~batchpilot_operator.tuning.model_metrics.to_observations`)
makes the policy's observations for every engine. What an engine does not
export (step times per batch size, admissions by reason, tail marks) stays
unknown, and the policy's rules that need it do not fire.

Names are checked against the engines' sources; where a release renamed a
metric, the older name follows the newer one and is read only where the newer
is absent (vLLM >= 0.11 exports both for a while).

vLLM, ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``): labels
``model_name`` (the served model name) and ``engine`` (the data-parallel rank);
histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``
(before 0.11 ``vllm:time_per_output_token_seconds``, hidden in 0.12),
``vllm:request_queue_time_seconds``, ``vllm:e2e_request_latency_seconds``;
gauges ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` (a 0..1 ratio despite its name; before 0.9
``vllm:gpu_cache_usage_perc``); counters ``vllm:request_success`` (label
``finished_reason``), ``vllm:prompt_tokens``, ``vllm:generation_tokens``,
``vllm:num_preemptions``, each exposed with prometheus_client's ``_total``.

SGLang, ``python/sglang/srt/metrics/collector.py``: label ``model_name`` (the
served model name; the scheduler adds ``engine_type``, ``tp_rank``, ``pp_rank``,
``moe_ep_rank``); ``TokenizerMetricsCollector``: histograms
``sglang:time_to_first_token_seconds``, ``sglang:inter_token_latency_seconds``,
``sglang:e2e_request_latency_seconds``, counters ``sglang:num_requests_total``,
``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``;
``SchedulerMetricsCollector``: gauges ``sglang:num_queue_reqs``,
``sglang:num_running_reqs``, ``sglang:token_usage`` (KV tokens in use / pool,
0..1), histogram ``sglang:queue_time_seconds``, counter
``sglang:num_retracted_requests_total`` (SGLang's preemption: a running request
retracted when the KV pool runs out).

llama.cpp's llama-server (``--metrics``), ``tools/server/server-task.cpp``
(``server_task_result_metrics::to_metrics``, llama.cpp as vendored by the llama-cpp-python 0.3.36 sdist):
no label at all (one server serves one model: the scrape's target gives the model); counters
``llamacpp:prompt_tokens_total`` (prompt tokens computed, cached ones excluded: what batchpilot calls
prefill tokens), ``llamacpp:tokens_predicted_total``, ``llamacpp:n_decode_total`` (``llama_decode()``
calls); gauges ``llamacpp:requests_processing`` (slots busy), ``llamacpp:requests_deferred`` (requests
waiting for a slot), ``llamacpp:n_busy_slots_per_decode`` (busy slots summed over every decode call since
start, over ``n_decode_total``: their product's increase is the busy slots of the window's decode calls,
the mean batch size). Its two throughput gauges (``prompt_tokens_seconds``, ``predicted_tokens_seconds``)
are reset by every scrape, so they are not read. It exports no latency histogram: a llamacpp pod runs
batchpilot-gate in front of it, whose ``batchpilot_*`` series give the latency, the requests and the
queue at the gate; llama-server's own figures replace the gate's for what the engine runs (its busy
slots, its generated tokens) and add to them for what the gate cannot see (requests deferred inside the
engine). Values are printed with six significant digits (a C++ stream's default): past a million, a
counter moves in steps of ten or more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from batchpilot_operator.api.kinds import EngineKind
from batchpilot_operator.tuning.model_metrics import INTER_TOKEN


@dataclass(frozen=True)
class EngineMetricNames:
    """One engine's names for the series the operator reads, by the MetricsBuilder series they feed.

    Every tuple lists a metric's names newest first; an older name is read only where the newer is absent.
    """

    engine: EngineKind
    model_label: str
    latency: Mapping[str, tuple[str, ...]]  # LATENCY_HISTOGRAMS key -> histogram names
    counters: Mapping[str, str]  # MetricsBuilder rate series -> counter name (as exposed, with _total)
    gauges: Mapping[str, tuple[str, ...]]  # MetricsBuilder gauge series -> gauge names
    # The gauge every pod of the engine exports once per scheduler, counted as the pods reporting; None for
    # an engine behind the gate, whose pods the gate's series count.
    pods_gauge: str | None
    # An engine whose series carry no model label: the scrape's target (or relabelling) names the model.
    model_from_target: bool = False
    # Decode calls (a counter) and busy slots per call since start (a gauge): the window's mean batch size.
    decodes: str | None = None
    busy_slots_per_decode: str | None = None


VLLM_NAMES = EngineMetricNames(
    engine=EngineKind.VLLM,
    model_label="model_name",
    latency={
        "ttft": ("vllm:time_to_first_token_seconds",),
        "queueWait": ("vllm:request_queue_time_seconds",),
        "e2e": ("vllm:e2e_request_latency_seconds",),
        INTER_TOKEN: ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    },
    counters={
        "requests": "vllm:request_success_total",
        "prompt_tokens": "vllm:prompt_tokens_total",
        "generated_tokens": "vllm:generation_tokens_total",
        "preemptions": "vllm:num_preemptions_total",
    },
    gauges={
        "queue_depth": ("vllm:num_requests_waiting",),
        "running": ("vllm:num_requests_running",),
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    },
    pods_gauge="vllm:num_requests_waiting",
)

SGLANG_NAMES = EngineMetricNames(
    engine=EngineKind.SGLANG,
    model_label="model_name",
    latency={
        "ttft": ("sglang:time_to_first_token_seconds",),
        "queueWait": ("sglang:queue_time_seconds",),
        "e2e": ("sglang:e2e_request_latency_seconds",),
        INTER_TOKEN: ("sglang:inter_token_latency_seconds",),
    },
    counters={
        "requests": "sglang:num_requests_total",
        "prompt_tokens": "sglang:prompt_tokens_total",
        "generated_tokens": "sglang:generation_tokens_total",
        "preemptions": "sglang:num_retracted_requests_total",
    },
    gauges={
        "queue_depth": ("sglang:num_queue_reqs",),
        "running": ("sglang:num_running_reqs",),
        "kv_usage": ("sglang:token_usage",),
    },
    pods_gauge="sglang:num_queue_reqs",
)

LLAMACPP_NAMES = EngineMetricNames(
    engine=EngineKind.LLAMACPP,
    model_label="model",  # not llama-server's: the scrape's (the target's model, or a relabelling's label)
    latency={},  # from the gate in front of it
    counters={
        "prefill_tokens": "llamacpp:prompt_tokens_total",
        "engine_generated_tokens": "llamacpp:tokens_predicted_total",
    },
    gauges={
        "queue_depth": ("llamacpp:requests_deferred",),
        "engine_running": ("llamacpp:requests_processing",),
    },
    pods_gauge=None,
    model_from_target=True,
    decodes="llamacpp:n_decode_total",
    busy_slots_per_decode="llamacpp:n_busy_slots_per_decode",
)

# The engines read through a table (batchpilot's own names come from the runtime's contract).
FOREIGN_ENGINES: dict[str, EngineMetricNames] = {
    EngineKind.VLLM: VLLM_NAMES,
    EngineKind.SGLANG: SGLANG_NAMES,
    EngineKind.LLAMACPP: LLAMACPP_NAMES,
}
ENGINES = tuple(EngineKind)
# Engines whose pods run batchpilot-gate in front of them: the gate's batchpilot_* series are read for them too.
GATED_ENGINES = frozenset({EngineKind.LLAMACPP})


@dataclass(frozen=True)
class ExposedSeries:
    """What one exposed name of a foreign engine feeds: ``kind`` is latency, counter, gauge or busy_slots
    (a per-decode mean since start, whose product with the decode counter is a counter);
    ``rank`` 0 for the newest name, higher for older ones."""

    engine: EngineMetricNames
    kind: str
    series: str
    rank: int


def exposed_names() -> dict[str, ExposedSeries]:
    """Every foreign engine's exposed name (histograms by their base name), for a scrape's parser."""
    table: dict[str, ExposedSeries] = {}
    for names in FOREIGN_ENGINES.values():
        for series, histograms in names.latency.items():
            for rank, name in enumerate(histograms):
                table[name] = ExposedSeries(names, "latency", series, rank)
        for series, counter in names.counters.items():
            table[counter] = ExposedSeries(names, "counter", series, 0)
        for series, gauges in names.gauges.items():
            for rank, name in enumerate(gauges):
                table[name] = ExposedSeries(names, "gauge", series, rank)
        if names.decodes is not None:
            table[names.decodes] = ExposedSeries(names, "counter", "batch_count", 0)
        if names.busy_slots_per_decode is not None:
            table[names.busy_slots_per_decode] = ExposedSeries(names, "busy_slots", "batch_sum", 0)
    return table
