"""spec.engine llamacpp: llama-server's own metrics beside the gate's, and its start-up flags for a window.

The llama-server exposition below follows ``server_task_result_metrics::to_metrics`` in
``tools/server/server-task.cpp`` of llama.cpp as vendored by the llama-cpp-python 0.3.36 sdist: every metric
under the ``llamacpp:`` prefix, with no label, ``# HELP`` and ``# TYPE`` lines, counters first, then gauges,
values printed by a C++ stream (six significant digits). The gate's half is batchpilot's names with
``model`` as the gate's ``--model-name``. The flags follow ``common/arg.cpp`` and ``tools/server/server.cpp``.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from batchpilot_operator.api.profile import EngineKind, parse_spec
from batchpilot_operator.control.engine_knobs import engine_settings
from batchpilot_operator.control.restart import engine_args, engine_flags, running_window, window_flags
from batchpilot_operator.control.restart_plan import llamacpp_rewrite_args, read_flags
from batchpilot_operator.frontends.local import parse_runtime
from batchpilot_operator.io import promql
from batchpilot_operator.io.engine_metrics import LLAMACPP_NAMES
from batchpilot_operator.io.exposition import parse_exposition
from batchpilot_operator.io.scrape import Scrape, metrics_from_scrapes
from batchpilot_operator.tuning.model_metrics import MetricsBuilder, to_observations
from batchpilot_runtime.contract.window import Window
from tests.support.factories import make_spec_dict

# (name, description) in to_metrics' order; the descriptions are the source's.
COUNTERS = (
    ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "Total time spent processing prompts"),
    ("tokens_predicted_total", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "Total time spent generating tokens"),
    (
        "n_decode_total",
        "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
    ),
    ("n_tokens_max", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps"),
)
GAUGES = (
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s"),
    ("requests_processing", "Number of requests processing"),
    ("requests_deferred", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call"),
)


def llama_server_metrics(values: Mapping[str, float]) -> str:
    """llama-server's /metrics body for ``values`` (0 for a metric not given), as its to_metrics writes it."""
    lines = []
    for kind, items in (("counter", COUNTERS), ("gauge", GAUGES)):
        for name, description in items:
            lines += [
                f"# HELP llamacpp:{name} {description}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {values.get(name, 0.0):.6g}",  # std::stringstream << double
            ]
    return "\n".join(lines) + "\n"


def gate_metrics(model: str, *, requests: int, generated: int, waiting: int, in_flight: int, ttft_s: float) -> str:
    """The gate's part of the pod's metrics: requests, tokens from the answers' usage, its queue, and the
    first-token histogram (every request at ``ttft_s``)."""
    label = f'model="{model}"'
    bounds = (0.1, 0.5, 1.0, 2.5, 5.0)
    buckets = [
        f'batchpilot_ttft_seconds_bucket{{{label},lane="default",le="{b}"}} {requests if ttft_s <= b else 0}'
        for b in bounds
    ]
    return "\n".join(
        [
            f'batchpilot_requests_total{{{label},lane="default",outcome="completed"}} {requests}',
            f"batchpilot_generated_tokens_total{{{label}}} {generated}",
            f"batchpilot_queue_depth{{{label}}} {waiting}",
            f"batchpilot_running_sequences{{{label}}} {in_flight}",
            *buckets,
            f'batchpilot_ttft_seconds_bucket{{{label},lane="default",le="+Inf"}} {requests}',
            f'batchpilot_ttft_seconds_count{{{label},lane="default"}} {requests}',
            "",
        ]
    )


def scrape(at_s: float, *bodies: str) -> Scrape:
    series: dict = {}
    for body in bodies:
        series.update(parse_exposition(body))
    return Scrape(at_s, series)


