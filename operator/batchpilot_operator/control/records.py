"""The values the controller keeps: profile and pod records, the tick's report, and the protocols of its
metric source and sink (its settings are in :mod:`batchpilot_operator.control.settings`). No behaviour
beyond small derived properties and reading a window back from status."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from batchpilot_operator.api.canary import CanaryStatus
from batchpilot_operator.api.kinds import EngineKind
from batchpilot_operator.api.profile import BatchProfileSpec, format_validation_error
from batchpilot_operator.api.status import Decision
from batchpilot_operator.control.conditions import PENDING_METRICS, PodFailure
from batchpilot_operator.control.status import ConditionFact
from batchpilot_operator.tuning import policy as policy_mod
from batchpilot_operator.tuning.canary import CanaryRun
from batchpilot_operator.tuning.model_metrics import ModelKey, ModelMetrics
from batchpilot_operator.tuning.observations import Observations
from batchpilot_runtime.contract.admin_api import LaneWindow, WindowState
from batchpilot_runtime.contract.window import Window


class MetricsSource(Protocol):
    async def collect(
        self, targets: Mapping[ModelKey, Sequence[str]], engines: Collection[str] = (EngineKind.BATCHPILOT,)
    ) -> dict[ModelKey, ModelMetrics]:
        """Every target's metrics; ``engines``: the engine kinds (spec.engine) of the profiles collected for."""
        ...


@dataclass(frozen=True)
class ProfileRef:
    namespace: str
    name: str
    uid: str | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class Sink(Protocol):
    """Where status, events and decisions go: the Kubernetes API, or local mode's printer."""

    async def patch_status(self, ref: ProfileRef, patch: Mapping[str, Any]) -> None: ...

    async def event(self, ref: ProfileRef, type_: str, reason: str, message: str) -> None: ...

    async def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        """One key of a Secret that opts in as an admin token (label :data:`ADMIN_TOKEN_LABEL` = "true"); None
        when it has no such key; :class:`SecretNotOptedIn` when it lacks the label."""
        ...


@dataclass(frozen=True)
class PodRecord:
    """A runtime pod as the controller needs it. Local mode fills the URLs and model directly."""

    namespace: str
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    ip: str | None = None
    ready: bool = False
    admin_url: str | None = None
    metrics_url: str | None = None
    engine_metrics_url: str | None = None  # an engine behind the gate (llama-server): its own /metrics
    model: str | None = None
    token: str | None = None
    uid: str | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class LoopState:
    """What the loop keeps of a profile between ticks. Every window put in force here is numbered in
    control/plan.py; ``push_pending`` is set by :meth:`Controller.upsert_profile` and cleared once the
    profile's sync ran (``Controller._sync_profile_isolated``)."""

    window: Window | None = None  # the window in force: pushed, or to be pushed
    last_slot: int | None = None  # the interval slot, floor(tick start / interval), last evaluated
    push_pending: bool = True  # push on the next tick, due or not: a new profile or a new spec
    # The generation of the window read back from status when the profile was adopted (an earlier operator
    # put it in force): a pod not seen yet is read before it is written, since it most likely holds it.
    adopted_generation: int | None = None


@dataclass
class PodSync:
    """What the syncer knows of the profile's pods (each keyed by pod key) and how its last sync ended."""

    pod_states: dict[str, WindowState] = field(default_factory=dict)  # what each pod answered last
    pod_errors: dict[str, PodFailure] = field(default_factory=dict)  # why each failing pod failed
    refused: dict[str, int] = field(default_factory=dict)  # generation refused: not pushed again until it changes
    clamped: dict[str, str] = field(default_factory=dict)  # how each pod clamped the window it was sent
    verified_s: dict[str, float] = field(default_factory=dict)  # when each pod was last read back (monotonic)
    # Engines without a window (SGLang): the generation whose settings each pod was last found holding.
    applied: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # what the last sync of this profile raised (a bug), None when it ran through

    def forget(self, pod: str) -> None:
        """Drop all that is known of pod ``pod`` (a pod key): it went away, or it became Ready again (a
        restart, a new IP), so what it ran, refused, failed with or clamped is no longer known; its next
        push finds out again."""
        for per_pod in (self.pod_states, self.pod_errors, self.refused, self.clamped, self.verified_s, self.applied):
            per_pod.pop(pod, None)


