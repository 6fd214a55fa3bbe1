"""Device memory: the runtime seam (``runtime``), its CuPy implementation, and the kinds of
device arrays the communicator accepts.

``runtime(name)`` gives the process-wide runtime of that name. "cupy" (a CUDA GPU and CuPy)
is built in; other runtimes are registered by the package that brings them
(``register_runtime``): the strict fake runtime of ``ringcomm.testing`` registers "fake"
when it is imported, so the library's core never depends on its test doubles. Runtimes
are made on first use, so importing ringcomm never imports CuPy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ...errors import ArgumentError
from .nccl import NcclLibrary
from .runtime import DeviceRuntime

_lock = threading.Lock()
_runtimes: dict[str, DeviceRuntime] = {}


def _make_cupy() -> DeviceRuntime:
    from .cupy_runtime import CupyRuntime, cupy_problem

    problem = cupy_problem()
    if problem:
        raise ArgumentError(f"the cupy device runtime cannot be used: {problem}")
    return CupyRuntime()


def _cupy_nccl(rt: DeviceRuntime) -> NcclLibrary:
    from .cupy_nccl import CupyNccl

    return CupyNccl()


#: runtime name -> (how to make it, how to make NCCL for its devices)
_MAKERS: dict[str, tuple[Callable[[], DeviceRuntime],
                         Callable[[DeviceRuntime], NcclLibrary]]] = {
    "cupy": (_make_cupy, _cupy_nccl)}


def register_runtime(name: str, make: Callable[[], DeviceRuntime],
                     nccl: Callable[[DeviceRuntime], NcclLibrary]) -> None:
    """Make ``runtime(name)`` give what ``make()`` makes (once per process), and
    ``nccl_library`` of it what ``nccl(rt)`` makes. Registering a name again is a no-op."""
    with _lock:
        _MAKERS.setdefault(name, (make, nccl))


def registered() -> list[str]:
    """The runtime names ``runtime`` knows in this process."""
    with _lock:
        return list(_MAKERS)


def runtime(name: str) -> DeviceRuntime:
    """The process-wide device runtime ``name``; an ``ArgumentError`` saying what to
    install, import or set where it cannot be had."""
    with _lock:
        found = _runtimes.get(name)
        if found is not None:
            return found
        maker = _MAKERS.get(name)
    if maker is None:
        hint = (" (the fake runtime comes with ringcomm.testing: import it first, as "
                "RINGCOMM_DEVICE=fake does)" if name == "fake" else "")
        raise ArgumentError(f"unknown device runtime {name!r}{hint}; known here: "
                            f"{', '.join(registered())}")
    made = maker[0]()
    with _lock:
        return _runtimes.setdefault(name, made)


def nccl_library(rt: DeviceRuntime) -> NcclLibrary:
    """NCCL for runtime ``rt``'s devices: CuPy's ``cupy.cuda.nccl`` for ``cupy``, what the
    runtime's registration brings for the others; imported only when asked for."""
    with _lock:
        maker = _MAKERS.get(rt.name)
    if maker is None:
        raise ArgumentError(f"no NCCL for the {rt.name!r} device runtime")
    return maker[1](rt)


def available_runtimes() -> list[str]:
    """The registered runtimes that can be used in this process ("cupy" where CuPy imports
    and sees a GPU; "fake" once ``ringcomm.testing`` is imported)."""
    from .cupy_runtime import cupy_problem

    return [name for name in registered() if name != "cupy" or not cupy_problem()]


def zeros(rt: DeviceRuntime, count: int, dtype: Any) -> Any:
    """``count`` zeros of ``dtype`` as ``rt``'s own array (a CuPy array, or the fake's),
    queued on the calling thread's current stream: what the tuner and the benchmark hand a
    communicator."""
    return rt.zeros(count, dtype)


def pointer(array: Any) -> int:
    """The device pointer of element 0 of a CuPy array or a fake runtime's array."""
    data = getattr(array, "data", None)
    return int(data.ptr) if data is not None and hasattr(data, "ptr") else int(array.ptr)


def release(*arrays: Any) -> None:
    """Give a fake array's memory back now (a CuPy array's goes with its last reference)."""
    for array in arrays:
        close = getattr(array, "close", None)
        if close is not None:
            close()
