"""Bodies of the runtime's admin API (``GET``/``PUT /admin/window``).

The operator builds the request and parses the response with these very models.
No torch, no web framework here.
"""

from __future__ import annotations

from pydantic import Field

from batchpilot_runtime.contract.window import CamelModel, Window

ADMIN_WINDOW_PATH = "/admin/window"
LANE_HEADER = "X-Batchpilot-Lane"
# The lane of the main window: every request not sent to a named lane waits here.
DEFAULT_LANE = "default"
# One pair of default ports for ``serve``, the BatchProfile's spec.runtime, the chart and the image, so that
# a runtime started on its defaults is where a profile on its defaults looks (a test compares all four).
DEFAULT_SERVE_PORT = 8080
DEFAULT_ADMIN_PORT = 8081


class LaneWindow(CamelModel):
    """The window of one named priority lane, as the runtime holds it."""

    name: str = Field(description="Lane name, e.g. 'critical'.")
    window: Window
    reserved_slots: int = Field(ge=0, description="Running slots held back for this lane.")


class PodCapacity(CamelModel):
    """What the pod can hold: the ceiling any window pushed to it must respect."""

    kv_cache_tokens: int = Field(ge=0, description="KV-cache capacity in tokens.")
    kv_block_size: int = Field(ge=1, description="Tokens per KV-cache block.")
    max_hard_cap: int = Field(ge=1, description="Largest hardCap the pod accepts.")
    max_model_len: int = Field(ge=1, description="Longest sequence (prompt + output) the pod serves.")


class WindowState(CamelModel):
    """Answer of ``GET /admin/window`` and of a successful ``PUT``."""

    model: str = Field(description="Model name, as in the metrics' model label.")
    window: Window
    lanes: list[LaneWindow] = Field(default_factory=list)
    capacity: PodCapacity
    batching: str = Field(description="'continuous' or 'static'.")
    default_prefill_tokens: int | None = Field(
        default=None,
        description=(
            "The pod's start-up prompt-token budget per step, in force while window.maxPrefillTokens is "
            "unset (none = whole prompts)."
        ),
    )

    @property
    def prefill_budget_tokens(self) -> int | None:
        """Prompt tokens one step may prefill under this state; ``None``: whole prompts."""
        return self.window.max_prefill_tokens or self.default_prefill_tokens


class WindowUpdate(CamelModel):
    """Body of ``PUT /admin/window``: the new default-lane window (with its generation)
    and, optionally, new windows for named lanes."""

    window: Window
    lanes: list[LaneWindow] | None = None


class AdminError(CamelModel):
    """Body of a refused admin call (401, 409, 422)."""

    error: str
    detail: str
    window_in_force: Window | None = None


class StaleGenerationError(Exception):
    """A window update whose generation is older than the one in force (HTTP 409)."""

    def __init__(self, offered: Window, in_force: Window) -> None:
        if offered.generation < in_force.generation:
            why = f"generation {offered.generation} is older than the generation in force ({in_force.generation})"
        else:
            why = f"generation {offered.generation} is already in force with a different window ({in_force.describe()})"
        super().__init__(why)
        self.offered = offered
        self.window_in_force = in_force


class InvalidWindowError(ValueError):
    """A window the pod cannot apply (HTTP 422); the message gives the reason and names the field."""


def is_resend(offered: Window, in_force: Window, same_lanes: bool) -> bool:
    """The generation rule of ``PUT /admin/window``, shared by the runtime and the gate: True when the
    update re-sends what is in force (accepted, nothing changes: pushes are level-triggered), False
    when its generation is newer (to be checked and applied). ``StaleGenerationError`` for an older
    generation, or the same generation with other values (``same_lanes``: its lanes equal those in force)."""
    if offered.generation < in_force.generation:
        raise StaleGenerationError(offered, in_force)
    if offered.generation == in_force.generation:
        if offered.fields_equal(in_force) and same_lanes:
            return True
        raise StaleGenerationError(offered, in_force)
    return False
