"""The ServeGen replay generator, on tiny synthetic tarballs of the real layout and,
when ../shared is there, on the real m-large data."""

from __future__ import annotations

import io
import json
import math
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpilot_runtime.cli import servegen as servegen_cli
from batchpilot_runtime.replay import servegen as sg
from batchpilot_runtime.replay.trace import TraceRequest, read_trace

WINDOWS_PER_DAY = 144
UNIFORM_1000 = {t: 1 / 1000 for t in range(1, 1001)}


def _pmf_text(pmf: dict[int, float]) -> str:
    return str(pmf)  # ServeGen's own format: a Python dict repr, keys unquoted


def _rows(days: int, rate: float | Sequence[float], pattern: str, shape: float, scale: float = 1.0) -> str:
    rates = [rate] * (days * WINDOWS_PER_DAY) if isinstance(rate, float | int) else list(rate)
    lines = []
    for i, r in enumerate(rates):
        pat = pattern if r > 0 else ""
        cv = "" if not pat else "1.0"
        args = ("", "") if not pat else (repr(shape), repr(scale))
        lines.append(f"{i * 600},{r},{cv},{pat},{args[0]},{args[1]}")
    return "\n".join(lines) + "\n"


def _dataset(days: int, inputs: dict[int, float] | list[dict[int, float]], outputs: dict[int, float]) -> str:
    per_window = [inputs] * (days * 4) if isinstance(inputs, dict) else inputs
    return json.dumps(
        {
            str(k * 21600): {"input_tokens": _pmf_text(pin), "output_tokens": _pmf_text(outputs if pin else {})}
            for k, pin in enumerate(per_window)
        }
    )


