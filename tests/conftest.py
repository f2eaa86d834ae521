"""Hypothesis runs the same examples on every run by default, so that a red suite reproduces and a
green one stays green on an unchanged tree, and it never fails a test for taking long (a test does
not judge wall-clock time; a busy host must not turn an example red). ``HYPOTHESIS_PROFILE=explore``
searches with fresh random examples, and more of them where a test does not set its own count, to
find what the fixed ones miss."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("default", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
