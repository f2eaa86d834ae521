"""Read the operator's decisions from what ``batchpilot-operator local`` prints.

Local mode prints one line per decision (see ``batchpilot_operator.frontends.local.print_decision``); the
demo runs it with ``--output json``, one JSON object per line with the keys ``model``,
``direction``, ``reason`` and ``window`` (the window's wire form). The text form is read too::

    HH:MM:SS NAMESPACE/NAME model=MODEL mode=MODE DIRECTION: WINDOW - REASON

with WINDOW in :meth:`Window.describe`'s form (``... budget=N gen=G`` when the window sets a
prompt-token budget per step, which is read into :attr:`ParsedDecision.budget`). Every other line (start-up messages, events
such as push failures) is not a decision.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import ValidationError

from batchpilot_runtime.contract.window import Window

DIRECTIONS = ("up", "down", "hold", "reset", "recommend")
_LINE = re.compile(
    r"^\S+ (?P<profile>\S+) model=(?P<model>\S+) mode=(?P<mode>\S+) "
    r"(?P<direction>" + "|".join(DIRECTIONS) + r"): (?P<window>.*?) - (?P<reason>.*)$"
)
_BUDGET = re.compile(r"(?:^|\s)budget=(?P<budget>\d+)(?:\s|$)")


@dataclass(frozen=True)
class ParsedDecision:
    model: str
    direction: str
    reason: str
    window: str | None
    budget: int | None = None  # the window's maxPrefillTokens (None: none set, whole prompts)


def budget_of(window: str | None) -> int | None:
    """The ``budget=N`` of a window described by :meth:`Window.describe`, or None."""
    match = _BUDGET.search(window or "")
    return int(match.group("budget")) if match else None


def _from_json(line: str, models: set[str]) -> ParsedDecision | None:
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    direction, model = data.get("direction"), data.get("model")
    if direction not in DIRECTIONS or model not in models:
        return None
    window = data.get("window")
    if isinstance(window, dict):
        window = _describe(window)
    text = str(window) if window else None
    return ParsedDecision(str(model), str(direction), str(data.get("reason", "")), text, budget_of(text))


def _describe(fields: dict[str, object]) -> str:
    """A window's wire form described as the text form describes it (``Window.describe``), so
    the report reads one way; fields that are not a valid window are listed as they are."""
    try:
        return Window.model_validate(fields).describe()
    except ValidationError:
        return " ".join(f"{k}={v}" for k, v in fields.items())


def parse_decision_line(line: str, models: Iterable[str]) -> ParsedDecision | None:
    """The decision in one line of local mode's output about one of ``models``, or None."""
    text = line.strip()
    known = set(models)
    if text.startswith("{"):
        return _from_json(text, known)
    match = _LINE.match(text)
    if match is None or match.group("model") not in known:
        return None
    window = match.group("window").strip()
    return ParsedDecision(
        match.group("model"), match.group("direction"), match.group("reason").strip(), window, budget_of(window)
    )
