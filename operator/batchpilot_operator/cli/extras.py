"""Features that need an optional extra, and the clear error when it is not installed.

The operator image installs only the ``operator`` extra; plots and the demo's report need
``report`` (matplotlib) and the demo's runtimes need ``runtime`` (torch).
"""

from __future__ import annotations

import importlib.util


class MissingExtraError(ValueError):
    """A feature was asked for whose optional dependencies are not installed."""


def require_extra(module: str, extra: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` naming the extra to install when ``module`` is missing."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses the name, or a broken parent package
        found = False
    if not found:
        raise MissingExtraError(
            f"{feature} needs the {module!r} package, which is not installed: pip install 'batchpilot[{extra}]'"
        )
