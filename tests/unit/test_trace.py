from pathlib import Path

import pytest

from batchpilot_runtime.replay.trace import (
    BUNDLED_TRACE_PATH,
    DEFAULT_TRACE_PATH,
    SHARED_TRACE_PATH,
    TraceError,
    TraceRequest,
    TraceScaling,
    arrival_rate_series,
    plan_replay,
    read_trace,
    scale_trace,
    time_scale_for_rate,
)


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + body)
    return path


def test_reads_azure_timestamps_relative_to_the_first(tmp_path: Path) -> None:
    path = write(tmp_path, "2023-11-16 18:15:47.0000001,10,2\n2023-11-16 18:15:46.5000000,20,3\n")
    trace = read_trace(path)
    assert [r.prompt_tokens for r in trace] == [20, 10]
    assert trace[0].arrival_s == 0.0
    assert trace[1].arrival_s == pytest.approx(0.5000001)


def test_reads_plain_second_timestamps_with_fractions(tmp_path: Path) -> None:
    trace = read_trace(write(tmp_path, "12.5,10,2\n10,5,1\n"))
    assert [r.arrival_s for r in trace] == [0.0, 2.5]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("x,1,2\n", ":2:"),
        ("1,-1,2\n", "token counts"),
        ("", "no requests"),
    ],
)
def test_bad_rows_name_the_line(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        read_trace(write(tmp_path, body))


def test_missing_column_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(TraceError, match="GeneratedTokens"):
        read_trace(path)


def test_scaling_slices_then_scales_time_and_tokens() -> None:
    trace = [TraceRequest(float(i), 100 * (i + 1), 10) for i in range(10)]
    scaling = TraceScaling(time_scale=2.0, token_scale=0.5, start_s=2.0, duration_s=4.0, max_prompt_tokens=180)
    out = scale_trace(trace, scaling)
    assert [r.arrival_s for r in out] == [0.0, 0.5, 1.0, 1.5]
    assert [r.prompt_tokens for r in out] == [150, 180, 180, 180]
    assert all(r.output_tokens == 5 for r in out)
    assert "time x2" in scaling.describe()


def test_scaling_never_goes_below_min_tokens() -> None:
    out = scale_trace([TraceRequest(0.0, 3, 1)], TraceScaling(token_scale=0.01))
    assert out[0].prompt_tokens == 1
    assert out[0].output_tokens == 1


def test_bad_scaling_is_refused() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        TraceScaling(time_scale=0)


def test_rate_helpers() -> None:
    trace = [TraceRequest(float(i) / 2, 1, 1) for i in range(11)]
    assert time_scale_for_rate(trace, 4.4) == pytest.approx(2.0)
    assert arrival_rate_series(trace, 1.0)[0] == (0.0, 2.0)


@pytest.mark.skipif(not SHARED_TRACE_PATH.exists(), reason="shared trace not present")
def test_shared_trace_shape() -> None:
    trace = read_trace(SHARED_TRACE_PATH)
    assert len(trace) > 19_000
    assert 3400 < trace[-1].arrival_s < 3700


def test_the_bundled_excerpt_is_the_first_quarter_hour() -> None:
    trace = read_trace(BUNDLED_TRACE_PATH)
    assert len(trace) > 4000
    assert trace[-1].arrival_s < 15 * 60


def test_default_trace_exists_in_any_checkout() -> None:
    assert DEFAULT_TRACE_PATH.exists()


def test_plan_replay_sets_the_rate_of_the_slice_not_of_the_whole_trace() -> None:
    # 1 req/s for the first 10 s, then 10 req/s: 20 req/s on the busy slice is about x2, not x20.
    trace = [TraceRequest(float(i), 10, 2) for i in range(10)]
    trace += [TraceRequest(10.0 + i / 10, 10, 2) for i in range(100)]
    scaling, requests = plan_replay(trace, rate_per_s=20.0, start_s=10.0, token_scale=0.5)
    assert scaling.time_scale == pytest.approx(20.0 / (100 / 9.9))  # 100 arrivals over 9.9 s
    assert len(requests) == 100
    assert requests[0].prompt_tokens == 5


def test_plan_replay_refuses_an_empty_slice() -> None:
    with pytest.raises(ValueError, match="selects no request"):
        plan_replay([TraceRequest(0.0, 1, 1)], start_s=5.0)
