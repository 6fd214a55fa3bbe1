"""The device runtime seam: the few CUDA operations ringcomm uses, behind one interface.

Why a seam: the device engines (CUDA IPC, host staging, NCCL) and the device buffer kinds
need streams, events, copies, IPC handles and elementwise reductions, and nothing else of
CUDA. Behind this interface there are two runtimes: CuPy's (``cupy_runtime``, imported
lazily, for a machine with a GPU) and a strict fake in numpy (``fake``, for every machine
without one), which applies queued work only when something waits for it, so device code
that forgets a wait, a record or a close fails its tests on a CPU.

The model is CUDA's, and every runtime keeps its rules:

- Work (copies, reductions) is queued on a ``Stream`` and runs in queue order; the host call
  returns before the work is done. Host memory handed to a copy must stay untouched and
  alive until the stream has passed the copy.
- ``record(event, stream)`` marks the point the stream has reached *when the call is made*;
  ``wait_event(stream, event)`` makes later work on ``stream`` wait for the latest record of
  ``event`` made before the call (a record made after the call does not count; an event
  never recorded is no wait at all). ``event_synchronize`` blocks the host until the latest
  record is done.
- Device pointers are plain ints that the host must not dereference. An ``Allocation`` is a
  base pointer from the device's own allocator (never a pool block), so it can be
  exported: ``export_memory`` gives a handle that another *process* opens
  (``open_memory``; opening it again in the same process only counts, and gives the same
  pointer, as ``cuIpcOpenMemHandle`` documents; opening one's own handle is an error) and
  closes (``close_memory``, once per open) before the exporter frees it (freeing memory a
  peer still maps is undefined behaviour).
- Interprocess events work the same way (``export_event``/``open_event``), with two facts
  measured on an H100 (CUDA 13, 2026-11-27): once an interprocess event is destroyed, the
  next one the process makes gets the *same handle bytes*, and opening one handle twice in
  a process is allowed (each open is an event of its own). So handle bytes are never a
  lasting identity: whoever opens or makes an event owns it and ends it (``close_event``),
  an importer before the exporter (using an imported event after its exporter destroyed it
  is undefined behaviour, CUDA's ``cudaIpcOpenEventHandle`` docs).
- Reductions (``reduce``, ``finish``) are elementwise kernels on the stream, with the
  semantics of ``ringcomm.core.dtypes.reduce_into`` and ``finish_reduction``, every dtype
  the core knows (float16 and bfloat16 included).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..dtypes import ReduceOp
from .mps import MpsState, mps_state


class Stream(abc.ABC):
    """An in-order queue of device work. ``handle`` is the runtime's own (a
    ``cudaStream_t`` as an int for CUDA): what another library's stream is matched by."""

    handle: int


class Event(abc.ABC):
    """A point in a stream's work (see the module docstring for record and wait)."""

    interprocess: bool


@dataclass(frozen=True)
class Allocation:
    """``nbytes`` of device memory at ``ptr`` on device ``device``, from the device's own
    allocator: exportable, freed only by ``free``."""

    ptr: int
    nbytes: int
    device: int


