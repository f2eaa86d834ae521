"""Flags of the long-running commands (``run``, ``local``) from environment variables.

Every flag of those commands can be set as ``BATCHPILOT_<FLAG>`` (``--prometheus-url`` ->
``BATCHPILOT_PROMETHEUS_URL``), so that a kustomize patch or a GitOps values file changes
one setting by name instead of rewriting the container's argument list. A flag on the
command line wins over its variable; a repeatable flag takes several values separated by
``;``; a switch takes ``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``).
A bad value is a usage error naming the variable. The one-shot commands (``crd -o``,
``validate``, ``simulate``) read no environment: a variable left in a shell must not
change where they write.

How: the flags' defaults become ``SUPPRESS`` so that the parsed namespace shows which
flags were given; the others are filled afterwards from their variable or their own
default. That is also what lets a flag beat a variable of the other member of a mutually
exclusive pair (``-A`` on the command line against ``BATCHPILOT_NAMESPACE``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "BATCHPILOT_"
LIST_SEPARATOR = ";"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

ENV_HELP = (
    f"Every flag can also be set as an environment variable {ENV_PREFIX}<FLAG> (--prometheus-url -> "
    f"{ENV_PREFIX}PROMETHEUS_URL); a flag on the command line wins. A repeatable flag takes several values "
    f"separated by '{LIST_SEPARATOR}', a switch true or false."
)


def env_name(action: argparse.Action) -> str:
    """``BATCHPILOT_<FLAG>`` of a flag, from its long option (``-n/--namespace`` -> ``..._NAMESPACE``)."""
    long_options = [option for option in action.option_strings if option.startswith("--")]
    flag = (long_options or action.option_strings)[0]
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True)
class _EnvFlag:
    action: argparse.Action
    variable: str
    default: Any  # the flag's own default, used when neither the flag nor its variable is given


class EnvParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags fall back to their environment variable once
    :meth:`defaults_from_environment` has been called (subparsers are of this class too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._env_flags: list[_EnvFlag] = []
        self._environ: Mapping[str, str] = os.environ

    def defaults_from_environment(self, environ: Mapping[str, str] | None = None) -> None:
        """Let every flag of this parser fall back to ``BATCHPILOT_<FLAG>``, named in ``--help``."""
        self._environ = os.environ if environ is None else environ
        self.epilog = ENV_HELP if not self.epilog else f"{self.epilog} {ENV_HELP}"
        for action in self._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction | argparse._VersionAction):
                continue
            variable = env_name(action)
            if variable in self._environ:
                action.required = False  # the variable stands for the flag
            note = f"[env {variable}]"
            action.help = note if not action.help else f"{action.help} {note}"
            self._env_flags.append(_EnvFlag(action, variable, action.default))
            action.default = argparse.SUPPRESS

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if self._env_flags:
            self._fill(parsed)
        return parsed, extras

    def _fill(self, parsed: argparse.Namespace) -> None:
        given = {flag.action.dest for flag in self._env_flags if hasattr(parsed, flag.action.dest)}
        excluded = self._excluded_by_given(given)
        from_env = {
            flag.action.dest: flag.variable
            for flag in self._env_flags
            if flag.action.dest not in given and flag.action.dest not in excluded and flag.variable in self._environ
        }
        self._check_exclusive(from_env)
        for flag in self._env_flags:
            if flag.action.dest in given:
                continue
            value = flag.default
            if flag.action.dest in from_env:
                value = self._converted(flag, self._environ[flag.variable])
            setattr(parsed, flag.action.dest, value)

    def _excluded_by_given(self, given: set[str]) -> set[str]:
        """Destinations whose mutually exclusive partner was given as a flag: their variable is ignored."""
        excluded: set[str] = set()
        for group in self._mutually_exclusive_groups:
            dests = {action.dest for action in group._group_actions}
            if dests & given:
                excluded |= dests - given
        return excluded

    def _check_exclusive(self, from_env: dict[str, str]) -> None:
        for group in self._mutually_exclusive_groups:
            variables = [from_env[action.dest] for action in group._group_actions if action.dest in from_env]
            if len(variables) > 1:
                self.error(f"{' and '.join(variables)} exclude each other; set one")

    def _converted(self, flag: _EnvFlag, text: str) -> Any:
        action = flag.action
        if action.nargs == 0:  # a switch (store_true and its kin)
            word = text.strip().lower()
            if word in _TRUE:
                return action.const
            if word in _FALSE:
                return flag.default
            self.error(f"{flag.variable}={text!r}: expected true or false")
        if isinstance(action, argparse._AppendAction):
            items = [item.strip() for item in text.split(LIST_SEPARATOR) if item.strip()]
            return [self._one(flag, item) for item in items]
        return self._one(flag, text)

    def _one(self, flag: _EnvFlag, text: str) -> Any:
        action = flag.action
        try:
            value = action.type(text) if callable(action.type) else text
        except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
            self.error(f"{flag.variable}={text!r}: not a valid value for {action.option_strings[-1]}: {error}")
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            self.error(f"{flag.variable}={text!r}: must be one of {choices}")
        return value
