"""The ready file: how a launcher finds a runtime it started (light: no torch, no web stack)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class RuntimeInfo:
    """How to reach a running runtime; the content of its ready file (``--ready-file``)."""

    pid: int
    model: str
    serve_url: str
    admin_url: str
    admin_token_file: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RuntimeInfo:
        return cls(**json.loads(text))

    @classmethod
    def read(cls, path: Path) -> RuntimeInfo:
        return cls.from_json(path.read_text())

    def admin_token(self) -> str:
        return Path(self.admin_token_file).read_text().strip()


def write_ready_file(path: Path, info: RuntimeInfo) -> None:
    """Atomically (write then rename), so that a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(info.to_json())
    tmp.replace(path)