class DeviceRuntime(abc.ABC):
    """The CUDA operations ringcomm uses (see the module docstring)."""

    name: str  # "cupy" | "fake"
    memory: str  # what buffers in this runtime's memory say their memory is ("cuda", ...)

    # ---------------------------------------------------------------- devices
    @abc.abstractmethod
    def available(self) -> bool:
        """Whether a device can be used (CuPy imports without a GPU; this says no then)."""

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def current_device(self) -> int:
        """The calling thread's current device."""

    @abc.abstractmethod
    def set_device(self, index: int) -> None:
        """Make ``index`` the calling thread's current device."""

    @abc.abstractmethod
    def device_identity(self, index: int) -> str:
        """What names device ``index`` on this machine for every process on it (its PCI
        address): ranks on one host whose identities match share one GPU."""

    def mps(self) -> MpsState:
        """Whether an MPS daemon serves this process's GPU work (``ringcomm.core.device
        .mps``): read from the machine; the fake says its own (``FakeRuntime.mps_on``)."""
        return mps_state()

    #: What launches ringcomm's device allreduce kernels on this runtime, registered by the
    #: layer that has them (``ringcomm.engines.kernels.cupy_launch`` for CuPy,
    #: ``ringcomm.testing`` for the fake): a class made with the runtime, with a
    #: ``problem(runtime)`` class method saying why it cannot launch here ("" where it can).
    launcher_factory: ClassVar[Any] = None

    #: Whether this runtime's launch of the kernels has been checked against the kernels'
    #: numpy mirror on real hardware (the fake's launch is the mirror). Where not, the
    #: kernel path is taken only where ``RINGCOMM_DEVICE_ENGINE=cuda-kernel`` asks for it.
    kernel_path_checked: ClassVar[bool] = False

    def kernel_launch(self, pids: Sequence[int] = ()) -> str:
        """Why this runtime cannot launch ringcomm's device allreduce kernels
        (``ringcomm/engines/kernels``) for ranks in processes ``pids`` (every rank's, as
        agreed), "" where it can: what the kernel path's verdict needs
        (``ringcomm.plan.kernel_path``)."""
        factory = type(self).launcher_factory
        if factory is None:
            return f"the {self.name} runtime has no launcher of ringcomm's allreduce kernels"
        problem: str = factory.problem(self)
        return problem

    def kernel_launcher(self) -> Any:
        """What launches the allreduce kernels: ``launch_kernel(stream=, **launch)`` queues
        one rank's kernel of one op on ``stream`` (the fields of ``ringcomm.testing
        .fake_kernels.Launch``: every rank's data and pad as this process maps them, the
        op's number, the grid) and returns at once, as a kernel launch does; ``release()``
        at close. Only where ``kernel_launch`` says ""."""
        problem = self.kernel_launch()
        if problem:
            raise NotImplementedError(problem)
        return type(self).launcher_factory(self)

    def multiprocessors(self, index: int) -> int:
        """Streaming multiprocessors of device ``index``: how many blocks of the kernels can
        be resident at once, which bounds their grids (``kernel_geometry.grid_blocks``)."""
        raise NotImplementedError(f"the {self.name} runtime does not say its SMs")

    @abc.abstractmethod
    def describe(self) -> dict[str, str]:
        """What ``ringcomm env`` and ``gpu.json`` show: device name, driver, CUDA and library
        versions (strings; "-" where unknown)."""

    # ---------------------------------------------------------------- streams and events
    @abc.abstractmethod
    def new_stream(self) -> Stream:
        """A stream of its own on the current device (never the legacy default stream)."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The calling thread's current stream (what a caller's work was queued on)."""

    @abc.abstractmethod
    def external_stream(self, handle: int) -> Stream:
        """The stream another library made (torch's ``cuda_stream``), by its handle."""

    @abc.abstractmethod
    def synchronize(self, stream: Stream) -> None:
        """Block the host until all work queued on ``stream`` is done."""

    @abc.abstractmethod
    def new_event(self, *, interprocess: bool = False) -> Event:
        """An event without timing (interprocess ones can be exported)."""

    @abc.abstractmethod
    def record(self, event: Event, stream: Stream) -> None: ...

    @abc.abstractmethod
    def wait_event(self, stream: Stream, event: Event) -> None:
        """Later work on ``stream`` waits for the latest record of ``event`` (device side: the
        host does not block)."""

    @abc.abstractmethod
    def event_synchronize(self, event: Event) -> None:
        """Block the host until the latest record of ``event`` is done."""

    @abc.abstractmethod
    def event_done(self, event: Event) -> bool:
        """Whether the latest record of ``event`` is done (never blocks)."""

    @abc.abstractmethod
    def export_event(self, event: Event) -> bytes:
        """An interprocess event's handle, for another process's ``open_event``."""

    @abc.abstractmethod
    def open_event(self, handle: bytes) -> Event:
        """Another process's interprocess event (waitable here, not recordable). Each call
        opens it anew (a handle may be opened more than once); ``close_event`` ends each."""

    @abc.abstractmethod
    def close_event(self, event: Event) -> None:
        """End ``event`` now (``cudaEventDestroy``): one made here, or one opened from another
        process's handle. Work queued before keeps its waits; the event is dead afterwards.
        An exporter ends its events only once every importer has closed them."""

    # ---------------------------------------------------------------- memory
    @abc.abstractmethod
    def malloc(self, nbytes: int) -> Allocation:
        """Device memory of its own (not from a pool), on the current device."""

    @abc.abstractmethod
    def free(self, allocation: Allocation) -> None:
        """Give ``allocation`` back once the work queued on it is done (cudaFree waits for
        the whole device, every stream of it: never free while a stream may wait for ever);
        an error while another process still maps it."""

    @abc.abstractmethod
    def export_memory(self, allocation: Allocation) -> bytes:
        """A handle to ``allocation`` that another process opens with ``open_memory``."""

    def export_user_memory(self, ptr: int) -> tuple[bytes, int, int]:
        """For memory this process allocated elsewhere (a caching allocator's block, a
        user's array): the handle of the whole allocation holding ``ptr``, its base and its
        size, since an IPC handle names an allocation's base, never a pointer inside it
        (``cuMemGetAddressRange``, then ``cuIpcGetMemHandle`` of the base; torch's
        ``storage._share_cuda_`` sends base + offset alike). Raises ``ValueError`` saying
        why where the memory has no such handle (not device memory of this process; mapped
        with ``cuMemCreate``/``cuMemMap``, as torch's expandable segments are; from a
        stream-ordered pool)."""
        raise ValueError(f"the {self.name} runtime cannot export memory it did not allocate")

    @abc.abstractmethod
    def open_memory(self, handle: bytes) -> int:
        """Map another process's exported allocation; its base pointer here. Opening a
        handle that is open here already gives the same pointer and counts one more open
        (``cuIpcOpenMemHandle``); opening one's own handle is an error."""

    @abc.abstractmethod
    def close_memory(self, ptr: int) -> None:
        """Close one open of the mapping at ``ptr``; the last close unmaps it, and the
        pointer is dead afterwards."""

    @abc.abstractmethod
    def live_allocations(self) -> int:
        """Allocations made here and not freed, plus memory and event handles opened and not
        closed, plus host ranges registered: 0 once everything is given back (what the tests
        of ``close()`` look at)."""

    @abc.abstractmethod
    def host_register(self, address: int, nbytes: int) -> None:
        """Page-lock host memory this process maps (a /dev/shm ring), so copies to and from
        it run at full speed; ``host_unregister`` before it is unmapped."""

    @abc.abstractmethod
    def host_unregister(self, address: int) -> None: ...

    # ---------------------------------------------------------------- work on a stream
    @abc.abstractmethod
    def copy(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        """Device to device (either may be a peer's mapped memory)."""

    @abc.abstractmethod
    def to_host(self, dst: np.ndarray, src: int, stream: Stream) -> None:
        """Device to host: ``dst.nbytes`` bytes from ``src`` into ``dst`` (contiguous)."""

    @abc.abstractmethod
    def from_host(self, dst: int, src: np.ndarray, stream: Stream) -> None:
        """Host to device: all of ``src`` (contiguous) to ``dst``."""

    @abc.abstractmethod
    def reduce(self, dst: int, a: int, b: int, count: int, dtype: np.dtype, op: ReduceOp,
               stream: Stream) -> None:
        """``dst = a (op) b`` over ``count`` elements (``dst`` may be ``a``)."""

    @abc.abstractmethod
    def finish(self, ptr: int, count: int, dtype: np.dtype, op: ReduceOp, world_size: int,
               stream: Stream) -> None:
        """What remains once a region is fully reduced: ``avg`` divides by ``world_size``
        (``finish_reduction``'s rule), as one scale at the end."""

    # ---------------------------------------------------------------- arrays
    @abc.abstractmethod
    def zeros(self, count: int, dtype: Any) -> Any:
        """``count`` zeros of ``dtype`` as this runtime's own array (a CuPy array for CuPy),
        queued on the calling thread's current stream."""

    def array_at(self, ptr: int, count: int, dtype: np.dtype) -> Any:  # noqa: B027
        """The runtime's own array over ``count`` elements at ``ptr`` (a CuPy array for
        CuPy), for code that needs one; None where the runtime has none."""
        return None
