"""``serve --dtype``: the dtype the model runs in, from the flag or BATCHPILOT_DTYPE, refused by name
when unknown; a bfloat16 engine on CPU generates the fp32 engine's greedy tokens on a small model."""

from __future__ import annotations

import pytest
import torch

from batchpilot_runtime.cli.main import build_parser
from batchpilot_runtime.cli.serve import config_from_args
from batchpilot_runtime.engine.engine import Engine
from batchpilot_runtime.engine.types import GenerationRequest
from batchpilot_runtime.model.device import pick_device
from tests.support.factories import make_window


def test_the_dtype_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_args(build_parser().parse_args(["serve"])).dtype is None
    assert config_from_args(build_parser().parse_args(["serve", "--dtype", "bfloat16"])).dtype == "bfloat16"
    monkeypatch.setenv("BATCHPILOT_DTYPE", "float16")
    assert config_from_args(build_parser().parse_args(["serve"])).dtype == "float16"
    assert config_from_args(build_parser().parse_args(["serve", "--dtype", "float32"])).dtype == "float32"


@pytest.mark.parametrize("where", ["flag", "environment"])
def test_an_unknown_dtype_is_refused_naming_the_choices(
    where: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--dtype", "fp8"] if where == "flag" else ["serve"]
    if where == "environment":
        monkeypatch.setenv("BATCHPILOT_DTYPE", "fp8")
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "--dtype: must be one of float32, bfloat16, float16, got 'fp8'" in capsys.readouterr().err


def test_cpu_runs_float32_unless_asked() -> None:
    assert pick_device("cpu") == (torch.device("cpu"), torch.float32)
    assert pick_device("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)


def _greedy(dtype: str) -> list[list[int]]:
    engine = Engine.build(
        model_name="m", window=make_window(), preset="tiny", device="cpu", dtype=dtype, kv_cache_tokens=512
    )
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [42] * 12]
    for index, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(str(index), prompt, max_tokens=6))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for event in engine.step():
            if event.token_id is not None:
                tokens[event.request_id].append(event.token_id)
    assert engine.model.dtype == getattr(torch, dtype)
    return [tokens[str(i)] for i in range(len(prompts))]


def test_a_bfloat16_engine_on_cpu_serves_whole_answers() -> None:
    answers = _greedy("bfloat16")
    assert [len(a) for a in answers] == [6, 6, 6]
    # bf16 rounding may flip a near tie, so only the first token of each answer is compared with fp32.
    assert [a[0] for a in answers] == [a[0] for a in _greedy("float32")]
