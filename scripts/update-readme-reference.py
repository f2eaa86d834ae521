"""Rewrite the generated BatchProfile reference between its markers in README.md."""

from pathlib import Path

from batchpilot_operator.api.reference import BEGIN_MARKER, END_MARKER, render_reference

readme = Path(__file__).resolve().parents[1] / "README.md"
text = readme.read_text()
head, rest = text.split(BEGIN_MARKER, 1)
_, tail = rest.split(END_MARKER, 1)
readme.write_text(f"{head}{BEGIN_MARKER}\n{render_reference()}{END_MARKER}{tail}")
print(f"updated {readme}")
