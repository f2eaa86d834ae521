"""The TTFT that batchpilot-gate adds, on loopback, with many concurrent streams.

    .venv/bin/python tests/bench/bench_gate.py --concurrency 100 --json out/bench/gate.json

Three processes, as in a pod: an upstream stand-in (uvicorn, the server vLLM and SGLang use)
that streams ``--tokens`` SSE events ``--token-gap-ms`` apart, its first at once; the gate in
front of it (``python -m batchpilot_runtime.gate.cli``, a window that never holds a request back:
target 1, wait 0, a cap above the concurrency); and this client, which keeps ``--concurrency``
streams open, each on its own connection, timing from its connect to the first ``data:`` bytes.
The streams start spread over one answer's length, so that their requests arrive evenly spaced
as under steady load (``--burst``: all at once, and equal answers keep them in step, the worst
case). Rounds alternate direct and through the gate so both see the same load on the host; the
added TTFT is the gate's quantile minus the direct one. The gate's admission, its upstream
connection pool and its copy of every chunk are all on the measured path. ``--gate-cpus`` pins
the gate apart from the client and the upstream, as a sidecar with a CPU of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from batchpilot_runtime.server.ready import RuntimeInfo


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_stream(host: str, port: int, body: bytes) -> float:
    """Seconds from connecting to the first SSE event; the rest of the stream is read and dropped."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    head = b""
    tail = b""
    first_s: float | None = None
    while chunk := await reader.read(65536):
        if first_s is None:
            head += chunk
            if b"data:" in head:
                first_s = time.perf_counter() - started
        tail = (tail + chunk)[-64:]
    writer.close()
    if first_s is None or not head.startswith(b"HTTP/1.1 200") or b"[DONE]" not in tail:
        raise RuntimeError(f"no whole stream from {host}:{port}: {head[:600]!r}")
    return first_s


async def run_round(url: str, concurrency: int, per_stream: int, body: bytes, spread_s: float = 0.0) -> list[float]:
    """TTFTs of ``concurrency`` streams, each sending ``per_stream`` requests one after another; the
    k-th stream starts ``k / concurrency`` of ``spread_s`` late, so that with ``spread_s`` one answer's
    length their requests arrive evenly spaced instead of all at once."""
    host, port = url.removeprefix("http://").split(":")

    async def worker(k: int) -> list[float]:
        await asyncio.sleep(spread_s * k / concurrency)
        return [await one_stream(host, int(port), body) for _ in range(per_stream)]

    results = await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return [ttft for stream in results for ttft in stream]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_upstream(ready_file: Path, tokens: int, token_gap_s: float) -> None:
    """The stand-in upstream (run in its own process by ``--serve-upstream``)."""
    from batchpilot_runtime.server.listen import bind_socket, http_server, url_of
    from tests.integration.gate_process import StandIn

    sock = bind_socket("127.0.0.1", 0)  # listening from here: connections wait in its backlog
    ready_file.write_text(url_of("127.0.0.1", sock))
    import uvloop  # as vLLM and SGLang serve

    uvloop.run(http_server(StandIn(token_delay_s=token_gap_s)).serve(sockets=[sock]))


