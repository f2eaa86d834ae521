"""Hypothesis runs the same examples on every run by default, so that a red suite reproduces and a
green one stays green on an unchanged tree, and it never fails a test for taking long (a test does
not judge wall-clock time; a busy host must not turn an example red). ``HYPOTHESIS_PROFILE=explore``
searches with fresh random examples, and more of them where a test does not set its own count, to
find what the fixed ones miss.

``control_plane``: one real kube-apiserver and etcd for the whole session (tests/support/control_plane.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

from tests.support.control_plane import ControlPlane, ControlPlaneMissing, control_plane_binaries

settings.register_profile("default", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A real kube-apiserver v1.37.2 and etcd, started once for the session by scripts/control-plane.sh.

    Missing binaries fail the tests, saying to run ``make control-plane``: CI must run them, so they
    never skip."""
    try:
        binaries = control_plane_binaries()
    except ControlPlaneMissing as missing:
        pytest.fail(str(missing), pytrace=False)
    plane = ControlPlane(directory=tmp_path_factory.mktemp("control-plane"), binaries=binaries)
    plane.up()
    try:
        yield plane
    finally:
        plane.down()
