"""The kernel choice: the fast kernels by default on every device; batch invariance when the caller,
a ``--batch-invariant`` flag or ``BATCHPILOT_BATCH_INVARIANT`` asks for it (the flag wins)."""

from __future__ import annotations

import json

import pytest
import torch

from batchpilot_runtime.cli.main import build_parser, main
from batchpilot_runtime.cli.serve import config_from_args
from batchpilot_runtime.contract.window import Window
from batchpilot_runtime.engine.engine import Engine
from batchpilot_runtime.model.batch import ForwardBatch
from batchpilot_runtime.model.config import PRESETS
from batchpilot_runtime.model.kernels import BATCH_INVARIANT_ENV, resolve_batch_invariant
from batchpilot_runtime.model.kv_cache import PagedKVCache
from batchpilot_runtime.model.model import LlamaModel
from tests.support.torch_fixtures import Seq, one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(autouse=True)
def no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without the variable, whatever the shell running the tests has set."""
    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)


@pytest.mark.parametrize(
    ("requested", "value", "expected"),
    [
        (None, None, False),
        (None, "1", True),
        (None, "true", True),
        (None, " ON ", True),
        (None, "0", False),
        (None, "off", False),
        (None, "", False),
        (False, "1", False),
        (True, "0", True),
    ],
)
def test_the_caller_then_the_variable_then_off(requested: bool | None, value: str | None, expected: bool) -> None:
    environ = {} if value is None else {BATCH_INVARIANT_ENV: value}
    assert resolve_batch_invariant(requested, environ) is expected


def test_a_bad_value_of_the_variable_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=f"^{BATCH_INVARIANT_ENV}: .*got 'maybe'"):
        resolve_batch_invariant(None, {BATCH_INVARIANT_ENV: "maybe"})


def test_a_model_gets_the_fast_kernels_by_default() -> None:
    model = LlamaModel.random(PRESETS["tiny"], seed=1)
    assert model.batch_invariant is False
    # the fast path is one GEMM per linear layer (oneDNN on the CPU): no row padding, no tiling
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    torch.testing.assert_close(model._linear(x, weight), torch.nn.functional.linear(x, weight), rtol=0, atol=1e-6)
    kv = PagedKVCache(model.config, 4, 16, "cpu", torch.float32)
    logits = model(ForwardBatch.build([Seq((1, 2, 3), 0, (0,))], 16, "cpu"), kv)
    torch.testing.assert_close(logits[0], model.forward_dense(torch.tensor([1, 2, 3]))[-1], rtol=0, atol=1e-5)


def test_the_variable_switches_every_model_a_process_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert LlamaModel.random(PRESETS["tiny"], seed=1).batch_invariant is True
    engine = Engine.build(model_name="t", window=Window(target_batch_size=1, hard_cap=1, max_wait_ms=0))
    assert engine.model.batch_invariant is True
    assert LlamaModel.random(PRESETS["tiny"], seed=1, batch_invariant=False).batch_invariant is False


def test_engine_build_is_fast_by_default_and_invariant_on_request() -> None:
    window = Window(target_batch_size=1, hard_cap=1, max_wait_ms=0)
    assert Engine.build(model_name="t", window=window).model.batch_invariant is False
    assert Engine.build(model_name="t", window=window, batch_invariant=True).model.batch_invariant is True


def serve_config(*argv: str) -> bool:
    batch_invariant: bool = config_from_args(build_parser().parse_args(["serve", *argv])).batch_invariant
    return batch_invariant


def test_serve_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serve_config() is False
    assert serve_config("--batch-invariant") is True
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert serve_config() is True
    assert serve_config("--no-batch-invariant") is False  # the flag wins
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "maybe")
    with pytest.raises(ValueError, match=BATCH_INVARIANT_ENV):
        serve_config()


def test_serve_help_names_the_flag_and_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--batch-invariant" in help_text and f"{BATCH_INVARIANT_ENV}=1" in help_text


@pytest.mark.parametrize(
    ("argv", "value", "expected"),
    [([], None, False), (["--batch-invariant"], None, True), ([], "1", True), (["--no-batch-invariant"], "1", False)],
)
def test_generate_flag_and_variable(
    argv: list[str],
    value: str | None,
    expected: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if value is not None:
        monkeypatch.setenv(BATCH_INVARIANT_ENV, value)
    assert main(["generate", "hi", "--max-tokens", "2", "--json", *argv]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["batch_invariant"] is expected
