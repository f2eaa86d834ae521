from pathlib import Path

from batchpilot_operator.api.reference import BEGIN_MARKER, END_MARKER, render_reference

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def test_the_reference_page_embeds_the_generated_reference() -> None:
    text = REFERENCE.read_text()
    assert BEGIN_MARKER in text and END_MARKER in text, "docs/reference.md lacks the reference markers"
    embedded = text.split(BEGIN_MARKER, 1)[1].split(END_MARKER, 1)[0].strip("\n")
    assert embedded == render_reference().strip("\n"), "docs/reference.md is stale: run `make docs`"


def test_reference_names_every_window_field() -> None:
    text = render_reference()
    for field in ("targetBatchSize", "hardCap", "maxWaitMs", "tailMarkRatio", "p99Ms", "cooldownSeconds"):
        assert f"spec.window.{field}" in text or field in text
