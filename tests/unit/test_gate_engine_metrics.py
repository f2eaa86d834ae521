"""The engine's exposition as the gate passes it on (``--engine-metrics``): every sample labelled with
the model unless it names one, everything else as it came."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_runtime.gate.engine_metrics import with_model_label

# As llama-server writes it (tools/server/server-task.cpp, llama-cpp-python 0.3.36): no labels at all.
LLAMA_SERVER = b"""# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6621
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
"""


def test_llama_servers_series_get_the_model_and_nothing_else_changes() -> None:
    labelled = with_model_label(LLAMA_SERVER, "smollm2")
    assert labelled == LLAMA_SERVER.replace(b"_total 6621", b'_total{model="smollm2"} 6621').replace(
        b"processing 2", b'processing{model="smollm2"} 2'
    )
    samples = {s.name: s for f in text_string_to_metric_families(labelled.decode()) for s in f.samples}
    assert samples["llamacpp:requests_processing"].labels == {"model": "smollm2"}
    assert samples["llamacpp:requests_processing"].value == 2.0


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'm{a="1"} 3', b'm{model="x",a="1"} 3'),
        (b"m{} 3", b'm{model="x"} 3'),
        (b'm{a="1",model="y"} 3', b'm{a="1",model="y"} 3'),  # a model already named is kept
        (b'm{model="y"} 3 1700000000000', b'm{model="y"} 3 1700000000000'),
        (b"m 3 1700000000000", b'm{model="x"} 3 1700000000000'),
        (b'm{path="/a}b"} 3', b'm{model="x",path="/a}b"} 3'),
    ],
)
def test_each_kind_of_sample_line(line: bytes, expected: bytes) -> None:
    assert with_model_label(line, "x") == expected + b"\n"


def test_a_model_name_is_escaped_as_a_label_value() -> None:
    labelled = with_model_label(b"m 1\n", 'we"ird\\name')
    assert labelled == b'm{model="we\\"ird\\\\name"} 1\n'
    (sample,) = next(iter(text_string_to_metric_families(labelled.decode()))).samples
    assert sample.labels == {"model": 'we"ird\\name'}


def test_nothing_in_nothing_out() -> None:
    assert with_model_label(b"", "x") == b""
