"""The device runtime on a CUDA GPU, through CuPy (imported on first use, never by
``import ringcomm``).

Each method is one CUDA runtime call through ``cupy.cuda.runtime`` (events and streams by
their raw handles, so an event opened from another process is handled like one of ours);
the elementwise reductions are CuPy ufuncs with ``out=`` on the given stream. Memory comes
from ``cudaMalloc`` itself, never CuPy's pool, so it can be exported. What is open is
counted by pointer (a memory handle opened twice maps once, as CUDA counts it); nothing is
kept by handle bytes, which CUDA gives out again (an event's, once the event is destroyed).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from ..dtypes import ReduceOp
from .mps import mps_state
from .runtime import Allocation, DeviceRuntime, Event, Stream

_H2D, _D2H, _D2D = 1, 2, 3  # cudaMemcpyKind
_EVENT_DISABLE_TIMING, _EVENT_INTERPROCESS = 2, 4  # cudaEvent flags
_HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_NOT_READY = 600  # cudaErrorNotReady


def _cupy() -> Any:
    import cupy

    return cupy


def _address_range(ptr: int) -> tuple[int, int]:
    """The base and size of the device allocation holding ``ptr``: the driver's
    ``cuMemGetAddressRange`` (CuPy does not wrap it), through ctypes."""
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")
    get_range = driver.cuMemGetAddressRange_v2
    get_range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                          ctypes.c_uint64]
    base, nbytes = ctypes.c_uint64(), ctypes.c_size_t()
    result = get_range(ctypes.byref(base), ctypes.byref(nbytes), ctypes.c_uint64(ptr))
    if result:
        raise ValueError(f"cuMemGetAddressRange({ptr:#x}) failed with CUDA error {result}: "
                         "not device memory of this process")
    return int(base.value), int(nbytes.value)


def cupy_problem() -> str:
    """Why the CuPy runtime cannot be used here ("" when it can)."""
    try:
        cupy = _cupy()
    except Exception as exc:  # ImportError, or a broken CUDA library under it
        return (f"CuPy does not import ({type(exc).__name__}: {exc}); install it with "
                "pip install cupy-cuda13x (CUDA 13) or cupy-cuda12x (CUDA 12), or, in "
                "ringcomm's checkout, pip install -e '.[cuda13]' or -e '.[cuda]'")
    try:
        if cupy.cuda.is_available():
            return ""
    except Exception as exc:
        return f"CuPy cannot reach the CUDA driver ({type(exc).__name__}: {exc})"
    return ("CuPy sees no CUDA GPU (cupy.cuda.is_available() is False); run on a machine "
            "with one, or use the 'fake' runtime")


class CupyStream(Stream):
    """A CUDA stream: its handle, and a CuPy stream object for ``with stream:``."""

    def __init__(self, stream: Any) -> None:
        self.cupy = stream
        self.handle = int(stream.ptr)

    def __repr__(self) -> str:
        return f"<CupyStream {self.handle:#x}>"


class CupyEvent(Event):
    """A CUDA event by its raw handle (ours, or opened from another process's handle),
    destroyed by ``close_event`` or, failing that, when it is dropped."""

    def __init__(self, ptr: int, interprocess: bool, imported: bool) -> None:
        self.ptr = ptr
        self.interprocess = interprocess
        self.imported = imported
        self.finalizer = weakref.finalize(self, _destroy_event, ptr)
        self.finalizer.atexit = False  # the CUDA context may be gone by then

    def __repr__(self) -> str:
        return f"<CupyEvent {self.ptr:#x}{' (imported)' if self.imported else ''}>"


def _destroy_event(ptr: int) -> None:
    _cupy().cuda.runtime.eventDestroy(ptr)


def _version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


class CupyRuntime(DeviceRuntime):
    """The CUDA runtime through CuPy (module docstring). One per process:
    ``ringcomm.core.device.runtime("cupy")``."""

    name = "cupy"
    memory = "cuda"

    def __init__(self) -> None:
        self._cp = _cupy()
        self._rt = self._cp.cuda.runtime
        self._lock = threading.Lock()
        self._allocations: dict[int, int] = {}  # ptr -> nbytes, made here by malloc
        self._opened: dict[int, int] = {}  # mapped pointer -> opens not closed yet
        self._opened_events = 0  # events opened from handles and not closed
        self._registered: dict[int, int] = {}  # host address -> nbytes

    # ------------------------------------------------------------------------ devices
    def available(self) -> bool:
        return not cupy_problem()

    def device_count(self) -> int:
        return int(self._rt.getDeviceCount())

    def current_device(self) -> int:
        return int(self._rt.getDevice())

    def set_device(self, index: int) -> None:
        count = self.device_count()
        if not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(f"set_device({index!r}): this machine has {count} GPU(s), "
                             f"0..{count - 1}")
        self._rt.setDevice(index)

    def device_identity(self, index: int) -> str:
        props = self._rt.getDeviceProperties(index)
        return (f"{int(props.get('pciDomainID', 0)):04x}:{int(props.get('pciBusID', 0)):02x}:"
                f"{int(props.get('pciDeviceID', 0)):02x}.0")

    def multiprocessors(self, index: int) -> int:
        return int(self._rt.getDeviceProperties(index)["multiProcessorCount"])

    def compute_capability(self, index: int) -> tuple[int, int]:
        """Device ``index``'s (major, minor) compute capability: (9, 0) for an H100."""
        props = self._rt.getDeviceProperties(index)
        return int(props["major"]), int(props["minor"])

    def describe(self) -> dict[str, str]:
        props = self._rt.getDeviceProperties(self.current_device())
        name = props["name"]
        described = {
            "device": name.decode() if isinstance(name, bytes) else str(name),
            "gpu": self.device_identity(self.current_device()),
            "devices": str(self.device_count()),
            "driver": _version(self._rt.driverGetVersion()),
            "cuda": _version(self._rt.runtimeGetVersion()),
            "library": f"cupy {self._cp.__version__}",
        }
        try:
            from cupy.cuda import nccl

            described["nccl"] = str(nccl.get_version()) if nccl.available else "-"
        except Exception:
            described["nccl"] = "-"
        described["mps"] = str(mps_state())
        return described

    # ------------------------------------------------------------------------ streams
    def new_stream(self) -> CupyStream:
        return CupyStream(self._cp.cuda.Stream(non_blocking=True))

    def current_stream(self) -> CupyStream:
        return CupyStream(self._cp.cuda.get_current_stream())

    def external_stream(self, handle: int) -> CupyStream:
        return CupyStream(self._cp.cuda.ExternalStream(handle))

    def synchronize(self, stream: Stream) -> None:
        self._rt.streamSynchronize(stream.handle)

    def new_event(self, *, interprocess: bool = False) -> CupyEvent:
        flags = _EVENT_DISABLE_TIMING | (_EVENT_INTERPROCESS if interprocess else 0)
        return CupyEvent(int(self._rt.eventCreateWithFlags(flags)), interprocess, False)

    def _event(self, event: Event) -> CupyEvent:
        if not isinstance(event, CupyEvent):
            raise TypeError(f"{event!r} is not an event of the cupy runtime")
        return event

    def record(self, event: Event, stream: Stream) -> None:
        ev = self._event(event)
        if ev.imported:
            raise ValueError(f"record({ev!r}): an event opened from another process's "
                             "handle can be waited on here, not recorded")
        self._rt.eventRecord(ev.ptr, stream.handle)

    def wait_event(self, stream: Stream, event: Event) -> None:
        self._rt.streamWaitEvent(stream.handle, self._event(event).ptr, 0)

    def event_synchronize(self, event: Event) -> None:
        self._rt.eventSynchronize(self._event(event).ptr)

    def event_done(self, event: Event) -> bool:
        status = int(self._rt.eventQuery(self._event(event).ptr))
        if status in (0, _NOT_READY):
            return status == 0
        self._rt.check_status(status)
        return False

    def export_event(self, event: Event) -> bytes:
        ev = self._event(event)
        if not ev.interprocess or ev.imported:
            raise ValueError(f"export_event({ev!r}): only an event made here with "
                             "new_event(interprocess=True) can be exported")
        return bytes(self._rt.ipcGetEventHandle(ev.ptr))

    def open_event(self, handle: bytes) -> CupyEvent:
        event = CupyEvent(int(self._rt.ipcOpenEventHandle(bytes(handle))), True, True)
        with self._lock:
            self._opened_events += 1
        return event

    def close_event(self, event: Event) -> None:
        ev = self._event(event)
        if not ev.finalizer.alive:
            raise ValueError(f"close_event({ev!r}): it was closed already")
        ev.finalizer()  # cudaEventDestroy, once
        if ev.imported:
            with self._lock:
                self._opened_events -= 1

    # ------------------------------------------------------------------------ memory
    def malloc(self, nbytes: int) -> Allocation:
        ptr = int(self._rt.malloc(nbytes))
        with self._lock:
            self._allocations[ptr] = nbytes
        return Allocation(ptr, nbytes, self.current_device())

    def free(self, allocation: Allocation) -> None:
        with self._lock:
            if self._allocations.pop(allocation.ptr, None) is None:
                raise ValueError(f"free({allocation.ptr:#x}): not an allocation made here by "
                                 "malloc, or freed already")
        self._rt.free(allocation.ptr)

    def export_memory(self, allocation: Allocation) -> bytes:
        with self._lock:
            if allocation.ptr not in self._allocations:
                raise ValueError(f"export_memory({allocation.ptr:#x}): only the base of a "
                                 "live allocation made here by malloc can be exported")
        return bytes(self._rt.ipcGetMemHandle(allocation.ptr))

    def export_user_memory(self, ptr: int) -> tuple[bytes, int, int]:
        # a runtime call first: it binds the current device's context to this thread, which
        # the driver's call below needs (a worker thread may have none yet)
        kind = int(self._rt.pointerGetAttributes(ptr).type)
        if kind != self._rt.memoryTypeDevice:
            raise ValueError(f"{ptr:#x} is not plain device memory (cudaMemoryType {kind}: "
                             "host, managed or unregistered memory has no CUDA IPC handle)")
        base, nbytes = _address_range(ptr)
        try:
            handle = bytes(self._rt.ipcGetMemHandle(base))
        except Exception as err:  # noqa: BLE001 - CUDA's own words, with what to do
            raise ValueError(
                f"cudaIpcGetMemHandle refused the allocation at {base:#x} holding {ptr:#x} "
                f"({err}): only cudaMalloc'd memory has a CUDA IPC handle, not memory mapped "
                "with cuMemCreate/cuMemMap (torch's expandable_segments) or taken from a "
                "stream-ordered pool (cudaMallocAsync)") from None
        return handle, base, nbytes

    def open_memory(self, handle: bytes) -> int:
        ptr = int(self._rt.ipcOpenMemHandle(bytes(handle), 1))  # lazy peer access
        with self._lock:
            self._opened[ptr] = self._opened.get(ptr, 0) + 1
        return ptr

    def close_memory(self, ptr: int) -> None:
        with self._lock:
            opens = self._opened.get(ptr)
            if opens is None:
                raise ValueError(f"close_memory({ptr:#x}): no mapping opened with "
                                 "open_memory starts there")
            if opens > 1:
                self._opened[ptr] = opens - 1
            else:
                del self._opened[ptr]
        self._rt.ipcCloseMemHandle(ptr)

    def live_allocations(self) -> int:
        with self._lock:
            return (len(self._allocations) + sum(self._opened.values())
                    + self._opened_events + len(self._registered))

    def host_register(self, address: int, nbytes: int) -> None:
        with self._lock:
            for start, size in self._registered.items():
                if start < address + nbytes and address < start + size:
                    raise ValueError(f"host_register({address:#x}, {nbytes}): overlaps the "
                                     f"range {start:#x}+{size} registered already")
            self._registered[address] = nbytes
        try:
            self._rt.hostRegister(address, nbytes, _HOST_REGISTER_FLAGS)
        except BaseException:
            with self._lock:
                del self._registered[address]
            raise

    def host_unregister(self, address: int) -> None:
        with self._lock:
            if self._registered.pop(address, None) is None:
                raise ValueError(f"host_unregister({address:#x}): no range registered with "
                                 "host_register starts there")
        self._rt.hostUnregister(address)

    # ------------------------------------------------------------------------ work
    def copy(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        self._rt.memcpyAsync(dst, src, nbytes, _D2D, stream.handle)

    def to_host(self, dst: np.ndarray, src: int, stream: Stream) -> None:
        if not dst.flags.c_contiguous or not dst.flags.writeable:
            raise ValueError("to_host: dst must be a writable, contiguous numpy array")
        self._rt.memcpyAsync(dst.ctypes.data, src, dst.nbytes, _D2H, stream.handle)

    def from_host(self, dst: int, src: np.ndarray, stream: Stream) -> None:
        if not src.flags.c_contiguous:
            raise ValueError("from_host: src must be a contiguous numpy array")
        self._rt.memcpyAsync(dst, src.ctypes.data, src.nbytes, _H2D, stream.handle)

    def zeros(self, count: int, dtype: Any) -> Any:
        return self._cp.zeros(count, dtype=dtype)

    def array_at(self, ptr: int, count: int, dtype: np.dtype) -> Any:
        cuda = self._cp.cuda
        dtype = np.dtype(dtype)
        memory = cuda.UnownedMemory(ptr, count * dtype.itemsize, self, self.current_device())
        return self._cp.ndarray((count,), dtype, cuda.MemoryPointer(memory, 0))

    def _cupy_stream(self, stream: Stream) -> Any:
        if isinstance(stream, CupyStream):
            return stream.cupy
        return self._cp.cuda.ExternalStream(stream.handle)

    def reduce(self, dst: int, a: int, b: int, count: int, dtype: np.dtype, op: ReduceOp,
               stream: Stream) -> None:
        ufunc = getattr(self._cp, op.ufunc.__name__)  # add, multiply, minimum, bitwise_and...
        out = self.array_at(dst, count, dtype)
        x = out if a == dst else self.array_at(a, count, dtype)
        y = self.array_at(b, count, dtype)
        with self._cupy_stream(stream):
            ufunc(x, y, out=out)

    def finish(self, ptr: int, count: int, dtype: np.dtype, op: ReduceOp, world_size: int,
               stream: Stream) -> None:
        if not op.divides or world_size <= 1:
            return
        arr = self.array_at(ptr, count, dtype)
        with self._cupy_stream(stream):  # finish_reduction's rule: one division, cast back
            self._cp.divide(arr, world_size, out=arr, casting="unsafe")
