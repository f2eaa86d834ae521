"""``batchpilot-operator local`` with engine= in --runtime: parsing, the check against the profiles'
spec.engine, and the decision lines in each engine's own settings."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from batchpilot_operator.api.manifests import load_profiles
from batchpilot_operator.control.engine_knobs import describe_settings, engine_settings
from batchpilot_operator.control.records import ProfileRecord, ProfileRef
from batchpilot_operator.frontends.local import _check_engines, parse_runtime, print_decision
from batchpilot_operator.tuning import policy as policy_mod
from batchpilot_runtime.contract.window import Window
from tests.support.factories import make_manifest, make_spec, make_spec_dict

WINDOW = Window(target_batch_size=16, hard_cap=64, max_wait_ms=0, max_prefill_tokens=1024, generation=3)


def test_engine_is_batchpilot_by_default_and_needs_admin_only_there() -> None:
    assert parse_runtime("model=m,url=http://h:1,admin=http://h:2").engine == "batchpilot"
    with pytest.raises(ValueError, match="admin= is required"):
        parse_runtime("model=m,url=http://h:1")
    vllm = parse_runtime("model=m,engine=vllm,url=http://h:8000")
    assert (vllm.engine, vllm.admin) == ("vllm", "")
    sglang = parse_runtime("model=m,engine=sglang,url=http://h:30000/")
    assert (sglang.engine, sglang.admin) == ("sglang", "http://h:30000")  # /set_internal_state is on the serving port


def test_an_unknown_engine_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown engine 'tgi' \(known: batchpilot, vllm, sglang, llamacpp\)"):
        parse_runtime("model=m,engine=tgi,url=http://h:1")


def test_a_runtime_whose_engine_is_not_its_profiles_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(make_manifest(make_spec_dict("m", engine="vllm", tuning=None), name="p")))
    loaded = load_profiles(path)
    _check_engines(loaded, [parse_runtime("model=m,engine=vllm,url=http://h:1")])
    with pytest.raises(ValueError, match=r"has engine=batchpilot, but profile default/p names spec\.engine vllm"):
        _check_engines(loaded, [parse_runtime("model=m,url=http://h:1,admin=http://h:2")])


def test_each_engine_spells_the_window_in_its_own_settings() -> None:
    assert engine_settings("vllm", WINDOW) == {"--max-num-seqs": 64, "--max-num-batched-tokens": 1024}
    assert engine_settings("sglang", WINDOW) == {"max_running_requests": 64, "chunked_prefill_size": 1024}
    assert engine_settings("batchpilot", WINDOW) == {}
    no_budget = WINDOW.model_copy(update={"max_prefill_tokens": None})
    assert engine_settings("vllm", no_budget) == {"--max-num-seqs": 64}
    assert describe_settings(engine_settings("vllm", WINDOW)) == "--max-num-seqs 64 --max-num-batched-tokens 1024"


@pytest.mark.parametrize("output", ["json", "text"])
def test_a_vllm_recommendation_is_printed_with_its_flags(output: str) -> None:
    spec = make_spec("m", engine="vllm", tuning=None)
    record = ProfileRecord(ref=ProfileRef("local", "p"), generation=1, spec=spec, error=None)
    out = io.StringIO()
    decision = policy_mod.Decision(WINDOW, "down", "P99 over the SLO.", policy_mod.PolicyState())
    print_decision(out, output)(record, decision)
    text = out.getvalue()
    if output == "json":
        line = json.loads(text)
        assert (line["engine"], line["mode"], line["direction"]) == ("vllm", "recommend", "recommend")
        assert line["engineSettings"] == {"--max-num-seqs": 64, "--max-num-batched-tokens": 1024}
        assert line["window"]["hardCap"] == 64
    else:
        assert "mode=recommend recommend:" in text
        assert "(vllm: --max-num-seqs 64 --max-num-batched-tokens 1024)" in text
