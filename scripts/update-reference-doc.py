"""Rewrite the generated BatchProfile reference between its markers in docs/reference.md."""

from pathlib import Path

from batchpilot_operator.api.reference import BEGIN_MARKER, END_MARKER, render_reference

reference = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
text = reference.read_text()
head, rest = text.split(BEGIN_MARKER, 1)
_, tail = rest.split(END_MARKER, 1)
reference.write_text(f"{head}{BEGIN_MARKER}\n{render_reference()}{END_MARKER}{tail}")
print(f"updated {reference}")