def cpu_list(text: str) -> set[int]:
    """CPUs from ``0,2`` or ``1-3``, each one this process may run on."""
    allowed = os.sched_getaffinity(0)
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            cpus.update(range(int(first), int(last if dash else first) + 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 1 or 0,2 or 1-3)") from None
    if not cpus or not cpus < allowed:
        raise argparse.ArgumentTypeError(
            f"--gate-cpus {text!r} must name some but not all of the CPUs this process may use, {sorted(allowed)}"
        )
    return cpus


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (Linux affinity is per thread; new ones inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def wait_for(path: Path, process: subprocess.Popen[bytes], what: str) -> str:
    deadline = time.monotonic() + 60
    while not path.exists() or not path.read_text().strip():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.05)
    return path.read_text()


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=100, help="streams open at once")
    parser.add_argument(
        "--per-stream", type=int, default=5, help="requests each stream sends per round, one after another"
    )
    parser.add_argument("--rounds", type=int, default=10, help="rounds of each mode, alternating")
    parser.add_argument("--tokens", type=int, default=32, help="SSE events per answer")
    parser.add_argument(
        "--token-gap-ms", type=float, default=20.0, help="gap between two events of the upstream (50 tokens/s)"
    )
    parser.add_argument("--json", type=Path, default=Path("out/bench/gate.json"), help="output JSON path")
    parser.add_argument(
        "--burst",
        action="store_true",
        help="start every stream of a round at once (the worst case: equal answers keep them in step, "
        "so each request of a stream arrives with all the others); default: starts spread over one answer",
    )
    parser.add_argument(
        "--gate-cpus",
        type=cpu_list,
        help="pin the gate to these CPUs (e.g. 1) and the client and upstream to the others, as a "
        "sidecar with its own CPU request; default: all three share every CPU",
    )
    parser.add_argument("--serve-upstream", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def measure_behind_processes(args: argparse.Namespace, body: bytes) -> dict[str, Any]:
    """Starts the upstream stand-in and the gate, measures both paths, and stops the two processes."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory() as scratch:
        upstream_file, gate_file, token_file = (Path(scratch) / n for n in ("upstream", "gate.json", "token"))
        token_file.write_text("bench-token\n")
        upstream = subprocess.Popen(
            [sys.executable, __file__, "--serve-upstream", str(upstream_file), "--tokens", str(args.tokens),
             "--token-gap-ms", str(args.token_gap_ms)],
            env=env,
        )  # fmt: skip
        gate = None
        try:
            upstream_url = wait_for(upstream_file, upstream, "the upstream stand-in")
            cap = str(max(args.concurrency + 8, 16))
            gate = subprocess.Popen(
                [sys.executable, "-m", "batchpilot_runtime.gate.cli", "--upstream", upstream_url,
                 "--model-name", "bench", "--port", "0", "--admin-port", "0", "--ready-file", str(gate_file),
                 "--admin-token-file", str(token_file), "--target-batch-size", "1", "--max-wait-ms", "0",
                 "--hard-cap", cap, "--max-hard-cap", cap, "--max-queue", "4096", "--log-level", "warning"],
                env=env,
            )  # fmt: skip
            wait_for(gate_file, gate, "the gate")
            if args.gate_cpus is not None:
                rest = os.sched_getaffinity(0) - args.gate_cpus
                pin(gate.pid, args.gate_cpus)
                for pid in (upstream.pid, os.getpid()):
                    pin(pid, rest)
            gate_url = RuntimeInfo.read(gate_file).serve_url
            return asyncio.run(measure(args, upstream_url, gate_url, body, gate.pid))
        finally:
            for process in (gate, upstream):
                if process is not None:
                    process.terminate()
                    process.wait(30)


def print_result(result: dict[str, Any], args: argparse.Namespace) -> None:
    added = result["added_ttft_ms"]
    print(
        f"direct TTFT P50 {result['direct_ms']['p50']:.2f} ms, P99 {result['direct_ms']['p99']:.2f} ms; "
        f"through the gate P50 {result['gate_ms']['p50']:.2f} ms, P99 {result['gate_ms']['p99']:.2f} ms; "
        f"added P50 {added['p50']:.2f} ms, P99 {added['p99']:.2f} ms "
        f"({result['samples_per_mode']} streams each, {args.concurrency} at once); gate CPU "
        f"{result['gate_cpu_us_per_request']:.0f} us a request, {result['gate_cpu_us_per_chunk']:.0f} us a chunk; "
        f"wrote {args.json}"
    )


def main() -> int:
    args = _parse_args()
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream, args.tokens, args.token_gap_ms / 1000.0)
        return 0
    body = json.dumps({"model": "bench", "prompt": "x", "max_tokens": args.tokens, "stream": True}).encode()
    result = measure_behind_processes(args, body)
    result["host"] = {
        "cpus": os.cpu_count(),
        "gate_cpus": sorted(args.gate_cpus) if args.gate_cpus is not None else None,
        "load_avg_1m": os.getloadavg()[0],
        "python": platform.python_version(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print_result(result, args)
    return 0


async def measure(
    args: argparse.Namespace, upstream_url: str, gate_url: str, body: bytes, gate_pid: int
) -> dict[str, Any]:
    for url in (upstream_url, gate_url):  # warm-up: connections, caches, the gate's upstream pool
        await run_round(url, args.concurrency, 2, body)
    direct: list[float] = []
    gated: list[float] = []
    round_added_p50_ms: list[float] = []
    gate_cpu_s = 0.0  # the gate's CPU time over its rounds (it idles through the direct ones)
    spread_s = 0.0 if args.burst else args.tokens * args.token_gap_ms / 1000.0
    for _ in range(args.rounds):
        direct_round = await run_round(upstream_url, args.concurrency, args.per_stream, body, spread_s)
        cpu_before_s = cpu_seconds(gate_pid)
        gate_round = await run_round(gate_url, args.concurrency, args.per_stream, body, spread_s)
        gate_cpu_s += cpu_seconds(gate_pid) - cpu_before_s
        direct += direct_round
        gated += gate_round
        round_added_p50_ms.append(1000 * (statistics.median(gate_round) - statistics.median(direct_round)))

    def summary(values: list[float]) -> dict[str, float]:
        return {
            "p50": 1000 * quantile(values, 0.5),
            "p99": 1000 * quantile(values, 0.99),
            "mean": 1000 * statistics.mean(values),
        }

    direct_ms, gate_ms = summary(direct), summary(gated)
    return {
        "concurrency": args.concurrency,
        "arrivals": "burst" if args.burst else "spread",
        "tokens": args.tokens,
        "token_gap_ms": args.token_gap_ms,
        "samples_per_mode": len(direct),
        "direct_ms": direct_ms,
        "gate_ms": gate_ms,
        "added_ttft_ms": {q: gate_ms[q] - direct_ms[q] for q in ("p50", "p99", "mean")},
        "added_p50_by_round_ms": round_added_p50_ms,
        "goal_ms": {"p50": 1.0, "p99": 5.0},
        # What the gate's proxying costs, whatever the host's load: CPU per request and per chunk passed on.
        "gate_cpu_us_per_request": 1e6 * gate_cpu_s / len(gated),
        "gate_cpu_us_per_chunk": 1e6 * gate_cpu_s / (len(gated) * (args.tokens + 1)),
    }


if __name__ == "__main__":
    raise SystemExit(main())