def test_a_pods_llama_server_and_gate_metrics_give_the_policy_its_figures() -> None:
    # 60 s apart: 120 requests (2/s) through the gate, 6,000 tokens predicted (100/s), 30,000 prompt tokens
    # computed (500/s), 1,200 decode calls with 4 busy slots each (the mean was 2 over the first 600 calls).
    first_llama = llama_server_metrics(
        {"prompt_tokens_total": 1000, "tokens_predicted_total": 500, "n_decode_total": 600,
         "n_busy_slots_per_decode": 2.0, "prompt_tokens_seconds": 999.0}
    )  # fmt: skip
    second_llama = llama_server_metrics(
        {"prompt_tokens_total": 31000, "tokens_predicted_total": 6500, "n_decode_total": 1800,
         "n_busy_slots_per_decode": (2.0 * 600 + 4.0 * 1200) / 1800, "requests_processing": 5,
         "requests_deferred": 1, "prompt_tokens_seconds": 5.0}
    )  # fmt: skip
    first_gate = gate_metrics("smol", requests=10, generated=400, waiting=0, in_flight=0, ttft_s=0.3)
    # The gate counts tokens from usage it may not get, and sees 7 in flight where llama-server runs 5.
    second_gate = gate_metrics("smol", requests=130, generated=999, waiting=3, in_flight=7, ttft_s=0.3)
    builder = MetricsBuilder(60.0)
    metrics_from_scrapes(
        scrape(60.0, second_gate, second_llama), scrape(0.0, first_gate, first_llama), builder, "ml", model="smol"
    )
    built = builder.build()
    assert list(built) == [("ml", "smol")]  # llama-server's unlabelled series joined the target's model
    metrics = built[("ml", "smol")]
    assert metrics.requests_per_s == pytest.approx(2.0)  # the gate's
    assert metrics.generated_tokens_per_s == pytest.approx(100.0)  # llama-server's, not the gate's
    assert metrics.prefill_tokens_per_s == pytest.approx(500.0)
    assert metrics.running == 5  # the slots busy, not the gate's requests in flight
    assert metrics.queue_depth == 3 + 1  # waiting at the gate, and deferred inside llama-server
    assert metrics.pods_reporting == 1  # counted once, by the gate
    assert metrics.decode_batch_count_per_s == pytest.approx(20.0)
    obs = to_observations(metrics, "ttft", at_s=0.0)
    # This window's decode calls, not the mean since start; the gauge's six printed digits (3.33333) leave 5e-6.
    assert obs.mean_batch_size == pytest.approx(4.0, rel=1e-5)
    assert 0.1 < obs.p99_s <= 0.5  # the gate's first-token histogram
    assert obs.tokens_per_s == pytest.approx(100.0)


def test_the_throughput_gauges_that_a_scrape_resets_are_not_read() -> None:
    from batchpilot_operator.io.engine_metrics import exposed_names

    names = exposed_names()
    assert "llamacpp:prompt_tokens_seconds" not in names
    assert "llamacpp:predicted_tokens_seconds" not in names
    assert {n for n in names if n.startswith("llamacpp:")} == {
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:n_decode_total",
        "llamacpp:n_busy_slots_per_decode",
    }


def test_a_counter_past_a_million_is_read_at_the_six_digits_llama_server_prints() -> None:
    body = llama_server_metrics({"tokens_predicted_total": 12_345_678})
    assert "llamacpp:tokens_predicted_total 1.23457e+07\n" in body
    assert parse_exposition(body)[("llamacpp:tokens_predicted_total", ())] == 12_345_700


def test_the_queries_read_the_gate_and_llama_server_for_a_llamacpp_profile() -> None:
    queries = promql.build_queries(60, engines=("llamacpp",))
    assert set(queries) == {"latency", "rates", "gauges"}
    text = " ".join(queries.values())
    assert "batchpilot_ttft_seconds_bucket[60s]" in text  # the gate's latency
    assert "rate(llamacpp:tokens_predicted_total[60s])" in text
    assert "rate(llamacpp:prompt_tokens_total[60s])" in text
    assert "llamacpp:requests_processing" in text and "llamacpp:requests_deferred" in text
    assert (
        "clamp_min(llamacpp:n_busy_slots_per_decode * llamacpp:n_decode_total - "
        "(llamacpp:n_busy_slots_per_decode offset 60s) * (llamacpp:n_decode_total offset 60s), 0)"
    ) in text
    assert "count by (namespace, model) (llamacpp:" not in text  # pods are counted by the gate
    assert "prompt_tokens_seconds" not in text and "predicted_tokens_seconds" not in text
    assert "batchpilot_inter_token_seconds_bucket[3600s]" in promql.build_gap_hour_query(engines=("llamacpp",))
    assert LLAMACPP_NAMES.model_label == "model"


# ---- the restart path: a window as llama-server's flags --------------------------------------------------


def window(cap: int, budget: int | None = None) -> Window:
    return Window(target_batch_size=min(4, cap), hard_cap=cap, max_wait_ms=0, max_prefill_tokens=budget, generation=1)


