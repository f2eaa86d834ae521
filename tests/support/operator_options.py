"""Run the kopf operator with any :class:`RunOptions` field, for tests that compress its timings.

``batchpilot-operator run`` exposes what a deployment tunes; the watch timeouts,
the peering check period and the stuck-loop limit are fixed there. A test that
needs ten watch checks in twenty seconds sets them here instead:

    python tests/support/operator_options.py '{"kubeconfig": "...", "watch_check_s": 2}'

The JSON object holds RunOptions fields by name; path fields take strings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from batchpilot_operator.frontends.kopf_app import OperatorApp, RunOptions

PATH_FIELDS = {f.name for f in dataclasses.fields(RunOptions) if "Path" in str(f.type)}


def options_from_json(text: str) -> RunOptions:
    fields: dict[str, Any] = json.loads(text)
    for name in PATH_FIELDS & fields.keys():
        if fields[name] is not None:
            fields[name] = Path(fields[name])
    return RunOptions(**fields)


def main() -> None:
    options = options_from_json(sys.argv[1])
    logging.basicConfig(
        level=logging.DEBUG if options.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(OperatorApp(options).run())


if __name__ == "__main__":
    main()