@dataclass
class DecisionMemory:
    """What the profile's evaluations observed and decided: the policy's memory, and what status and
    Events report of it."""

    policy_state: policy_mod.PolicyState = field(default_factory=policy_mod.PolicyState)
    observations: Observations | None = None
    metrics_fact: ConditionFact = PENDING_METRICS
    last_decision: Decision | None = None  # as status shows it: a repeated hold keeps its first time
    last_reason: str | None = None  # one Event per new reason: a hold that repeats it posts none
    recommended: Window | None = None  # recommend mode: the window the policy would put in force
    friendliness: Any = None  # batchFriendliness auto: the measured class and curve, for status
    evaluations: int = 0


@dataclass
class CanaryBook:
    """The canary loop's (control/canary.py) memory of a profile: the run in progress, the last outcome as
    status.canary shows it, and a window rolled back, which is not tried again before ``rejected_until_s``.
    ``restart_unreported``: ``last`` is a canary an earlier operator left running, ended on adoption, whose
    Event the next decision posts."""

    run: CanaryRun | None = None
    last: CanaryStatus | None = None
    restart_unreported: bool = False
    rejected: Window | None = None
    rejected_until_s: float = 0.0


@dataclass
class StatusBook:
    """The profile's status as last written (a patch is the difference from it), and the spec generation
    whose InvalidSpec Event was posted."""

    written: dict[str, Any] = field(default_factory=dict)
    invalid_reported_generation: int | None = None


@dataclass
class PodsCache:
    """The registry's sorted list of the profile's pods, and the (pods version, spec id) it was built for."""

    key: tuple[int, int] | None = None
    pods: list[PodRecord] = field(default_factory=list)


@dataclass
class ProfileRecord:
    """A BatchProfile as the controller keeps it: what the API says (ref, generation, spec or its error)
    and, grouped by who writes them, the loop's state, the pods' sync, the decisions' memory, the status
    written, and the registry's pod cache."""

    ref: ProfileRef
    generation: int | None
    spec: BatchProfileSpec | None
    error: str | None
    loop: LoopState = field(default_factory=LoopState)
    sync: PodSync = field(default_factory=PodSync)
    memory: DecisionMemory = field(default_factory=DecisionMemory)
    status: StatusBook = field(default_factory=StatusBook)
    pods_cache: PodsCache = field(default_factory=PodsCache)
    canary: CanaryBook = field(default_factory=CanaryBook)

    @property
    def model(self) -> str | None:
        return self.spec.model if self.spec else None


@dataclass
class TickReport:
    evaluated: int = 0
    changed: int = 0
    queries: int = 0
    pushes: int = 0
    push_failures: int = 0
    status_patches: int = 0
    status_failures: int = 0
    seconds: float = 0.0
    metrics_error: str | None = None


def lanes_of(spec: BatchProfileSpec, generation: int) -> list[LaneWindow] | None:
    if not spec.lanes:
        return None
    return [
        LaneWindow(
            name=lane.name, window=Window.from_fields(lane.window, generation), reserved_slots=lane.reserved_slots
        )
        for lane in spec.lanes
    ]


@dataclass(frozen=True)
class StatusWindow:
    """status.window as an earlier operator wrote it: the window, or None with ``problem`` saying why one
    that is there cannot be used (None when status has no window at all)."""

    window: Window | None
    problem: str | None = None


def read_status_window(status: Mapping[str, Any] | None) -> StatusWindow:
    """status.window, validated; a window that does not validate is dropped, and ``problem`` names what
    was wrong with it, field by field."""
    written = status.get("window") if status else None
    if written is None:
        return StatusWindow(None)
    if not isinstance(written, Mapping):
        return StatusWindow(None, f"status.window is a {type(written).__name__}, not an object")
    try:
        return StatusWindow(Window.model_validate({k: v for k, v in written.items() if k != "appliedAt"}))
    except ValidationError as error:
        return StatusWindow(None, format_validation_error(error, "status.window"))
    except Exception as error:  # whatever else a hand-edited status holds must not stop the adoption
        return StatusWindow(None, f"status.window: {type(error).__name__}: {error}")


def window_from_status(status: Mapping[str, Any] | None) -> Window | None:
    """status.window, None when there is none or it does not validate (:func:`read_status_window` says why)."""
    return read_status_window(status).window
