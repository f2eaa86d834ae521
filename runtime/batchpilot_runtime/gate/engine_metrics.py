"""The engine's own metrics, passed on by the gate (``--engine-metrics PATH``).

llama-server's ``llamacpp:*`` series carry no labels and it listens on the pod's loopback behind the
gate, so neither Prometheus nor the operator can tell them apart or reach them. With the flag, the
gate's ``/metrics`` ends with the engine's exposition, each series labelled ``model`` with the gate's
model name unless it has one: one scrape of the gate reads both, and the engine has one scraper
(llama-server resets two of its gauges on every scrape, so a second scraper would corrupt them).
"""

from __future__ import annotations

import re

# A sample's label set already naming the model (vLLM's and SGLang's carry model_name, not model).
_HAS_MODEL = re.compile(rb"[{,]\s*model\s*=")


def _escaped(value: str) -> bytes:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").encode()


def with_model_label(exposition: bytes, model: str) -> bytes:
    """``exposition`` (Prometheus text format) with ``model="<model>"`` on every sample that has no
    ``model`` label; comment lines kept as they are."""
    label = b'model="' + _escaped(model) + b'"'
    lines = []
    for line in exposition.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(b"#"):
            lines.append(line)
            continue
        name_end = next((i for i, byte in enumerate(line) if byte in b"{ \t"), len(line))
        if name_end < len(line) and line[name_end : name_end + 1] == b"{":
            labels_end = line.rfind(b"}")
            if _HAS_MODEL.search(line[name_end:labels_end]):
                lines.append(line)
            elif line[name_end + 1 : name_end + 2] == b"}":
                lines.append(line[: name_end + 1] + label + line[name_end + 1 :])
            else:
                lines.append(line[: name_end + 1] + label + b"," + line[name_end + 1 :])
        else:
            lines.append(line[:name_end] + b"{" + label + b"}" + line[name_end:])
    return b"\n".join(lines) + b"\n" if lines else b""
