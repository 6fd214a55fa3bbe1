"""Fixtures shared by the test modules that run jobs on real processes."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cluster():
    """Up to four spawned rank processes for one module's jobs (``mp_helpers.Cluster``),
    each started once, by the first job that needs it: a process that imports torch takes
    seconds to start, and a module whose jobs run on two ranks only needs two."""
    from mp_helpers import Cluster

    c = Cluster(4)
    try:
        yield c
    finally:
        c.close()