def make_tarball(folder: Path, model: str, clients: dict[int, tuple[str, str | None]]) -> Path:
    """``clients``: id -> (trace CSV text, dataset JSON text or None when absent)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"servegen_data_language_{model}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for cid, (trace, dataset) in clients.items():
            for name, text in ((f"chunk-{cid}-trace.csv", trace), (f"chunk-{cid}-dataset.json", dataset)):
                if text is None:
                    continue
                payload = text.encode()
                info = tarfile.TarInfo(f"data/language/{model}/{name}")
                info.size = len(payload)
                archive.addfile(info, io.BytesIO(payload))
    return path


DAYS = 2
# Client 1: Gamma, 3 req/s, prompts 100, and 1000 from 12h of day 1; client 2: Weibull, 1 req/s,
# prompts 200; client 3: 6 req/s, no fitted pattern (Poisson), dataset file absent from the snapshot.
DRIFT_INPUTS: list[dict[int, float]] = [{100: 1.0}] * 6 + [{1000: 1.0}] * 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("servegen")
    make_tarball(
        root,
        "m-tiny",
        {
            1: (_rows(DAYS, 3.0, "Gamma", 0.5), _dataset(DAYS, DRIFT_INPUTS, {7: 0.5, 9: 0.5})),
            2: (_rows(DAYS, 1.0, "Weibull", 0.5), _dataset(DAYS, {200: 1.0}, {0: 0.5, 5: 0.5})),
            3: (_rows(DAYS, 6.0, "", 0.0), None),
        },
    )
    return root


@pytest.fixture(scope="module")
def data(folder: Path) -> sg.ServeGenData:
    return sg.load_servegen("m-tiny", folder)


def single_client(folder: Path, model: str, pattern: str, shape: float, inputs: dict[int, float]) -> sg.ServeGenData:
    make_tarball(folder, model, {1: (_rows(1, 2.0, pattern, shape), _dataset(1, inputs, UNIFORM_1000))})
    return sg.load_servegen(model, folder)


def test_loads_the_layout_into_dataclasses(data: sg.ServeGenData) -> None:
    assert data.days == DAYS
    assert [c.client_id for c in data.clients] == [1, 2, 3]
    assert data.absent_clients == [3]
    first = data.clients[0].windows[0]
    assert first == sg.ArrivalWindow(0.0, 3.0, 1.0, "Gamma", 0.5, 1.0)
    assert len(data.clients[0].windows) == DAYS * WINDOWS_PER_DAY
    lengths = data.clients[0].lengths
    assert lengths is not None and len(lengths) == DAYS * 4
    assert lengths[7].input_tokens is not None and lengths[7].input_tokens.tokens.tolist() == [1000]


def test_same_seed_same_replay_other_seed_other_replay(data: sg.ServeGenData) -> None:
    a = sg.generate_replay(data, 0, start_s=3600, duration_s=3600, seed=5).requests
    assert a == sg.generate_replay(data, 0, start_s=3600, duration_s=3600, seed=5).requests
    assert a != sg.generate_replay(data, 0, start_s=3600, duration_s=3600, seed=6).requests
    assert all(0 <= r.arrival_s < 3600 for r in a)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)


def test_mean_rate_follows_rate_scale_and_target(data: sg.ServeGenData) -> None:
    raw = sg.generate_replay(data, 1, start_s=0, duration_s=7200, seed=1).requests
    assert len(raw) / 7200 == pytest.approx(10.0, rel=0.05)  # 3 + 1 + 6 req/s
    half = sg.generate_replay(data, 1, start_s=0, duration_s=7200, rate_scale=0.5, seed=1).requests
    assert len(half) / 7200 == pytest.approx(5.0, rel=0.05)
    replay = sg.generate_replay(data, 0, duration_s=6 * 3600, seed=2, target_mean_rate_per_s=0.8)
    assert replay.rate_scale == pytest.approx(0.08)
    assert len(replay.requests) / (6 * 3600) == pytest.approx(0.8, rel=0.05)


@pytest.mark.parametrize(
    ("pattern", "shape", "expected_cv"),
    [
        ("Gamma", 0.25, 2.0),  # cv = 1/sqrt(shape)
        ("Weibull", 0.5, math.sqrt(5.0)),  # cv^2 = G(1+2/k)/G(1+1/k)^2 - 1 = 24/4 - 1
        ("", 0.0, 1.0),  # rate but no fit: Poisson
    ],
)
def test_each_inter_arrival_law_is_used_with_the_rate_as_its_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str, shape: float, expected_cv: float
) -> None:
    data = single_client(tmp_path, "m-one", pattern, shape, {10: 1.0})
    used: set[tuple[str, float]] = set()
    unit_gaps = sg._unit_gaps

    def spy(rng: np.random.Generator, pat: str, shp: float, n: int) -> sg.FloatArray:
        used.add((pat, shp if pat else 0.0))
        return unit_gaps(rng, pat, shp, n)

    monkeypatch.setattr(sg, "_unit_gaps", spy)
    requests = sg.generate_replay(data, 0, duration_s=6 * 3600, seed=3).requests
    assert used == {(pattern, shape)}
    gaps = np.diff([r.arrival_s for r in requests])
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)  # rate 2 req/s
    assert gaps.std() / gaps.mean() == pytest.approx(expected_cv, rel=0.15)


def test_lengths_come_from_the_pmf_support_only(data: sg.ServeGenData) -> None:
    requests = sg.generate_replay(data, 1, start_s=11 * 3600, duration_s=2 * 3600, seed=4).requests
    prompts = {r.prompt_tokens for r in requests}
    assert prompts == {100, 200, 1000}  # client 1 switches from 100 to 1000 at 12h of day 1
    assert {r.output_tokens for r in requests} <= {7, 9, 1, 5}  # 0 is clipped to 1
    assert {r.output_tokens for r in requests} >= {1, 5, 7, 9}


def test_prompt_and_output_lengths_are_independent(tmp_path: Path) -> None:
    data = single_client(tmp_path, "m-one", "Gamma", 1.0, UNIFORM_1000)  # input = output PMF
    requests = sg.generate_replay(data, 0, duration_s=3600, seed=7).requests
    prompts = np.array([r.prompt_tokens for r in requests], dtype=float)
    outputs = np.array([r.output_tokens for r in requests], dtype=float)
    assert len(requests) > 5000
    assert abs(np.corrcoef(prompts, outputs)[0, 1]) < 0.05
    # ServeGen's own method (one uniform for both) would make them identical here.
    pmf = data.clients[0].lengths[0].input_tokens  # type: ignore[index]
    assert pmf is not None
    u = np.random.default_rng(0).random(1000)
    same = pmf.tokens[np.searchsorted(pmf.cdf, u, side="right")]
    assert np.corrcoef(same, same)[0, 1] == pytest.approx(1.0)


def test_absent_client_takes_the_rate_weighted_mix_of_the_present_ones(data: sg.ServeGenData) -> None:
    absent = data.clients[2]
    pin, _ = data.pmfs_for(absent, 0.0)
    assert pin is not None
    assert dict(zip(pin.tokens.tolist(), pin.probs.tolist(), strict=True)) == pytest.approx({100: 0.75, 200: 0.25})
    # max_clients=1 keeps the busiest client, the absent one (6 req/s), alone.
    requests = sg.generate_replay(data, 0, duration_s=3600, seed=8, max_clients=1).requests
    assert len(requests) / 3600 == pytest.approx(6.0, rel=0.05)
    share_100 = sum(r.prompt_tokens == 100 for r in requests) / len(requests)
    assert share_100 == pytest.approx(0.75, abs=0.03)
    assert {r.prompt_tokens for r in requests} == {100, 200}


def test_present_client_with_an_empty_window_takes_the_mix(tmp_path: Path) -> None:
    inputs: list[dict[int, float]] = [{}, {50: 1.0}, {50: 1.0}, {50: 1.0}]
    make_tarball(
        tmp_path,
        "m-gap",
        {
            1: (_rows(1, 1.0, "Gamma", 1.0), _dataset(1, inputs, {3: 1.0})),
            2: (_rows(1, 1.0, "Gamma", 1.0), _dataset(1, {80: 1.0}, {4: 1.0})),
        },
    )
    data = sg.load_servegen("m-gap", tmp_path)
    pin, pout = data.pmfs_for(data.clients[0], 0.0)
    assert pin is not None and pin.tokens.tolist() == [80]
    assert pout is not None and pout.tokens.tolist() == [4]


def test_describe_and_drifting_day(data: sg.ServeGenData) -> None:
    stats = sg.describe(data, 1)
    assert [s.start_s for s in stats] == [0, 21600, 43200, 64800]
    assert all(s.mean_rate_per_s == pytest.approx(10.0) for s in stats)
    assert all(s.token_coverage == pytest.approx(0.4) for s in stats)
    assert [s.prompt_p50 for s in stats] == [100, 100, 1000, 1000]  # the 3:1 mix of clients 1 and 2
    assert [s.prompt_p99 for s in stats] == [200, 200, 1000, 1000]
    assert [(s.output_p50, s.output_p99) for s in stats] == [(7, 9)] * 4  # 0: .125, 5: .125, 7: .375, 9: .375
    assert sg.prompt_drift(data) == [1.0, 10.0]
    assert sg.drifting_day(data) == 1
    assert [s.prompt_p50 for s in sg.describe(data, 0)] == [100] * 4
    assert sg.steadiest_day(data) == 0


def test_csv_round_trips_through_the_trace_reader(data: sg.ServeGenData, tmp_path: Path) -> None:
    requests = sg.generate_replay(data, 0, duration_s=600, seed=9).requests
    path = sg.write_trace_csv(requests, tmp_path / "day.csv")
    back = read_trace(path)
    origin = requests[0].arrival_s
    assert [(r.prompt_tokens, r.output_tokens) for r in back] == [(r.prompt_tokens, r.output_tokens) for r in requests]
    assert [r.arrival_s for r in back] == pytest.approx([r.arrival_s - origin for r in requests], abs=2e-6)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda d, f: sg.load_servegen("m-huge", f), "unknown ServeGen model 'm-huge'.*available: m-tiny"),
        (lambda d, f: sg.load_servegen("m-tiny", f / "nowhere"), "no ServeGen data folder"),
        (lambda d, f: sg.generate_replay(d, 2).requests, r"day 2 out of range: m-tiny has 2 days \(0..1\)"),
        (lambda d, f: sg.generate_replay(d, -1).requests, "day -1 out of range"),
        (lambda d, f: sg.generate_replay(d, 0, rate_scale=-1.0).requests, "rate_scale must be > 0"),
        (
            lambda d, f: sg.generate_replay(d, 0, target_mean_rate_per_s=-2.0).requests,
            "target_mean_rate_per_s must be > 0",
        ),
        (lambda d, f: sg.generate_replay(d, 0, rate_scale=2.0, target_mean_rate_per_s=1.0).requests, "not both"),
        (
            lambda d, f: sg.generate_replay(d, 1, start_s=3600, duration_s=86400).requests,
            "runs past the end of the data",
        ),
        (lambda d, f: sg.generate_replay(d, 0, duration_s=0).requests, "duration_s must be > 0"),
        (lambda d, f: sg.generate_replay(d, 0, max_clients=0).requests, "max_clients must be >= 1"),
        (lambda d, f: sg.generate_replay(d, 0, max_requests=1000).requests, "more than max_requests=1,000"),
    ],
)
def test_bad_input_raises_a_value_error_naming_it(data: sg.ServeGenData, folder: Path, call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call(data, folder)


def test_malformed_rows_name_the_file_and_line(tmp_path: Path) -> None:
    make_tarball(tmp_path, "m-bad", {4: ("0,1.0,1.0,Gamma,1.0,1.0\n600,-3,1.0,Gamma,1.0,1.0\n", None)})
    with pytest.raises(ValueError, match=r"chunk-4-trace.csv:2: rate must be >= 0"):
        sg.load_servegen("m-bad", tmp_path)
    make_tarball(tmp_path, "m-bad2", {4: ("0,1.0,1.0,Pareto,1.0,1.0\n", None)})
    with pytest.raises(ValueError, match="unknown pattern 'Pareto'"):
        sg.load_servegen("m-bad2", tmp_path)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    day=st.integers(0, DAYS - 1),
    start_s=st.floats(0, 80000),
    duration_s=st.floats(1, 3000),
    target=st.floats(0.01, 3.0),
)
def test_replays_are_sorted_in_span_and_positive(
    data: sg.ServeGenData, seed: int, day: int, start_s: float, duration_s: float, target: float
) -> None:
    requests = sg.generate_replay(data, day, start_s, duration_s, seed=seed, target_mean_rate_per_s=target).requests
    times = [r.arrival_s for r in requests]
    assert times == sorted(times)
    assert all(0 <= t < duration_s for t in times)
    assert all(isinstance(r, TraceRequest) and r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in requests)
    assert (
        requests
        == sg.generate_replay(data, day, start_s, duration_s, seed=seed, target_mean_rate_per_s=target).requests
    )


@given(pmf=st.dictionaries(st.integers(0, 10**6), st.floats(0.001, 1.0), min_size=1, max_size=30))
def test_pmf_text_parses_and_samples_in_support(pmf: dict[int, float]) -> None:
    parsed = sg.TokenPMF.parse(_pmf_text(pmf))
    assert parsed is not None
    assert parsed.tokens.tolist() == sorted(pmf)
    assert parsed.probs.sum() == pytest.approx(1.0)
    assert set(parsed.sample(np.random.default_rng(0), 200).tolist()) <= set(pmf)
    assert parsed.quantile(0.0) == min(pmf) and parsed.quantile(1.0) == max(pmf)


def test_cli_writes_a_replay(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "day.csv"
    args = ["--model", "m-tiny", "--data", str(folder), "--day", "1", "--hours", "0-2", "--target-rate", "1.5"]
    assert servegen_cli.main([*args, "-o", str(out)]) == 0
    assert "req/s" in capsys.readouterr().out
    assert len(read_trace(out)) / 7200 == pytest.approx(1.5, rel=0.1)
    assert servegen_cli.main(["--model", "m-huge", "--data", str(folder)]) == 2
    assert "unknown ServeGen model" in capsys.readouterr().err


REAL = sg.tarball_path("m-large")


@pytest.mark.skipif(not REAL.exists(), reason=f"no ServeGen data at {REAL}")
def test_real_m_large_has_fourteen_days_and_a_drifting_day() -> None:
    data = sg.load_servegen("m-large")
    assert data.days == 14
    day = sg.drifting_day(data)
    p50s = [s.prompt_p50 for s in sg.describe(data, day)]
    assert max(p50s) / min(p50s) > 5
    requests = sg.generate_replay(
        data, day, start_s=12 * 3600, duration_s=1800, seed=0, target_mean_rate_per_s=5.5
    ).requests
    assert len(requests) / 1800 == pytest.approx(5.5, rel=0.3)
    steady = sg.steadiest_day(data)
    p50s = [s.prompt_p50 for s in sg.describe(data, steady)]
    assert steady != day and max(p50s) / min(p50s) < 1.2


def test_no_steady_day_without_lengths_in_every_window(tmp_path: Path) -> None:
    inputs: list[dict[int, float]] = [{}, {50: 1.0}, {50: 1.0}, {50: 1.0}]
    make_tarball(tmp_path, "m-hole", {1: (_rows(1, 1.0, "Gamma", 1.0), _dataset(1, inputs, {3: 1.0}))})
    data = sg.load_servegen("m-hole", tmp_path)
    assert [s.prompt_p50 for s in sg.describe(data, 0)] == [0, 50, 50, 50]
    with pytest.raises(ValueError, match="m-hole: no day has prompt lengths in all of its 6-hour windows"):
        sg.steadiest_day(data)
