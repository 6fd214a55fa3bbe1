"""Device memory: the runtime seam (``runtime``), its CuPy and strict fake implementations,
and the kinds of device arrays the communicator accepts.

``runtime(name)`` gives the process-wide runtime of that name: "fake" (numpy, everywhere)
or "cupy" (a CUDA GPU and CuPy). Runtimes are made on first use, so importing ringcomm
never imports CuPy.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ...errors import ArgumentError
from .nccl import NcclLibrary
from .runtime import DeviceRuntime

RUNTIME_NAMES = ("fake", "cupy")
_runtimes: dict[str, DeviceRuntime] = {}
_lock = threading.Lock()


def runtime(name: str) -> DeviceRuntime:
    """The process-wide device runtime ``name`` ("fake" or "cupy"); an ``ArgumentError``
    saying what to install or set where it cannot be had."""
    with _lock:
        found = _runtimes.get(name)
        if found is None:
            found = _runtimes[name] = _make(name)
        return found


def _make(name: str) -> DeviceRuntime:
    if name == "fake":
        from .fake import FakeRuntime

        return FakeRuntime()
    if name == "cupy":
        from .cupy_runtime import CupyRuntime, cupy_problem

        problem = cupy_problem()
        if problem:
            raise ArgumentError(f"the cupy device runtime cannot be used: {problem}")
        return CupyRuntime()
    raise ArgumentError(
        f"unknown device runtime {name!r}; use one of: {', '.join(RUNTIME_NAMES)}")


def nccl_library(rt: DeviceRuntime) -> NcclLibrary:
    """NCCL for runtime ``rt``'s devices: CuPy's ``cupy.cuda.nccl`` for ``cupy``, the strict
    fake for ``fake``; imported only when asked for."""
    if rt.name == "cupy":
        from .cupy_nccl import CupyNccl

        return CupyNccl()
    if rt.name == "fake":
        from .fake import FakeRuntime
        from .fake_nccl import FakeNccl

        assert isinstance(rt, FakeRuntime)
        return FakeNccl(rt)
    raise ArgumentError(f"no NCCL for the {rt.name!r} device runtime")


def available_runtimes() -> list[str]:
    """The runtimes that can be used in this process ("fake" always; "cupy" where CuPy
    imports and sees a GPU)."""
    from .cupy_runtime import cupy_problem

    return ["fake"] + ([] if cupy_problem() else ["cupy"])


def zeros(rt: DeviceRuntime, count: int, dtype: Any) -> Any:
    """``count`` zeros of ``dtype`` as ``rt``'s own array (a CuPy array, or a
    ``FakeDeviceArray``), queued on the calling thread's current stream: what the tuner and
    the benchmark hand a communicator."""
    if rt.name == "cupy":
        import cupy

        return cupy.zeros(count, dtype=dtype)
    from .fake import FakeDeviceArray, FakeRuntime

    assert isinstance(rt, FakeRuntime)
    return FakeDeviceArray.from_host(np.zeros(count, dtype=dtype), runtime=rt)


def pointer(array: Any) -> int:
    """The device pointer of element 0 of a CuPy array or a ``FakeDeviceArray``."""
    data = getattr(array, "data", None)
    return int(data.ptr) if data is not None and hasattr(data, "ptr") else int(array.ptr)


def release(*arrays: Any) -> None:
    """Give a fake array's memory back now (a CuPy array's goes with its last reference)."""
    for array in arrays:
        close = getattr(array, "close", None)
        if close is not None:
            close()
