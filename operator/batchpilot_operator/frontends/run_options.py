"""The options of ``batchpilot-operator run`` and their defaults, the one place they are written: the
command line's flags (cli/commands.py) default to :class:`RunOptions`'s fields, and the fields the control
loop shares default to its :data:`~batchpilot_operator.control.settings.DEFAULT_SETTINGS`. Standard library
only, so that the command line reads them without loading kopf."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchpilot_operator.control.settings import DEFAULT_SETTINGS


@dataclass
class RunOptions:
    """What one ``run`` is given; ``batchpilot-operator run``'s flags default to these."""

    kubeconfig: Path | None = None
    context: str | None = None
    namespaces: list[str] = field(default_factory=list)  # empty = all namespaces
    prometheus_url: str | None = None
    scrape_interval_s: float = DEFAULT_SETTINGS.scrape_interval_s
    query_timeout_s: float = 5.0
    admin_token_file: Path | None = None
    # Namespaces whose pods may receive the admin_token_file token. Empty: the watched namespaces, or, when
    # watching all namespaces, the operator's own (where a chart install keeps that token and its runtimes).
    admin_token_namespaces: list[str] = field(default_factory=list)
    pod_labels: dict[str, str] = field(default_factory=dict)
    metrics_port: int = 9090
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    peering: str = "auto"  # auto | off | required
    peering_name: str = "batchpilot"
    priority: int | None = None  # None: the start time, so that a newer replica takes over
    peering_lifetime_s: int = 60
    peering_check_s: float = 1.0
    tick_s: float = DEFAULT_SETTINGS.tick_s
    interval_override_s: float | None = DEFAULT_SETTINGS.interval_override_s
    push_timeout_s: float = 2.0
    push_retries: int = 3
    push_concurrency: int = 64
    resync_s: float = DEFAULT_SETTINGS.resync_s
    watch_server_timeout_s: int = 300
    watch_client_timeout_s: float = 330.0
    watch_inactivity_timeout_s: float = 70.0
    watch_check_s: float = 60.0
    stuck_after_s: float = DEFAULT_SETTINGS.stuck_after_s
    verbose: bool = False


DEFAULT_RUN_OPTIONS = RunOptions()