def test_a_window_is_parallel_and_batch_size() -> None:
    assert engine_settings("llamacpp", window(8, 256)) == {"--parallel": 8, "--batch-size": 256}
    assert engine_flags(EngineKind.LLAMACPP, window(8)) == {"--parallel": 8}


@pytest.mark.parametrize(
    ("args", "wanted", "expected"),
    [
        pytest.param(
            ["-m", "/models/smol.gguf", "--parallel", "4", "--ctx-size", "8192"],
            {"--parallel": 8},
            ["-m", "/models/smol.gguf", "--parallel", "8", "--ctx-size", "16384"],
            id="split-cache-keeps-2048-per-slot",
        ),
        pytest.param(
            ["-np", "16", "-c", "16384", "-t", "1"],
            {"--parallel": 6, "--batch-size": 256},
            ["-np", "6", "-c", "6144", "-t", "1", "--batch-size", "256", "--ubatch-size", "256"],
            id="short-names-kept-ubatch-lowered-to-the-batch",
        ),
        pytest.param(
            ["--parallel", "4", "-c", "8192", "--kv-unified", "-ub", "128"],
            {"--parallel": 12, "--batch-size": 1024},
            ["--parallel", "12", "-c", "8192", "--kv-unified", "-ub", "128", "--batch-size", "1024"],
            id="unified-cache-keeps-its-size-and-a-smaller-ubatch",
        ),
        pytest.param(
            ["-m", "/models/smol.gguf"],
            {"--parallel": 8},
            ["-m", "/models/smol.gguf", "--parallel", "8", "--kv-unified"],
            id="auto-slots-were-unified-and-stay-so",
        ),
        pytest.param(
            ["--parallel", "2", "-c", "4096", "-kvu", "--no-kv-unified"],
            {"--parallel": 4},
            ["--parallel", "4", "-c", "8192", "-kvu", "--no-kv-unified"],
            id="the-last-kv-flag-wins",
        ),
        pytest.param(
            ["--batch-size", "2048", "--ubatch-size", "512"],
            {"--batch-size": 4096},
            ["--batch-size", "4096", "--ubatch-size", "512"],
            id="a-larger-budget-keeps-the-ubatch",
        ),
    ],
)
def test_the_args_that_carry_a_window(args: list[str], wanted: dict[str, int], expected: list[str]) -> None:
    assert llamacpp_rewrite_args(args, wanted) == expected
    assert engine_args(EngineKind.LLAMACPP, args, wanted) == expected


def test_a_split_cache_without_a_context_size_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--ctx-size is unset or 0"):
        llamacpp_rewrite_args(["--parallel", "4"], {"--parallel": 8})
    with pytest.raises(ValueError, match="--ctx-size is unset or 0"):
        llamacpp_rewrite_args(["--parallel", "4", "-c", "0"], {"--parallel": 8})


def test_the_running_window_is_read_from_short_and_long_names() -> None:
    flags, aliases = window_flags(EngineKind.LLAMACPP)
    running = read_flags(["-np", "6", "--batch_size", "512", "-c", "4096"], flags, aliases)
    assert running == {"--parallel": 6, "--batch-size": 512}
    spec = parse_spec(make_spec_dict(engine="llamacpp", tuning={"mode": "recommend"}))
    current = running_window(spec, running, EngineKind.LLAMACPP)
    assert current is not None
    assert (current.hard_cap, current.max_prefill_tokens, current.target_batch_size) == (6, 512, 6)


# ---- local mode -----------------------------------------------------------------------------------------


def test_local_mode_takes_the_gates_urls_and_llama_servers() -> None:
    runtime = parse_runtime(
        "model=smol,engine=llamacpp,url=http://127.0.0.1:8080,admin=http://127.0.0.1:8081/,"
        "engine-url=http://127.0.0.1:8000/"
    )
    assert (runtime.engine, runtime.url, runtime.admin, runtime.engine_url) == (
        "llamacpp",
        "http://127.0.0.1:8080",
        "http://127.0.0.1:8081",
        "http://127.0.0.1:8000",
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("model=smol,engine=llamacpp,url=http://127.0.0.1:8080", "admin= is required"),
        ("model=smol,engine=llamacpp,url=http://h:8080,admin=http://h:8081,engine-url=h:8000", "engine-url= must be"),
        ("model=smol,engine=vllm,url=http://h:8000,engine-url=http://h:8001", "engine-url= is for engine=llamacpp"),
    ],
)
def test_local_mode_refuses_a_llamacpp_runtime_it_cannot_reach(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_runtime(text)
