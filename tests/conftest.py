"""Fixtures shared by the test modules that run jobs on real processes, and the gpu marker."""

from __future__ import annotations

import os

import pytest

import ringcomm.testing  # noqa: F401 - registers the fake device runtime for every test


@pytest.fixture(scope="session")
def rank_processes():
    """Up to four spawned rank processes (``mp_helpers.Cluster``), each started by the first
    job that needs it and shared by the modules' ``cluster``: a process that imports torch
    takes seconds to start (and to end), and a session whose jobs run on two ranks only
    needs two."""
    from mp_helpers import Cluster

    c = Cluster(4)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def cluster(rank_processes):
    """The rank processes for one module's jobs. Each job starts from the process's own
    environment (a variable a job sets is undone after it); a process that died or hung is
    replaced. After a module in which a rank died (the others aborted their groups, which
    may leave device memory they could not free, to be freed later), the next module
    starts fresh processes, as it would with processes of its own."""
    yield rank_processes
    if rank_processes.dirty:
        rank_processes.close()


# --------------------------------------------------------------------------- the gpu marker
# Tests marked ``gpu`` run on a device runtime: CuPy's where CuPy sees a GPU, or the strict
# fake runtime where RINGCOMM_TEST_RUNTIME=fake (``bench/gpu_check.sh --fake`` sets it, so the
# runtime-generic ones run on a CPU machine too); without either they are skipped, so the
# default suite runs everywhere. A test that needs CuPy or torch CUDA itself (not just a
# runtime) skips when ``gpu_runtime.name`` is "fake".
TEST_RUNTIME = os.environ.get("RINGCOMM_TEST_RUNTIME", "cupy")


def _why_no_runtime() -> str | None:
    """Why the test runtime cannot be had here (None: it can)."""
    if TEST_RUNTIME not in ("cupy", "fake"):
        return f"RINGCOMM_TEST_RUNTIME={TEST_RUNTIME!r}: use cupy or fake"
    try:
        from ringcomm.core.device import runtime

        if not runtime(TEST_RUNTIME).available():
            return f"the {TEST_RUNTIME} runtime sees no device"
    except Exception as err:  # noqa: BLE001 - any reason it cannot be had is a skip
        return (f"no {TEST_RUNTIME} runtime here ({type(err).__name__}: {err}); "
                "RINGCOMM_TEST_RUNTIME=fake runs these on the fake runtime")
    return None


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if marked and (why := _why_no_runtime()) is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def gpu_runtime():
    """The device runtime the ``gpu`` tests run on (``RINGCOMM_TEST_RUNTIME``)."""
    from ringcomm.core.device import runtime

    return runtime(TEST_RUNTIME)


@pytest.fixture
def fake_devices(monkeypatch):
    """The fake runtime with four devices and MPS off, as a test may change them."""
    from ringcomm.core import device

    rt = device.runtime("fake")
    monkeypatch.setattr(rt, "_devices", max(4, rt.device_count()))
    monkeypatch.setattr(rt, "mps_on", False)
    return rt


@pytest.fixture
def gpu_device(gpu_runtime):
    """``ringcomm.init(device=...)``'s name for the test runtime: "cuda" or "fake"."""
    return "cuda" if gpu_runtime.name == "cupy" else "fake"
