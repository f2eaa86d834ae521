"""bench_runtime's replay clock: CPU time scaled by --clock-scale, idle gaps added unscaled, the
flag's errors; and the untimed warm-up, on unless --no-warmup."""

from __future__ import annotations

import pytest

from tests.bench import bench_runtime
from tests.bench.bench_runtime import ReplayClock, parse_args


def test_the_cpu_clock_scales_work_but_not_skipped_idle_time(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [10.0]
    monkeypatch.setattr(bench_runtime.time, "thread_time", lambda: now[0])
    clock = ReplayClock("cpu", scale=0.5)
    now[0] = 12.0  # two seconds of work count as one
    assert clock() == pytest.approx(1.0)
    clock.idle_until(3.0)  # nothing to do until 3 s: skipped as is
    assert clock() == pytest.approx(3.0)
    now[0] = 14.0
    assert clock() == pytest.approx(4.0)


@pytest.mark.parametrize(
    "argv", [["--clock-scale", "0"], ["--clock-scale", "-1"], ["--clock", "wall", "--clock-scale", "0.8"]]
)
def test_a_scale_the_clock_cannot_take_is_refused_naming_the_flag(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "--clock-scale" in capsys.readouterr().err
    with pytest.raises(ValueError, match="clock scale"):
        ReplayClock("wall", scale=0.8)


def test_by_default_the_clock_is_unscaled_and_the_process_warmed_up() -> None:
    args = parse_args(["--quick"])
    assert args.clock == "cpu" and args.clock_scale == 1.0 and args.warmup is True
    assert parse_args(["--no-warmup"]).warmup is False
