"""``spec.restart`` and ``status.restart``: the restart budget of engines that take a window only at start-up.

vLLM reads ``--max-num-seqs`` and ``--max-num-batched-tokens`` once, at start-up (and SGLang the settings its
server refuses through ``/set_internal_state``). Applying a window to them means patching the workload's
container args and letting it roll, which costs minutes of capacity and the prefix cache, so it happens
only in ``tuning.mode: restart`` and never more often than this budget allows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from batchpilot_operator.api.bounds import cel_rules
from batchpilot_runtime.contract.window import CamelModel

# DNS-1123 subdomain (a Deployment's or StatefulSet's name) and DNS-1123 label (a container's name).
WORKLOAD_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
CONTAINER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
HOUR_PATTERN = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"
MAX_RESTARTS_PER_DAY = 24


class WorkloadRef(CamelModel):
    """The workload whose pods the profile selects, in the profile's namespace, and the engine's container."""

    kind: Literal["Deployment", "StatefulSet"] = Field(description="Deployment or StatefulSet (apps/v1).")
    name: str = Field(min_length=1, max_length=253, pattern=WORKLOAD_NAME_PATTERN, description="Its name.")
    container: str = Field(
        min_length=1,
        max_length=63,
        pattern=CONTAINER_NAME_PATTERN,
        description="The container that runs the engine; its args get --max-num-seqs and --max-num-batched-tokens.",
    )


class HoursUTC(CamelModel):
    """Hours of the day (UTC) when a restart may start; ``end`` before ``start`` spans midnight."""

    model_config = cel_rules(("self.start != self.end", "restart.allowedHours: start and end must differ"))

    start: str = Field(pattern=HOUR_PATTERN, description="First minute allowed, HH:MM UTC.")
    end: str = Field(pattern=HOUR_PATTERN, description="First minute no longer allowed, HH:MM UTC.")

    @model_validator(mode="after")
    def _not_empty(self) -> HoursUTC:
        if self.start == self.end:
            raise ValueError(
                f"start and end must differ (both {self.start}); leave allowedHours out to allow every hour"
            )
        return self

    def minutes(self) -> tuple[int, int]:
        """(start, end) as minutes past midnight UTC."""
        return _minutes(self.start), _minutes(self.end)


def _minutes(text: str) -> int:
    hours, minutes = text.split(":")
    return int(hours) * 60 + int(minutes)


class RestartBudget(CamelModel):
    """When the operator may restart the workload with a new window: how often, how far apart, at what
    hours, and what change is worth it."""

    workload: WorkloadRef = Field(description="The workload to patch and roll.")
    max_per_day: int = Field(
        default=2, ge=1, le=MAX_RESTARTS_PER_DAY, description="Most restarts in any 24 hours (rolling)."
    )
    min_interval_seconds: int = Field(
        default=3600, ge=300, le=86400, description="Least time between two restarts, seconds."
    )
    allowed_hours: HoursUTC | None = Field(
        default=None, description="Hours of the day (UTC) a restart may start in; unset: any hour."
    )
    min_change: float = Field(
        default=0.25,
        ge=0.05,
        le=1.0,
        description=(
            "Least relative change of --max-num-seqs or --max-num-batched-tokens worth a restart "
            "(0.25: 25 %); smaller recommendations stay recommendations."
        ),
    )
    stable_intervals: int = Field(
        default=3,
        ge=1,
        le=100,
        description=(
            "Intervals in a row the recommendation must stay that far from what the workload runs before "
            "a restart; one is enough while the SLO is broken."
        ),
    )


class RestartStatus(CamelModel):
    """What the restart path did: the args it wrote, when, and when the budget next allows a restart."""

    workload: str | None = Field(default=None, description="Kind/name of the workload patched.")
    applied_args: dict[str, int] | None = Field(default=None, description="The flags last written to its args.")
    last_at: str | None = Field(default=None, description="When the operator last restarted it (RFC 3339).")
    count24h: int = Field(
        default=0, ge=0, alias="count24h", description="Restarts by the operator in the last 24 hours."
    )
    next_allowed_at: str | None = Field(default=None, description="Earliest time the budget allows the next one.")
    history: list[str] = Field(
        default_factory=list,
        max_length=MAX_RESTARTS_PER_DAY,
        description="Times of the restarts of the last 24 hours, kept so that a new operator keeps the budget.",
    )
    reverted_at: str | None = Field(
        default=None, description="When the workload's args were found without the applied flags (a GitOps sync)."
    )
    previous_args: dict[str, int] | None = Field(
        default=None,
        description="While the last restart is judged: the flags before it, which a rollback would restore.",
    )
    message: str | None = Field(default=None, description="The restart path's last word: why it waits or acted.")
