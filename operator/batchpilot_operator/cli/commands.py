"""``batchpilot-operator run`` and ``batchpilot-operator local`` (their modules load only when run).

Each of their flags can also be set as ``BATCHPILOT_<FLAG>`` (see :mod:`batchpilot_operator.cli.env`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

from batchpilot_operator.control.settings import DEFAULT_SETTINGS
from batchpilot_operator.frontends.run_options import DEFAULT_RUN_OPTIONS as RUN


def register(subparsers: Any) -> None:
    _register_run(subparsers)
    _register_local(subparsers)


def _register_local(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "local",
        help="run the operator without a cluster: profiles from files, runtimes from the command line",
    )
    parser.add_argument("--profiles", type=Path, required=True, metavar="PATH",
                        help="a BatchProfile YAML file or a folder of them")  # fmt: skip
    parser.add_argument(
        "--runtime",
        action="append",
        default=[],
        metavar="model=NAME,url=SERVE_URL,admin=ADMIN_URL,token-file=PATH,engine=KIND",
        help="one runtime pod (repeatable); its /metrics is scraped when --prometheus-url is not given",
    )
    parser.add_argument("--prometheus-url", help="read metrics from this Prometheus instead of scraping")
    parser.add_argument("--scrape-interval", type=float, default=DEFAULT_SETTINGS.scrape_interval_s,
                        help="Prometheus scrape interval, s")  # fmt: skip
    parser.add_argument("--interval", type=float, help="replace every profile's intervalSeconds, s")
    parser.add_argument("--push-timeout", type=float, default=2.0,
                        help="deadline of one admin call, the whole answer included, s")  # fmt: skip
    parser.add_argument("--query-timeout", type=float, default=3.0,
                        help="deadline of one metrics round (the Prometheus queries, or one /metrics scrape), s")  # fmt: skip
    parser.add_argument("--duration", type=float, help="stop after this many seconds (default: until Ctrl-C)")
    parser.add_argument("--status-file", type=Path,
                        help="keep every profile's status here (JSON), written after each tick; read back at "
                        "start, so that a restart resumes each window, cooldown and canary")  # fmt: skip
    parser.add_argument("--metrics-port", type=int, default=0, help="serve the operator's /metrics here (0: off)")
    parser.add_argument("--output", choices=("text", "json"), default="text",
                        help="decisions as text lines, or one JSON object per line (for programs)")  # fmt: skip
    parser.set_defaults(handler=_cmd_local)
    parser.defaults_from_environment()


def _cmd_local(args: argparse.Namespace) -> int:
    from batchpilot_operator.frontends.local import cmd_local

    return cmd_local(args)


def _register_run(subparsers: Any) -> None:
    parser = subparsers.add_parser("run", help="run the operator against a Kubernetes cluster (kopf)")
    parser.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    parser.add_argument("--context", help="kubeconfig context")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    parser.add_argument("--prometheus-url", help="Prometheus base URL the observations are queried from")
    parser.add_argument("--scrape-interval", type=float, default=RUN.scrape_interval_s,
                        help="Prometheus scrape interval, s")  # fmt: skip
    parser.add_argument(
        "--query-timeout", type=float, default=RUN.query_timeout_s, help="timeout of one query round, s"
    )
    parser.add_argument("--admin-token-file", type=Path, help="bearer token for the runtimes' admin API")
    parser.add_argument("--admin-token-namespace", action="append", default=[], metavar="NAMESPACE",
                        help="send the --admin-token-file token only to pods of this namespace (repeatable; default: "
                             "the --namespace list, or with -A the operator's own namespace); pods elsewhere need "
                             "their profile's spec.runtime.adminTokenSecret")  # fmt: skip
    parser.add_argument("--pod-label", action="append", default=[], metavar="KEY=VALUE",
                        help="only index pods with this label (repeatable)")  # fmt: skip
    parser.add_argument("--metrics-port", type=int, default=RUN.metrics_port,
                        help="port of the operator's /metrics (0: off)")  # fmt: skip
    parser.add_argument("--liveness", default=RUN.liveness, help="kopf liveness endpoint URL")
    parser.add_argument("--peering", choices=("auto", "off", "required"), default=RUN.peering)
    parser.add_argument("--peering-name", default=RUN.peering_name)
    parser.add_argument("--priority", type=int, help="peering priority (default: start time; the newest wins)")
    parser.add_argument("--peering-lifetime", type=int, default=RUN.peering_lifetime_s,
                        help="seconds a silent peer counts as alive")  # fmt: skip
    parser.add_argument("--tick", type=float, default=RUN.tick_s, help="seconds between two loop wake-ups")
    parser.add_argument("--interval-override", type=float,
                        help="replace every profile's intervalSeconds, s (tests; the resource allows >= 5)")  # fmt: skip
    parser.add_argument("--watch-check", type=float, default=RUN.watch_check_s,
                        help="seconds between two watch-health checks")  # fmt: skip
    parser.add_argument("--push-timeout", type=float, default=RUN.push_timeout_s,
                        help="deadline of one admin call, the whole answer included, s")  # fmt: skip
    parser.add_argument("--resync", type=float, default=RUN.resync_s,
                        help="least seconds between two read-backs of a pod known to be in sync (0: every interval, "
                             "fully level-triggered; raise it to cut admin calls at thousands of pods)")  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.set_defaults(handler=_cmd_run)
    parser.defaults_from_environment()


def _labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--pod-label must be KEY=VALUE, got {item!r}")
        labels[key] = value
    return labels


def _cmd_run(args: argparse.Namespace) -> int:
    from batchpilot_operator.frontends.kopf_app import OperatorApp
    from batchpilot_operator.frontends.run_options import RunOptions

    options = RunOptions(
        kubeconfig=args.kubeconfig,
        context=args.context,
        namespaces=list(args.namespace),
        prometheus_url=args.prometheus_url,
        scrape_interval_s=args.scrape_interval,
        query_timeout_s=args.query_timeout,
        admin_token_file=args.admin_token_file,
        admin_token_namespaces=list(args.admin_token_namespace),
        pod_labels=_labels(args.pod_label),
        metrics_port=args.metrics_port,
        liveness=args.liveness or None,
        peering=args.peering,
        peering_name=args.peering_name,
        priority=args.priority,
        peering_lifetime_s=args.peering_lifetime,
        tick_s=args.tick,
        interval_override_s=args.interval_override,
        watch_check_s=args.watch_check,
        push_timeout_s=args.push_timeout,
        resync_s=args.resync,
        verbose=args.verbose,
    )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    app = OperatorApp(options)
    asyncio.run(app.run())
    return 0
