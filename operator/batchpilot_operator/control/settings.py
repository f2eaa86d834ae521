"""The controller's settings and their defaults, the one place they are written: the command line's
flags (cli/commands.py) and kopf's :class:`~batchpilot_operator.frontends.run_options.RunOptions` take theirs
from :data:`DEFAULT_SETTINGS`. Standard library only, so that the command line reads them without loading
the controller."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """Operator settings. ``interval_override_s`` replaces every profile's intervalSeconds (tests use
    sub-5-second intervals through it; the resource itself allows 5 s at least)."""

    tick_s: float = 1.0
    interval_override_s: float | None = None
    scrape_interval_s: float = 15.0
    default_token: str | None = None
    # The namespaces whose pods may receive default_token (the operator's own, fleet-wide token); a pod
    # elsewhere gets only its profile's Secret, or no request. Empty: default_token goes to no pod.
    default_token_namespaces: frozenset[str] = frozenset()
    stuck_after_s: float = 120.0  # liveness fails when no tick finished for this long
    max_events_per_tick: int = 200  # a flood guard: 1,000 failing profiles must not DoS the API server
    # A pod known to run the window in force is read back at most this often (0: every interval). Restarts
    # are caught sooner anyway in kopf mode: a restarted pod turns Ready again and is pushed at once.
    resync_s: float = 0.0


DEFAULT_SETTINGS = Settings()
