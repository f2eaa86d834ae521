"""Running the subcommand a command line names, for ``batchpilot-runtime`` and ``batchpilot-operator``
alike (the operator imports it; it imports nothing of either package).

A mistake the user can fix (a missing file, a bad value, unreadable YAML) ends the command with one
line on stderr and exit status 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]

USAGE_ERROR = 2  # argparse's own status for a bad command line
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def run_command(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    *,
    user_errors: tuple[type[Exception], ...] = (),
) -> int:
    """Parse ``argv`` and run the chosen subcommand's ``handler``: its exit status; ``INTERRUPTED`` on
    Ctrl-C; ``USAGE_ERROR`` and ``<prog> <command>: error: <what>`` on stderr for an ``OSError``, a
    ``ValueError`` or one of ``user_errors``."""
    reported: tuple[type[Exception], ...] = (OSError, ValueError, *user_errors)
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return INTERRUPTED
    except reported as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
