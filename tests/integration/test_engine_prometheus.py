"""vLLM and SGLang profiles through a real Prometheus to a decision, in ``batchpilot-operator local``.

Two fake pods serve /metrics as vLLM and SGLang write them (prometheus_client with each engine's
names, labels and buckets: tests/support/engine_expositions.py), under a load whose first-token P99
is six times the profiles' SLO, with a queue behind a full running set. Debian's Prometheus scrapes them every second; the operator reads
them with its grouped queries (one set for both engines) and, both profiles recommending, prints its
recommendation (a higher cap) as JSON lines with the window in each engine's own settings.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_operator.frontends.local import parse_runtime, run_local
from batchpilot_operator.io.promql import PrometheusSource
from batchpilot_operator.tuning.model_metrics import to_observations
from batchpilot_operator.tuning.observations import share_above
from tests.integration.prometheus_process import ScrapeTarget, prometheus_binary, start_prometheus
from tests.support.engine_expositions import EngineExposition, Load, serving
from tests.support.factories import make_manifest, make_spec_dict

pytestmark = [
    pytest.mark.skipif(prometheus_binary() is None, reason="prometheus is not installed (scripts/system-deps.sh)"),
    pytest.mark.timeout(180),
]

# One request in ten waits 3 s for its first token (P99 near 3 s against an SLO of 500 ms), 200 requests wait
# and the running set is at the cap: a backlog the cap holds back.
SLOW_FIRST_TOKENS = Load(requests_per_s=50.0, ttft_s=(0.2,) * 9 + (3.0,), itl_s=(0.02,), waiting=200, running=128)


def profile(name: str, engine: str, mode: str | None) -> dict[str, Any]:
    tuning = {"cooldownSeconds": 0, **({"mode": mode} if mode else {})}
    spec = make_spec_dict(
        name,
        engine=engine,
        batchFriendliness="high",  # these engines export no step times to measure it from
        window={"targetBatchSize": 64, "hardCap": 128, "maxWaitMs": 0, "maxPrefillTokens": 4096},
        slo={"p99Ms": 500},
        tuning=tuning,
    )
    return make_manifest(spec, name=name, namespace="ml")


async def test_vllm_and_sglang_profiles_read_through_prometheus_recommend_in_their_engines_settings(
    tmp_path: Path,
) -> None:
    vllm = EngineExposition("vllm", "llama", SLOW_FIRST_TOKENS, legacy=True)
    sglang = EngineExposition("sglang", "qwen", SLOW_FIRST_TOKENS)
    profiles = tmp_path / "profiles.yaml"
    # vLLM: no mode, so recommend (its default); SGLang: recommend named.
    profiles.write_text(yaml.safe_dump_all([profile("llama", "vllm", None), profile("qwen", "sglang", "recommend")]))
    with serving(vllm) as vllm_address, serving(sglang) as sglang_address:
        targets = [ScrapeTarget(vllm_address, {"pod": "llama-0"}), ScrapeTarget(sglang_address, {"pod": "qwen-0"})]
        prometheus = start_prometheus(tmp_path / "prometheus", targets, scrape_interval_s=1.0)
        try:
            # Rates need two samples in the 4 s window: wait for both engines' series, then a few scrapes more.
            deadline = time.monotonic() + 60
            while not (prometheus.query("vllm:num_requests_waiting") and prometheus.query("sglang:num_queue_reqs")):
                assert time.monotonic() < deadline, "Prometheus never scraped both fake pods"
                await asyncio.sleep(0.5)
            await asyncio.sleep(5)
            runtimes = [
                parse_runtime(f"model=llama,url=http://{vllm_address},engine=vllm", 0),
                parse_runtime(f"model=qwen,url=http://{sglang_address},engine=sglang", 1),
            ]
            out = io.StringIO()
            await run_local(
                profiles,
                runtimes,
                prometheus_url=prometheus.url,
                interval_s=2.0,
                scrape_interval_s=1.0,
                duration_s=5.0,
                output="json",
                out=out,
            )
            # The same queries read directly: vLLM's old names (another ITL and KV value) are not added in.
            source = PrometheusSource(prometheus.url, scrape_interval_s=1.0, interval_s=2.0, namespace_label=None)
            try:
                metrics = await source.collect({}, ["vllm", "sglang"])
            finally:
                source.close(wait=True)
        finally:
            prometheus.stop()
    assert source.last_stats.queries == 3
    for model in ("llama", "qwen"):
        obs = to_observations(metrics[("", model)], "ttft", at_s=0.0)
        assert obs.kv_usage_ratio == pytest.approx(SLOW_FIRST_TOKENS.kv_usage)
        assert 0.01 < obs.itl_p99_s <= 0.025  # 20 ms gaps; vLLM's old name holds 200 ms ones
        # The error budget's hour of gaps, from the same names: none over 100 ms, none of the old name's.
        assert obs.itl_window_buckets and obs.itl_window_buckets[-1][1] > 0
        assert share_above(0.1, obs.itl_window_buckets) == 0.0
        assert obs.queue_depth == 200 and obs.mean_batch_size == 128
    print(out.getvalue())
    lines = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    by_model = {line["model"]: line for line in lines if line["direction"] == "recommend"}
    assert set(by_model) == {"llama", "qwen"}, out.getvalue()
    llama, qwen = by_model["llama"], by_model["qwen"]
    assert (llama["engine"], llama["mode"], qwen["engine"], qwen["mode"]) == (
        "vllm",
        "recommend",
        "sglang",
        "recommend",
    )
    for line in (llama, qwen):
        assert "P99" in line["reason"] or "p99" in line["reason"].lower(), line["reason"]
    # The recommendation in each engine's own words, and the window it comes from.
    assert llama["engineSettings"] == {
        "--max-num-seqs": llama["window"]["hardCap"],
        "--max-num-batched-tokens": llama["window"]["maxPrefillTokens"],
    }
    assert qwen["engineSettings"] == {
        "max_running_requests": qwen["window"]["hardCap"],
        "chunked_prefill_size": qwen["window"]["maxPrefillTokens"],
    }
    # 200 requests wait with the running set at its cap (128): the cap goes up, in each engine's own flag.
    for line in (llama, qwen):
        assert "raising the cap" in line["reason"], line["reason"]
        assert line["window"]["generation"] == 2
        assert line["window"]["hardCap"] > 128
