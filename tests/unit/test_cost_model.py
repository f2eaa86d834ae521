"""The step-time model: arithmetic, profiles, loading, and the least-squares fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot_runtime.replay.cost_model import (
    A100_LLAMA2_7B,
    PROFILES,
    UNIT,
    CostModel,
    CostModelError,
    StepComposition,
    fit_cost_model,
    load_cost_model,
)
from batchpilot_runtime.scheduling.types import ScheduledSeq


def test_step_seconds_is_the_linear_sum() -> None:
    model = CostModel("m", fixed_s=0.01, per_prefill_token_s=0.001, per_decode_seq_s=0.002, per_kv_token_s=1e-6)
    assert model.step_seconds(StepComposition(100, 4, 1000)) == pytest.approx(0.01 + 0.1 + 0.008 + 0.001)


def test_composition_from_a_plan() -> None:
    seqs = [
        ScheduledSeq("a", (1, 2, 3), 0, (0,), True, True),  # a 3-token prompt
        ScheduledSeq("b", (9,), 40, (1, 2, 3), True, False),  # a decode with 40 tokens cached
    ]
    assert StepComposition.from_seqs(seqs) == StepComposition(prefill_tokens=3, decode_seqs=1, kv_tokens=3 + 41)


def test_published_profile_is_plausible() -> None:
    # Llama-2-7B on an A100: a lone decode step ~11 ms, a 1000-token prefill ~70 ms.
    assert 0.008 < A100_LLAMA2_7B.step_seconds(StepComposition(0, 1, 500)) < 0.015
    assert 0.05 < A100_LLAMA2_7B.step_seconds(StepComposition(1000, 0, 1000)) < 0.1
    assert A100_LLAMA2_7B.decode_tokens_per_s(64, 1000) > 10 * A100_LLAMA2_7B.decode_tokens_per_s(1, 1000)
    assert set(PROFILES) >= {"a100-llama2-7b", "unit"}


def test_fit_recovers_known_coefficients() -> None:
    truth = CostModel("t", fixed_s=0.005, per_prefill_token_s=2e-4, per_decode_seq_s=1e-3, per_kv_token_s=3e-6)
    samples = []
    for prefill in (0, 16, 64, 256):
        for decode in (0, 1, 4, 16):
            for kv in (0, 500, 4000):
                if prefill == 0 and decode == 0:
                    continue
                comp = StepComposition(prefill, decode, kv + prefill)
                samples.append((comp, truth.step_seconds(comp)))
    fit = fit_cost_model(samples, name="fitted")
    for field in ("fixed_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s"):
        assert getattr(fit.model, field) == pytest.approx(getattr(truth, field), rel=1e-6)
    assert fit.r_squared == pytest.approx(1.0)


def test_fit_never_returns_negative_coefficients() -> None:
    # Step time that does not depend on the KV at all, with noise that would push its slope below 0.
    samples = [
        (StepComposition(p, d, kv), 0.01 + 1e-4 * p + 1e-3 * d - 1e-9 * kv)
        for p, d, kv in [(0, 1, 100), (0, 8, 9000), (64, 0, 64), (128, 2, 20000), (32, 4, 50), (0, 2, 30000)]
    ]
    fit = fit_cost_model(samples)
    assert fit.model.per_kv_token_s == 0.0
    assert min(fit.model.fixed_s, fit.model.per_prefill_token_s, fit.model.per_decode_seq_s) >= 0


def test_fit_refuses_too_few_or_bad_samples() -> None:
    with pytest.raises(CostModelError, match="at least 4"):
        fit_cost_model([(StepComposition(1, 0, 1), 0.1)])
    with pytest.raises(CostModelError, match=r"samples\[1\]"):
        fit_cost_model([(StepComposition(1, 0, 1), 0.1), (StepComposition(1, 0, 1), -1.0)] * 2)


def test_load_by_name_or_json_file(tmp_path: Path) -> None:
    assert load_cost_model("unit") is UNIT
    path = tmp_path / "cpu.json"
    fit = fit_cost_model(
        [
            (StepComposition(p, d, kv), 0.01 + 1e-3 * p + 2e-3 * d)
            for p, d, kv in [(1, 0, 50), (10, 1, 10), (0, 5, 400), (20, 3, 90), (5, 5, 1000)]
        ],
        name="cpu",
    )
    path.write_text(json.dumps(fit.as_dict()))
    loaded = load_cost_model(path)
    assert loaded.name == "cpu"
    assert loaded.per_decode_seq_s == pytest.approx(2e-3)


def test_bad_cost_files_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(CostModelError, match="neither a known profile"):
        load_cost_model(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fixed_s": 0.01, "per_prefill_token_s": -1, "per_decode_seq_s": 0, "per_kv_token_s": 0}))
    with pytest.raises(CostModelError, match="per_prefill_token_s"):
        load_cost_model(bad)
    bad.write_text(json.dumps({"fixed_s": 0.01}))
    with pytest.raises(CostModelError, match="missing field"):
        load_cost_model(bad)


@pytest.mark.slow
def test_calibrate_fits_the_real_engine_and_simulate_can_load_it(tmp_path: Path) -> None:
    from batchpilot_runtime.cli.main import main

    out = tmp_path / "cpu.json"
    code = main(
        [
            "calibrate",
            "--preset",
            "tiny",
            "--threads",
            "1",
            "--batch-sizes",
            "1,2",
            "--prompt-lengths",
            "8,16",
            "--decode-steps",
            "2",
            "--repeats",
            "1",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["fit"]["samples"] >= 8
    model = load_cost_model(out)
    assert model.name == "tiny-cpu"
    assert model.kv_capacity_tokens == 65_536
    assert model.step_seconds(StepComposition(32, 4, 200)) > 0
    # The same fit, ready for a BatchProfile's spec.stepCosts.
    costs = report["stepCosts"]
    assert costs["fixedMs"] == pytest.approx(model.fixed_s * 1e3, abs=1e-3)
    assert costs["prefillUsPerToken"] == pytest.approx(model.per_prefill_token_s * 1e6, abs=1e-3)
    assert costs["source"] == "tiny-cpu"


def test_calibrate_reaches_every_context_and_batch_size_in_its_first_rounds() -> None:
    from batchpilot_runtime.cli.calibrate import scenario_order

    order = scenario_order([1, 2, 4, 8, 16, 32], [16, 64, 256, 1024], max_step_tokens=4096)
    # Every scenario that fits, once; a staggered variant only where there is a second request.
    expected = {(b, p, s) for b in (1, 2, 4, 8, 16, 32) for p in (16, 64, 256, 1024) for s in (False, True)
                if b * p <= 4096 and (b > 1 or not s)}  # fmt: skip
    assert sorted(order) == sorted(expected) and len(order) == len(expected)
    # The first round: one request of every prompt length; the second: the widest batch each allows.
    assert order[:4] == [(1, 16, False), (1, 64, False), (1, 256, False), (1, 1024, False)]
    assert [s[:2] for s in order[4:12:2]] == [(32, 16), (32, 64), (16, 256), (4, 1024)]
    assert scenario_order([1, 2], [4096], max_step_tokens=1024) == []


def test_calibrate_refuses_bad_flags_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    from batchpilot_runtime.cli.main import main

    assert main(["calibrate", "--batch-sizes", "0,2"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    assert main(["calibrate", "--max-step-tokens", "0"]) == 2
    assert "--max-step-tokens" in capsys.readouterr().err
