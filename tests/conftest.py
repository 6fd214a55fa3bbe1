"""Fixtures shared by the test modules that run jobs on real processes."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cluster():
    """Four spawned rank processes for one module's jobs (``mp_helpers.Cluster``), started
    once: a process that imports torch takes seconds to start."""
    from mp_helpers import Cluster

    c = Cluster(4)
    c.start()
    try:
        yield c
    finally:
        c.close()
