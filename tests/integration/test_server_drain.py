"""SIGTERM during load: readiness goes false, new requests are refused, every accepted request
finishes, and the process exits 0. The runtime runs as a real subprocess for the signal."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from tests.integration.runtime_process import parse_sse, start_runtime_process

ACCEPTED_BEFORE_SIGNAL = 12
MAX_TOKENS = 60


async def _stream_one(client: httpx.AsyncClient, accepted: asyncio.Queue[int], index: int) -> dict[str, object]:
    body = {
        "prompt": [50 + index] * 8,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code}
        await accepted.put(index)
        payloads = parse_sse([line async for line in response.aiter_lines()])
    finishing = [p for p in payloads if isinstance(p, dict) and p.get("choices") and p["choices"][0]["finish_reason"]]
    usage = [p["usage"] for p in payloads if isinstance(p, dict) and p.get("usage")]
    return {
        "status": 200,
        "done": payloads[-1:] == ["[DONE]"],
        "finish_reason": finishing[0]["choices"][0]["finish_reason"] if finishing else None,
        "completion_tokens": usage[0]["completion_tokens"] if usage else None,
    }


@pytest.mark.slow
async def test_sigterm_drains_without_losing_accepted_requests(tmp_path: Path) -> None:
    runtime = await asyncio.to_thread(
        start_runtime_process,
        tmp_path,
        "--hard-cap",
        "4",
        "--target-batch-size",
        "2",
        "--max-wait-ms",
        "0",
        "--kv-cache-tokens",
        "8192",
    )
    try:
        accepted: asyncio.Queue[int] = asyncio.Queue()
        async with httpx.AsyncClient(base_url=runtime.serve_url, timeout=120.0) as client:
            tasks = [asyncio.create_task(_stream_one(client, accepted, i)) for i in range(ACCEPTED_BEFORE_SIGNAL)]
            for _ in range(ACCEPTED_BEFORE_SIGNAL):
                await asyncio.wait_for(accepted.get(), timeout=120.0)
            runtime.send_signal(signal.SIGTERM)
            # While it drains: not ready, and a new completion is refused (503), never half-served.
            # (A completion sent before the signal is handled may still be accepted: only those sent
            # after readiness went false must be refused.)
            refused_statuses: list[int] = []
            saw_not_ready = False
            while runtime.process.poll() is None and not refused_statuses:
                try:
                    saw_not_ready = saw_not_ready or (await client.get("/readyz")).status_code == 503
                    if saw_not_ready:
                        late = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                        refused_statuses.append(late.status_code)
                except httpx.TransportError:
                    break  # the server has closed its port: it finished draining
            results = await asyncio.gather(*tasks)
        exit_code = await asyncio.to_thread(runtime.wait, 120.0)
    finally:
        await asyncio.to_thread(runtime.stop)
    assert exit_code == 0, runtime.log_text()[-3000:]
    assert saw_not_ready
    assert refused_statuses
    assert all(status == 503 for status in refused_statuses), refused_statuses
    for result in results:
        assert result == {"status": 200, "done": True, "finish_reason": "length", "completion_tokens": MAX_TOKENS}
    log = runtime.log_text()
    assert '"msg": "draining"' in log
    assert '"msg": "drained"' in log
