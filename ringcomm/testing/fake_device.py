"""A strict fake of the device runtime in numpy, so device code is tested on a CPU.

Why so strict: device code is wrong in ways a CPU hides (a forgotten wait, a record made
too late, a handle closed twice, memory freed while a peer maps it). This runtime keeps
CUDA's rules (``ringcomm.core.device.runtime``'s docstring) and makes breaking one visible
at once and deterministically:

- **Lazy streams.** Copies, reductions and records are only queued. A stream's items run, in
  order, when something needs them: ``synchronize``, ``event_synchronize``/``event_done``
  of an event recorded on it, or another stream reaching a wait on such an event. Work
  nobody waited for has simply not happened, so a reader that skips a wait reads the old
  bytes, every time.
- **Device memory is not host memory.** Pointers lie in a range no host mapping uses and
  are resolved only when an item runs; a pointer no live allocation or open mapping covers
  (freed, closed, out of range, a host address) raises ``FakeDeviceFault`` at once.
  ``FakeDeviceArray`` refuses host access (``np.asarray`` raises; use ``.to_host()``).
- **Real interprocess memory.** Every allocation is a ``memfd`` (nothing appears in a file
  system, nothing is left after a SIGKILL) whose first page is a header: magic, id, size and
  the table of processes that map it. Another process opens a handle through
  ``/proc/<pid>/fd/<fd>`` and registers there; ``free`` refuses while a living importer
  still maps the memory. Interprocess events keep their generations (recorded, completed,
  demanded) and their importers in a small memfd too; a stream in another process waiting
  on one asks for it (``demanded``) and a daemon "device" thread of the recording process
  runs the recording stream that far.

What the fake refuses, and why (each a ``FakeDeviceFault``; a test breaks each once). A
refusal is either what CUDA refuses or what its documentation calls undefined behaviour,
which a GPU would not report but would punish later:

====================================================  ==========================================
refusal                                               source
====================================================  ==========================================
a pointer outside every live allocation and mapping   an illegal address on a GPU (the kernel or
(freed, closed, out of range, host memory)            copy faults: cudaErrorIllegalAddress)
``free`` while another living process maps it         undefined (cudaIpcOpenMemHandle docs:
                                                      importers close before the exporter frees)
``free``/``close_memory`` of what is not an           cudaErrorInvalidValue /
allocation/mapping start, or a second free            cudaErrorInvalidDevicePointer
opening one's own memory or event handle              cudaErrorInvalidContext / DeviceUninitialized
                                                      (CUDA IPC is between processes; measured
                                                      reports)
opening a memory handle whose allocation was freed    the memory is gone (cudaErrorInvalidValue)
``close_event`` of an exported event that a living    undefined (cudaIpcOpenEventHandle docs: use
importer still has open                               of an imported event after the exporter
                                                      destroyed it)
recording an event opened from another process        cudaErrorInvalidResourceHandle (IPC events
                                                      can be waited on, not recorded, by importers)
releasing an array while work queued on another       undefined: the pool (CuPy's, torch's caching
stream still uses it                                  allocator) hands the memory out again
a stream or host wait that never ends                 a hang on a GPU (the fake gives up after
                                                      ``RINGCOMM_FAKE_DEVICE_TIMEOUT``)
any work on a stream after an item of it faulted      CUDA errors are sticky: after an illegal
                                                      address every later call of the context
                                                      fails
a stream or event of another runtime (or none)        cudaErrorInvalidResourceHandle
a kernel (a reduction) on a stream of a device that   CUDA C Programming Guide, "Stream and
is not the thread's current one; recording an event   Event Behavior" (copies and waits across
on a stream of another device                         devices are allowed, and are here)
a negative size; a null or empty host range to        cudaErrorInvalidValue
register; a range overlapping a registered one;       cudaErrorHostMemoryAlreadyRegistered;
unregistering a range never registered                cudaErrorHostMemoryNotRegistered
a host array a copy cannot use as it is (not          the seam's contract: a copy moves one
contiguous; read-only as a destination)               contiguous range of bytes
exporting memory of ``malloc_mapped`` (as            cuIpcGetMemHandle docs: memory of
``cuMemCreate``/``cuMemMap`` map it)                  cuMemAlloc only
an IPC handle that is not one, or names no live       cudaErrorInvalidResourceHandle
allocation or event of its process
a handle opened on two threads at once; a 129th       the fake's own bookkeeping (not CUDA's):
open of one exported allocation or event              it refuses rather than lose track
====================================================  ==========================================

And what it allows because CUDA was measured or documented to (never refuse these):

- opening one memory handle twice in a process: the same pointer, counted; each open is
  closed once (cuIpcOpenMemHandle / cuIpcCloseMemHandle docs);
- opening one event handle twice in a process: each open is an event of its own (measured
  on an H100, CUDA 13, 2026-11-27);
- a destroyed interprocess event's handle bytes come back for the process's next
  interprocess event (measured there: 4 of 4), so a handle names a slot, not an event;
  an importer that kept the old one open waits on the new one's records.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import fcntl
import math
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core import config
from ..core.device.mps import MpsState
from ..core.device.runtime import Allocation, DeviceRuntime, Event, Stream
from ..core.dtypes import ReduceOp, finish_reduction, reduce_into

PAGE = mmap.PAGESIZE
#: Fake device pointers lie in 0x7e00_0000_0000 - 0x7f00_0000_0000, a range no host mapping
#: uses (x86-64 Linux maps libraries and large blocks just below 0x7fff_ffff_ffff, the heap
#: far lower); each process has its own 32 GiB window in it, so a pointer carried to another
#: process is no pointer there.
ADDRESS_BASE = 0x7E00_0000_0000
_WINDOW = 1 << 35
_GRAIN = 1 << 16  # allocations start on 64 KiB and keep at least 64 KiB apart
_MEM_MAGIC = b"RCFAKEMM"
_EVENT_MAGIC = b"RCFAKEEV"
_MEM_HANDLE = struct.Struct("<8sQQQQ")  # magic, pid, fd, id, nbytes
_EVENT_HANDLE = struct.Struct("<8sQQQ")  # magic, pid, fd, id
_NO_IPC_HANDLE = ("export of {ptr:#x}: memory mapped with cuMemCreate/cuMemMap (as torch's "
                  "expandable segments map it) has no CUDA IPC handle (cuIpcGetMemHandle "
                  "takes memory of cuMemAlloc only)")
_IMPORTERS_AT = 64  # header offset of the importer table: (pid, start time) pairs
_IMPORTER_SLOTS = 128
_POLL_S = 0.0002  # how often a stream waiting on another process's event looks again
_IDLE_POLL_S = 0.002  # how often an idle device thread looks for demands


class FakeDeviceFault(RuntimeError):
    """The fake device caught what a GPU would punish: a bad pointer, a misused handle, a
    free while mapped, or a wait that can never end."""


def _timeout_s() -> float:
    """How long a stream may wait before the fake calls it a hang (a GPU would wait
    forever): ``RINGCOMM_FAKE_DEVICE_TIMEOUT`` seconds, 60 by default."""
    return float(config.value("fake_device_timeout"))


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), None if it is gone or a
    zombie: together with the pid it names a process even after pids wrap."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _memfd(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def _open_peer_fd(pid: int, fd: int, what: str) -> int:
    try:
        return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise FakeDeviceFault(
            f"cannot open the {what} handle of process {pid} (fd {fd}): {exc.strerror}; the "
            "exporter has exited or given it back, or the handle is not from this machine"
        ) from None


def _close_map(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view still lives (a traceback): GC closes it
        mm.close()


# ----------------------------------------------------------------------------- streams


class _Item:
    """One piece of queued work; ``run`` returns False where it cannot run yet and the
    caller must not block (a wait whose event is not done)."""

    __slots__ = ("what", "touches", "keep")

    def __init__(self, what: str, touches: tuple[tuple[int, int], ...] = (),
                 keep: Any = None) -> None:
        self.what = what
        self.touches = touches  # (ptr, nbytes) ranges of device memory it reads or writes
        self.keep = keep  # host objects it needs alive until it runs

    def run(self, rt: FakeRuntime, block: bool, deadline: float) -> bool:
        raise NotImplementedError


class _Work(_Item):
    __slots__ = ("fn",)

    def __init__(self, what: str, fn: Callable[[], None], touches: tuple[tuple[int, int], ...],
                 keep: Any = None) -> None:
        super().__init__(what, touches, keep)
        self.fn = fn

    def run(self, rt: FakeRuntime, block: bool, deadline: float) -> bool:
        self.fn()
        return True


class _Record(_Item):
    __slots__ = ("event", "generation")

    def __init__(self, event: FakeEvent, generation: int) -> None:
        super().__init__(f"record {event.name} #{generation}")
        self.event = event
        self.generation = generation

    def run(self, rt: FakeRuntime, block: bool, deadline: float) -> bool:
        ev = self.event
        with ev.lock:
            ev.pending.pop(self.generation, None)
            if int(ev.state[1]) < self.generation:
                ev.state[1] = self.generation
            released = ev.closed and not ev.pending
        if released:
            rt._release_slot(ev)
        return True


class _Wait(_Item):
    __slots__ = ("event", "generation", "stream")

    def __init__(self, stream: FakeStream, event: FakeEvent, generation: int) -> None:
        super().__init__(f"wait {event.name} #{generation}")
        self.stream = stream
        self.event = event
        self.generation = generation

    def run(self, rt: FakeRuntime, block: bool, deadline: float) -> bool:
        ev = self.event
        if not rt._reach(ev, self.generation, block, deadline, f"stream {self.stream.handle:#x}"):
            return False
        if ev.imported:
            with ev.lock:
                ev.waits -= 1
                last = ev.closed and not ev.waits
            if last:  # closed while this wait was queued: the import ends now
                assert ev.finalizer is not None
                ev.finalizer()
        return True


class FakeStream(Stream):
    """An in-order queue of fake device work (see the module docstring)."""

    def __init__(self, handle: int, device: int = 0) -> None:
        self.handle = handle
        self.device = device  # the device current when it was made, as CUDA ties it
        self.cond = threading.Condition(threading.Lock())
        self.queue: collections.deque[_Item] = collections.deque()
        self.queued = 0  # items ever queued; an item's number is the count when it came
        self.done = 0  # items run
        self.runner: int | None = None  # the thread running an item now
        self.fault: BaseException | None = None

    def __repr__(self) -> str:
        return f"<FakeStream {self.handle:#x}: {self.queued - self.done} queued>"


class _EventSlot:
    """Where an interprocess event of this process keeps its state: a one-page memfd
    (magic, slot id, generations recorded / completed / demanded, the importer table).
    A slot outlives its event: once the event is destroyed (and its pending records have
    run, as CUDA releases an event's resources only then), the slot goes back to the
    process's pool and the next interprocess event takes it, handle bytes and all, as
    CUDA was measured to give a destroyed event's handle to the next event."""

    __slots__ = ("ident", "fd", "mm", "state", "handle")

    def __init__(self, ident: int, pid: int) -> None:
        self.ident = ident
        self.fd, self.mm = _memfd(f"ringcomm-fake-event-{ident}", PAGE)
        self.mm[:8] = _EVENT_MAGIC
        struct.pack_into("<Q", self.mm, 8, ident)
        self.state = np.frombuffer(self.mm, np.uint64, 3, 16)
        self.handle = _EVENT_HANDLE.pack(_EVENT_MAGIC, pid, self.fd, ident)


class FakeEvent(Event):
    """An event of the fake runtime. ``state`` holds the generations recorded, completed and
    demanded (in a memfd for interprocess events, so other processes read them);
    ``pending`` maps each recorded generation not yet reached to its stream and item."""

    def __init__(self, name: str, interprocess: bool, state: np.ndarray, *, imported: bool,
                 owner: int) -> None:
        self.name = name
        self.interprocess = interprocess
        self.imported = imported
        self.owner = owner
        self.state = state
        self.lock = threading.Lock()
        self.pending: dict[int, tuple[FakeStream, int]] = {}
        self.export: bytes | None = None
        self.slot: _EventSlot | None = None  # an interprocess event of this process's
        self.closed = False  # close_event was called
        self.waits = 0  # an imported event's queued waits not run yet
        self.device = 0  # the device current when it was made or opened
        self.finalizer: weakref.finalize[Any, Any] | None = None  # what dropping it does

    def __repr__(self) -> str:
        return (f"<FakeEvent {self.name}: recorded {int(self.state[0])}, completed "
                f"{int(self.state[1])}>")


# ----------------------------------------------------------------------------- memory


@dataclass
class _Region:
    """A range of fake device addresses: an allocation of this process or a mapping of
    another process's allocation."""

    base: int
    nbytes: int
    kind: str  # "allocation" | "mapping"
    fd: int
    mm: mmap.mmap
    ident: int
    owner: int  # the pid that allocated it
    data: np.ndarray = field(repr=False)
    exportable: bool = True  # False: mapped as cuMemCreate/cuMemMap map it (no IPC handle)

    @property
    def end(self) -> int:
        return self.base + self.nbytes


class FakeRuntime(DeviceRuntime):
    """The strict fake device runtime (module docstring). One per process:
    ``ringcomm.core.device.runtime("fake")``."""

    name = "fake"
    memory = "fake-cuda"

    def __init__(self) -> None:
        self.pid = os.getpid()
        #: seconds a stream or the host waits before the fake reports a device hang
        self.hang_timeout = _timeout_s()
        self._devices = int(config.value("fake_devices"))
        self._lock = threading.Lock()  # the tables below; never held while waiting
        self._next_address = ADDRESS_BASE + (self.pid % 32) * _WINDOW
        self._next_id = 1
        self._bases: list[int] = []
        self._regions: dict[int, _Region] = {}
        self._dead: dict[int, tuple[int, str]] = {}  # base -> (end, what happened)
        self._dead_bases: list[int] = []
        self._opened: dict[tuple[int, int], int] = {}  # (pid, id) -> mapping base
        self._opens: dict[int, int] = {}  # mapping base -> opens not closed yet
        self._imported_events = 0  # events opened from handles and not closed
        self._free_slots: list[_EventSlot] = []  # interprocess event slots to reuse
        self._registered: dict[int, int] = {}  # host address -> nbytes
        self._streams: dict[int, FakeStream] = {}
        self._next_stream = 0x5000
        self._local = threading.local()
        # (allocation, the stream of the array released, or None for a free)
        self._deferred: list[tuple[Allocation, int | None]] = []
        self._exported_events: weakref.WeakSet[FakeEvent] = weakref.WeakSet()
        self._device_thread: threading.Thread | None = None

    # ------------------------------------------------------------------------ devices
    def available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self._devices

    def current_device(self) -> int:
        return int(getattr(self._local, "device", 0))

    def set_device(self, index: int) -> None:
        if not isinstance(index, int) or not 0 <= index < self._devices:
            raise FakeDeviceFault(
                f"set_device({index!r}): the fake runtime has {self._devices} device(s), "
                f"0..{self._devices - 1} (RINGCOMM_FAKE_DEVICES sets how many)")
        self._local.device = index

    def device_identity(self, index: int) -> str:
        """Every process's fake device ``index`` is one device: processes of one host that
        use the same index share it, as processes on one GPU do."""
        if not 0 <= index < self._devices:
            raise FakeDeviceFault(f"device_identity({index}): the fake runtime has "
                                  f"{self._devices} device(s)")
        return f"fake:{index}"

    #: Whether MPS serves this process's fake device: off unless a test turns it on. The
    #: fake's facts for the kernel path's verdict (``ringcomm.plan.kernel_path``), and the
    #: rule behind each: ranks on one fake device index share one GPU
    #: (``device_identity``), as processes on one GPU do; ranks on different indices
    #: (``run_group(gpus=...)``; ``RINGCOMM_FAKE_DEVICES`` gives the indices) each have
    #: their own; MPS is the machine's question (``ringcomm.core.device.mps``) for a real
    #: GPU, but a fake device has no daemon to ask, so reading the machine would make the
    #: fake's verdict depend on whichever daemon runs where the tests run: the fake says
    #: off, and a test that wants MPS sets ``mps_on``.
    mps_on = False

    def mps(self) -> MpsState:
        if self.mps_on:
            return MpsState(True, "the fake runtime's MPS, on (FakeRuntime.mps_on)")
        return MpsState(False, "the fake runtime's MPS, off unless a test turns it on "
                               "(FakeRuntime.mps_on)")

    #: the fake's launch of the kernels is their numpy mirror, the reference a GPU's launch
    #: is checked against (``fake_kernels.StreamLauncher``, registered by ``ringcomm.testing``)
    kernel_path_checked = True

    #: SMs of every fake device: few, so the kernels' mirror runs grids of one or two
    #: blocks per rank (each a coroutine stepped in numpy)
    MULTIPROCESSORS = 8

    def multiprocessors(self, index: int) -> int:
        self.device_identity(index)  # refuses an index the fake does not have
        return self.MULTIPROCESSORS

    def describe(self) -> dict[str, str]:
        return {"device": "fake (numpy)", "gpu": self.device_identity(self.current_device()),
                "devices": str(self._devices), "driver": "-", "cuda": "-",
                "library": f"numpy {np.__version__}", "mps": str(self.mps())}

    # ------------------------------------------------------------------------ streams
    def new_stream(self) -> FakeStream:
        device = self.current_device()
        with self._lock:
            handle = self._next_stream
            self._next_stream += 0x10
            stream = FakeStream(handle, device)
            self._streams[handle] = stream
        return stream

    def current_stream(self) -> FakeStream:
        """The calling thread's current stream of its current device (each device has its
        own, as in CUDA)."""
        streams: dict[int, FakeStream] | None = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        device = self.current_device()
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = self.new_stream()
        return stream

    def set_current_stream(self, stream: Stream) -> None:
        """Make ``stream`` the calling thread's current stream of its device (CuPy's ``with
        stream:``)."""
        own = self._own(stream)
        if not hasattr(self._local, "streams"):
            self._local.streams = {}
        self._local.streams[own.device] = own

    def _kernel_on(self, stream: Stream, what: str) -> FakeStream:
        """``stream``, checked for a kernel launch: CUDA launches a kernel only on a stream
        of the calling thread's current device (CUDA C Programming Guide, "Stream and Event
        Behavior": the launch fails otherwise). Copies have no such rule."""
        s = self._own(stream)
        current = self.current_device()
        if s.device != current:
            raise FakeDeviceFault(
                f"{what}: a kernel on stream {s.handle:#x} of device {s.device} while this "
                f"thread's current device is {current}; CUDA refuses the launch (make the "
                "stream's device current first: set_device)")
        return s

    def external_stream(self, handle: int) -> FakeStream:
        with self._lock:
            stream = self._streams.get(handle)
        if stream is None:
            raise FakeDeviceFault(
                f"no fake stream has handle {handle:#x}; handles come from this process's "
                "fake runtime (a stream's .handle)")
        return stream

    def synchronize(self, stream: Stream) -> None:
        self._drain_deferred()
        s = self._own(stream)
        self._advance(s, s.queued, True, time.monotonic() + self.hang_timeout)

    def _own(self, stream: Stream) -> FakeStream:
        if not isinstance(stream, FakeStream) or self._streams.get(stream.handle) is not stream:
            raise FakeDeviceFault(f"{stream!r} is not a stream of this process's fake runtime")
        return stream

    def _queue(self, stream: Stream, item: _Item) -> int:
        s = self._own(stream)
        with s.cond:
            s.queue.append(item)
            s.queued += 1
            return s.queued

    def _advance(self, s: FakeStream, target: int, block: bool, deadline: float) -> bool:
        """Run ``s``'s items until ``target`` of them are done. Returns False where that
        needs a wait that is not over and ``block`` is False."""
        me = threading.get_ident()
        depth = getattr(self._local, "depth", 0)
        while True:
            with s.cond:
                while True:
                    if s.done >= target:
                        return True
                    if s.fault is not None:
                        raise FakeDeviceFault(
                            f"stream {s.handle:#x} faulted earlier and runs nothing more: "
                            f"{s.fault}")
                    if s.runner is None or s.runner == me:
                        break
                    if not block:
                        return False
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise FakeDeviceFault(
                            f"device hang: stream {s.handle:#x} did not get past item "
                            f"{s.done + 1} within {self.hang_timeout:g} s")
                    s.cond.wait(min(left, 0.05))
                outer = s.runner
                s.runner = me
                item = s.queue[0]
            self._local.depth = depth + 1
            try:
                ok = item.run(self, block, deadline)
            except BaseException as exc:
                with s.cond:
                    s.fault = exc
                    s.queue.popleft()
                    s.done += 1
                    s.runner = outer
                    s.cond.notify_all()
                raise
            finally:
                self._local.depth = depth
            with s.cond:
                if ok:
                    s.queue.popleft()
                    s.done += 1
                s.runner = outer
                s.cond.notify_all()
            if not ok:
                return False

    # ------------------------------------------------------------------------ events
    def new_event(self, *, interprocess: bool = False) -> FakeEvent:
        with self._lock:
            ident = self._next_id
            self._next_id += 1
            slot = self._free_slots.pop() if interprocess and self._free_slots else None
        name = f"e{ident}@{self.pid}"
        if not interprocess:
            plain = FakeEvent(name, False, np.zeros(3, np.uint64), imported=False,
                              owner=self.pid)
            plain.device = self.current_device()
            return plain
        if slot is None:
            slot = _EventSlot(ident, self.pid)
        slot.state[:] = 0
        event = FakeEvent(name, True, slot.state, imported=False, owner=self.pid)
        event.device = self.current_device()
        event.slot = slot
        event.export = slot.handle
        # dropped without close_event: destroyed then (CuPy's Event does the same), and its
        # slot goes back to the pool
        event.finalizer = weakref.finalize(event, self._free_slots.append, slot)
        return event

    def _event(self, event: Event) -> FakeEvent:
        if not isinstance(event, FakeEvent):
            raise FakeDeviceFault(f"{event!r} is not an event of the fake runtime")
        return event

    def record(self, event: Event, stream: Stream) -> None:
        ev = self._event(event)
        if ev.closed:
            raise FakeDeviceFault(f"record of {ev.name}, which was closed with close_event")
        if ev.imported:
            raise FakeDeviceFault(
                f"record({ev.name}): an event opened from another process's handle can be "
                "waited on here, not recorded (record it in the process that made it)")
        s = self._own(stream)
        if s.device != ev.device:  # CUDA C Programming Guide, "Stream and Event Behavior"
            raise FakeDeviceFault(
                f"record({ev.name}): the event is of device {ev.device} and stream "
                f"{s.handle:#x} of device {s.device}; CUDA refuses to record an event on a "
                "stream of another device (make the event with that device current)")
        with s.cond, ev.lock:
            generation = int(ev.state[0]) + 1
            s.queue.append(_Record(ev, generation))
            s.queued += 1
            ev.pending[generation] = (s, s.queued)
            ev.state[0] = generation

    def wait_event(self, stream: Stream, event: Event) -> None:
        ev = self._event(event)
        s = self._own(stream)
        if ev.closed:
            raise FakeDeviceFault(f"wait_event on {ev.name}, which was closed with close_event")
        generation = int(ev.state[0])
        if generation == 0:
            return  # never recorded: no wait, as in CUDA
        if ev.imported:
            with ev.lock:
                ev.waits += 1
        self._queue(s, _Wait(s, ev, generation))

    def event_synchronize(self, event: Event) -> None:
        self._drain_deferred()
        ev = self._event(event)
        generation = int(ev.state[0])
        if generation:
            self._reach(ev, generation, True, time.monotonic() + self.hang_timeout, "the host")

    def event_done(self, event: Event) -> bool:
        """Whether the latest record is done. Where it is not, this starts the work that
        completes it and still answers False (a poll later says True): a polling loop
        moves on, and code that never waits sees nothing finished."""
        ev = self._event(event)
        generation = int(ev.state[0])
        if not generation or self._reached(ev, generation):
            return True
        self._reach(ev, generation, False, time.monotonic() + self.hang_timeout, "the host")
        return False

    def _reached(self, ev: FakeEvent, generation: int) -> bool:
        if ev.imported:
            return int(ev.state[1]) >= generation
        with ev.lock:
            return generation not in ev.pending

    def _reach(self, ev: FakeEvent, generation: int, block: bool, deadline: float,
               who: str) -> bool:
        """Make record ``generation`` of ``ev`` happen: run its stream here, or ask the
        recording process for it and poll. False where it is not done and ``block`` is
        False."""
        if not ev.imported:
            with ev.lock:
                where = ev.pending.get(generation)
            if where is None:
                return True
            return self._advance(where[0], where[1], block, deadline)
        state = ev.state
        while int(state[1]) < generation:
            if int(state[2]) < generation:
                state[2] = generation
            if not block:
                return False
            if time.monotonic() > deadline:
                raise FakeDeviceFault(
                    f"device hang: {who} waited {self.hang_timeout:g} s for {ev.name} (record "
                    f"#{generation} in process {ev.owner}), which never completed; the "
                    "recording process is gone or stuck, or the waits form a cycle")
            time.sleep(_POLL_S)
        return True

    def export_event(self, event: Event) -> bytes:
        ev = self._event(event)
        if ev.export is None:
            raise FakeDeviceFault(
                f"export_event({ev.name}): only an event made with new_event(interprocess="
                "True) in this process can be exported")
        self._exported_events.add(ev)
        self._start_device_thread()
        return ev.export

    def open_event(self, handle: bytes) -> FakeEvent:
        try:
            magic, pid, fd, ident = _EVENT_HANDLE.unpack(bytes(handle))
        except struct.error:
            magic = b""
        if magic != _EVENT_MAGIC:
            raise FakeDeviceFault(
                "open_event: not a fake event handle (give what export_event returned)")
        if pid == self.pid:
            raise FakeDeviceFault(
                f"open_event: the handle is of an event of this process (pid {pid}); use the "
                "event itself")
        local = _open_peer_fd(pid, fd, "event")
        try:
            mm = mmap.mmap(local, PAGE)
            if mm[:8] != _EVENT_MAGIC or struct.unpack_from("<Q", mm, 8)[0] != ident:
                _close_map(mm)
                raise FakeDeviceFault(f"open_event: the handle of process {pid} names no "
                                      "event slot of it")
            self._register_importer(local, mm, ident, "open_event")
        except BaseException:
            os.close(local)
            raise
        event = FakeEvent(f"e{ident}@{pid}", True, np.frombuffer(mm, np.uint64, 3, 16),
                          imported=True, owner=pid)
        event.device = self.current_device()
        with self._lock:
            self._imported_events += 1
        # dropped without close_event: closed then, as CuPy's runtime destroys it
        event.finalizer = weakref.finalize(event, self._close_import, local, mm)
        return event

    def _close_import(self, fd: int, mm: mmap.mmap) -> None:
        self._unregister_importer(fd, mm)
        _close_map(mm)
        os.close(fd)
        with self._lock:
            self._imported_events -= 1

    def close_event(self, event: Event) -> None:
        ev = self._event(event)
        if ev.closed:
            raise FakeDeviceFault(f"close_event({ev.name}): it was closed already")
        if ev.imported:  # queued waits keep it (CUDA ends an event once its work is done)
            with ev.lock:
                ev.closed = True
                now = not ev.waits
            if now:
                assert ev.finalizer is not None
                ev.finalizer()
            return
        if ev.slot is not None:
            living = self._importers_of(ev.slot.fd, ev.slot.mm)
            if living:
                raise FakeDeviceFault(
                    f"close_event({ev.name}): process(es) {', '.join(map(str, living))} still "
                    "have this event open; they must close_event it first (an imported event "
                    "used after its exporter destroyed it is undefined on a GPU)")
        with ev.lock:
            ev.closed = True
            released = not ev.pending
        self._exported_events.discard(ev)
        if released:
            self._release_slot(ev)

    def _release_slot(self, ev: FakeEvent) -> None:
        """Give a destroyed interprocess event's slot back for the next event to take."""
        slot, ev.slot = ev.slot, None
        if slot is not None:
            ev.state = np.zeros(3, np.uint64)
            assert ev.finalizer is not None
            ev.finalizer.detach()
            with self._lock:
                self._free_slots.append(slot)

    def _start_device_thread(self) -> None:
        with self._lock:
            if self._device_thread is not None:
                return
            self._device_thread = threading.Thread(
                target=self._serve_demands, name="ringcomm-fake-device", daemon=True)
        self._device_thread.start()

    def _serve_demands(self) -> None:
        """The device thread: runs a recording stream as far as another process waits.
        Never blocks on a wait itself (a chain of waits through this process then keeps
        moving)."""
        sleep = _IDLE_POLL_S
        while True:
            busy = False
            for ev in list(self._exported_events):
                demanded = int(ev.state[2])
                if demanded > int(ev.state[1]):
                    busy = True
                    with ev.lock:
                        wanted = [g for g in ev.pending if g <= demanded]
                    for generation in sorted(wanted):
                        # a stream that faults keeps its fault; its next host wait raises it
                        with contextlib.suppress(FakeDeviceFault):
                            self._reach(ev, generation, False, math.inf, "the device thread")
            sleep = _POLL_S if busy else min(_IDLE_POLL_S, sleep * 2)
            time.sleep(sleep)

    # ------------------------------------------------------------------------ memory
    def _place(self, nbytes: int) -> int:
        base = self._next_address
        self._next_address += (max(nbytes, 1) + 2 * _GRAIN - 1) // _GRAIN * _GRAIN
        return base

    def _add(self, region: _Region) -> None:
        bisect.insort(self._bases, region.base)
        self._regions[region.base] = region

    def _remove(self, region: _Region, why: str) -> None:
        self._bases.remove(region.base)
        del self._regions[region.base]
        self._dead[region.base] = (region.end, why)
        bisect.insort(self._dead_bases, region.base)

    def malloc(self, nbytes: int) -> Allocation:
        self._drain_deferred()
        if not isinstance(nbytes, int) or nbytes < 0:
            raise FakeDeviceFault(f"malloc({nbytes!r}): give a number of bytes, 0 or more")
        with self._lock:
            ident = self._next_id
            self._next_id += 1
        size = PAGE + (nbytes + PAGE - 1) // PAGE * PAGE
        fd, mm = _memfd(f"ringcomm-fake-device-{ident}", size)
        mm[:8] = _MEM_MAGIC
        struct.pack_into("<QQQ", mm, 8, ident, nbytes, self.pid)
        data = np.frombuffer(mm, np.uint8, nbytes, PAGE)
        with self._lock:
            base = self._place(nbytes)
            self._add(_Region(base, nbytes, "allocation", fd, mm, ident, self.pid, data))
        return Allocation(base, nbytes, self.current_device())

    def malloc_mapped(self, nbytes: int) -> Allocation:
        """Device memory as ``cuMemCreate`` + ``cuMemMap`` make it (torch's expandable
        segments): used like any other, but without a CUDA IPC handle (``export_memory``
        refuses it, as ``cuIpcGetMemHandle`` takes memory of ``cuMemAlloc`` only)."""
        allocation = self.malloc(nbytes)
        with self._lock:
            self._regions[allocation.ptr].exportable = False
        return allocation

    def _find(self, ptr: int, nbytes: int, what: str) -> _Region:
        """The region holding ``nbytes`` at ``ptr``, or a fault saying why there is none."""
        with self._lock:
            at = bisect.bisect_right(self._bases, ptr) - 1
            region = self._regions[self._bases[at]] if at >= 0 else None
            if region is not None and ptr < region.end + (nbytes == 0):
                if ptr + nbytes > region.end:
                    raise FakeDeviceFault(
                        f"{what}: {nbytes} bytes at {ptr:#x} run past the end of the "
                        f"{region.nbytes}-byte {region.kind} at {region.base:#x} (by "
                        f"{ptr + nbytes - region.end} bytes)")
                return region
            at = bisect.bisect_right(self._dead_bases, ptr) - 1
            if at >= 0:
                dead = self._dead_bases[at]
                end, why = self._dead[dead]
                if ptr < end + (nbytes == 0):
                    raise FakeDeviceFault(
                        f"{what}: pointer {ptr:#x} lies in the {why} at {dead:#x}")
        raise FakeDeviceFault(
            f"{what}: pointer {ptr:#x} is not fake device memory of this process (no live "
            "allocation or open mapping covers it; a host address, or another process's "
            "pointer?)")

    def _view(self, ptr: int, nbytes: int, what: str) -> np.ndarray:
        region = self._find(ptr, nbytes, what)
        start = ptr - region.base
        return region.data[start:start + nbytes]

    def _typed(self, ptr: int, count: int, dtype: np.dtype, what: str) -> np.ndarray:
        return self._view(ptr, count * dtype.itemsize, what).view(dtype)

    def _settle(self, region: _Region) -> None:
        """Run the queued items that touch ``region`` (cudaFree waits for the device too)."""
        deadline = time.monotonic() + self.hang_timeout
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            with s.cond:
                last = 0
                for number, item in enumerate(s.queue, s.done + 1):
                    if any(p < region.end and p + n > region.base for p, n in item.touches):
                        last = number
            if last:
                self._advance(s, last, True, deadline)

    def _refuse_queued_work(self, allocation: Allocation, owner: int) -> None:
        """A ``FakeDeviceFault`` naming the work queued on streams other than ``owner``
        that still touches ``allocation`` (an array released while the device may still
        use it where stream order does not protect it)."""
        with self._lock:
            region = self._regions.get(allocation.ptr)
            streams = [s for s in self._streams.values() if s.handle != owner]
        if region is None:
            return
        queued = []
        for s in streams:
            with s.cond:
                queued += [f"{item.what} on stream {s.handle:#x}" for item in s.queue
                           if any(p < region.end and p + n > region.base
                                  for p, n in item.touches)]
        if queued:
            self._free(allocation)  # given back all the same, as a pool would
            raise FakeDeviceFault(
                f"an array's memory at {allocation.ptr:#x} was released (the array dropped "
                f"or closed) while queued device work still uses it: {', '.join(queued[:3])}"
                f"{' ...' if len(queued) > 3 else ''}; keep an array alive until the work "
                "queued on it is done (a pool allocator would hand its memory out again)")

    def _importers(self, region: _Region) -> list[int]:
        """Living processes still mapping ``region``."""
        return self._importers_of(region.fd, region.mm)

    @staticmethod
    def _importers_of(fd: int, mm: mmap.mmap) -> list[int]:
        """Living processes in the importer table of a memfd header (read under its lock)."""
        table = np.frombuffer(mm, np.uint64, 2 * _IMPORTER_SLOTS, _IMPORTERS_AT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            living = []
            for slot in range(_IMPORTER_SLOTS):
                pid, started = int(table[2 * slot]), int(table[2 * slot + 1])
                if pid and _start_time(pid) == started:
                    living.append(pid)
            return living
        finally:
            del table
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _register_importer(self, fd: int, mm: mmap.mmap, ident: int, what: str) -> None:
        """Add this process to a memfd header's importer table (once per open)."""
        table = np.frombuffer(mm, np.uint64, 2 * _IMPORTER_SLOTS, _IMPORTERS_AT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            for slot in range(_IMPORTER_SLOTS):
                pid = int(table[2 * slot])
                if not pid or _start_time(pid) != int(table[2 * slot + 1]):
                    table[2 * slot] = self.pid
                    table[2 * slot + 1] = _start_time(self.pid) or 0
                    return
            raise FakeDeviceFault(f"{what}: {ident} is open in {_IMPORTER_SLOTS} places "
                                  "already, the fake's limit")
        finally:
            del table
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _unregister_importer(self, fd: int, mm: mmap.mmap) -> None:
        """Take one entry of this process out of a memfd header's importer table."""
        table = np.frombuffer(mm, np.uint64, 2 * _IMPORTER_SLOTS, _IMPORTERS_AT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            for slot in range(_IMPORTER_SLOTS):
                if int(table[2 * slot]) == self.pid:
                    table[2 * slot] = 0
                    table[2 * slot + 1] = 0
                    return
        finally:
            del table
            fcntl.flock(fd, fcntl.LOCK_UN)

    def free(self, allocation: Allocation) -> None:
        self._drain_deferred()
        self._free(allocation)

    def _free(self, allocation: Allocation) -> None:
        ptr = allocation.ptr
        with self._lock:
            region = self._regions.get(ptr)
        if region is None or region.kind != "allocation":
            if ptr in self._dead and self._dead[ptr][1].startswith("allocation"):
                raise FakeDeviceFault(f"free({ptr:#x}): double free, it was freed already")
            raise FakeDeviceFault(
                f"free({ptr:#x}): not the base of an allocation made here by malloc "
                "(a mapping is given back with close_memory)")
        living = self._importers(region)
        if living:
            raise FakeDeviceFault(
                f"free({ptr:#x}): process(es) {', '.join(map(str, living))} still map this "
                "allocation; they must close_memory it first (freeing memory a peer maps "
                "is undefined on a GPU)")
        self._settle(region)
        with self._lock:
            self._remove(region, "allocation freed earlier")
        region.data = np.empty(0, np.uint8)
        _close_map(region.mm)
        os.close(region.fd)

    def free_soon(self, allocation: Allocation) -> None:
        """Free ``allocation`` at the next safe point (a finalizer may run anywhere,
        even inside this runtime)."""
        self._deferred.append((allocation, None))

    def release_soon(self, allocation: Allocation, stream: int) -> None:
        """Give an array's memory back as a pool allocator (CuPy's, torch's caching one)
        takes it back when the array is dropped: at once, without waiting for the device,
        for the next array made on ``stream`` (the handle of the stream it was made on) to
        reuse. Work queued on that stream runs before any such reuse, but work queued on
        another stream may not: at the next safe point, work still queued on another
        stream that uses the memory is a ``FakeDeviceFault`` (whoever queued it had to
        keep the array alive until it was done, as ringcomm's ``keep_until_done`` does)."""
        self._deferred.append((allocation, stream))

    def _drain_deferred(self) -> None:
        if not self._deferred or int(getattr(self._local, "depth", 0)):
            return
        while self._deferred:
            try:
                allocation, owner = self._deferred.pop()
            except IndexError:
                return
            if owner is not None:
                self._refuse_queued_work(allocation, owner)
            self._free(allocation)

    def export_memory(self, allocation: Allocation) -> bytes:
        with self._lock:
            region = self._regions.get(allocation.ptr)
        if region is None or region.kind != "allocation":
            raise FakeDeviceFault(
                f"export_memory({allocation.ptr:#x}): only the base of a live allocation "
                "made here by malloc can be exported")
        if not region.exportable:
            raise FakeDeviceFault(_NO_IPC_HANDLE.format(ptr=allocation.ptr))
        return _MEM_HANDLE.pack(_MEM_MAGIC, self.pid, region.fd, region.ident, region.nbytes)

    def export_user_memory(self, ptr: int) -> tuple[bytes, int, int]:
        try:
            region = self._find(ptr, 0, "export_user_memory")
        except FakeDeviceFault as err:
            raise ValueError(str(err)) from None
        if region.kind != "allocation":
            raise ValueError(f"export_user_memory({ptr:#x}): a mapping of process "
                             f"{region.owner}'s memory, not memory of this process")
        if not region.exportable:
            raise ValueError(_NO_IPC_HANDLE.format(ptr=ptr))
        return (_MEM_HANDLE.pack(_MEM_MAGIC, self.pid, region.fd, region.ident, region.nbytes),
                region.base, region.nbytes)

    def open_memory(self, handle: bytes) -> int:
        self._drain_deferred()
        try:
            magic, pid, fd, ident, nbytes = _MEM_HANDLE.unpack(bytes(handle))
        except struct.error:
            magic = b""
        if magic != _MEM_MAGIC:
            raise FakeDeviceFault(
                "open_memory: not a fake memory handle (give what export_memory returned)")
        if pid == self.pid:
            raise FakeDeviceFault(
                f"open_memory: the handle is of this process's own allocation {ident} (pid "
                f"{pid}); a process cannot open its own handle, use the allocation")
        key = (pid, ident)
        with self._lock:
            base = self._opened.get(key)
            if base:  # open here already: the same pointer, one more open (CUDA counts)
                self._opens[base] += 1
                return base
            if base is not None:
                raise FakeDeviceFault(f"open_memory: allocation {ident} of process {pid} is "
                                      "being opened on another thread right now")
            self._opened[key] = 0
        try:
            local = _open_peer_fd(pid, fd, "memory")
            try:
                size = os.fstat(local).st_size
                mm = mmap.mmap(local, size)
                if (mm[:8] != _MEM_MAGIC
                        or struct.unpack_from("<QQ", mm, 8) != (ident, nbytes)):
                    _close_map(mm)
                    raise FakeDeviceFault(
                        f"open_memory: the handle of process {pid} is stale (allocation "
                        f"{ident} was freed)")
                self._register_importer(local, mm, ident, "open_memory: allocation")
            except BaseException:
                os.close(local)
                raise
        except BaseException:
            with self._lock:
                del self._opened[key]
            raise
        data = np.frombuffer(mm, np.uint8, nbytes, PAGE)
        with self._lock:
            base = self._place(nbytes)
            self._add(_Region(base, nbytes, "mapping", local, mm, ident, pid, data))
            self._opened[key] = base
            self._opens[base] = 1
        return base

    def close_memory(self, ptr: int) -> None:
        self._drain_deferred()
        with self._lock:
            region = self._regions.get(ptr)
        if region is None or region.kind != "mapping":
            why = ""
            if ptr in self._dead:
                why = f" ({self._dead[ptr][1]})"
            elif region is not None:
                why = " (it is an allocation of this process: free it)"
            raise FakeDeviceFault(
                f"close_memory({ptr:#x}): no mapping opened with open_memory starts "
                f"there{why}")
        with self._lock:
            opens = self._opens[ptr]
            if opens > 1:  # CUDA counts opens: only the last close unmaps
                self._opens[ptr] = opens - 1
                return
        self._settle(region)
        self._unregister_importer(region.fd, region.mm)
        with self._lock:
            self._remove(region, f"mapping of process {region.owner}'s memory closed earlier")
            del self._opened[(region.owner, region.ident)]
            del self._opens[ptr]
        region.data = np.empty(0, np.uint8)
        _close_map(region.mm)
        os.close(region.fd)

    def live_allocations(self) -> int:
        self._drain_deferred()
        with self._lock:
            mapped_again = sum(self._opens.values()) - len(self._opens)
            return (len(self._regions) + mapped_again + self._imported_events
                    + len(self._registered))

    def host_register(self, address: int, nbytes: int) -> None:
        if address <= 0 or nbytes <= 0:
            raise FakeDeviceFault(
                f"host_register({address:#x}, {nbytes}): give a mapped host address and a "
                "positive size")
        with self._lock:
            for start, size in self._registered.items():
                if start < address + nbytes and address < start + size:
                    raise FakeDeviceFault(
                        f"host_register({address:#x}, {nbytes}): overlaps the range "
                        f"{start:#x}+{size} registered already")
            self._registered[address] = nbytes

    def registered(self) -> dict[int, int]:
        """The host ranges page-locked now, address -> bytes (what a test looks at)."""
        with self._lock:
            return dict(self._registered)

    def host_unregister(self, address: int) -> None:
        with self._lock:
            if self._registered.pop(address, None) is None:
                raise FakeDeviceFault(
                    f"host_unregister({address:#x}): no range registered with host_register "
                    "starts there")

    # ------------------------------------------------------------------------ work
    def copy(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        what = f"copy of {nbytes} bytes {src:#x} -> {dst:#x}"
        self._find(src, nbytes, what)
        self._find(dst, nbytes, what)

        def run() -> None:
            self._view(dst, nbytes, what)[:] = self._view(src, nbytes, what)

        self._queue(stream, _Work("copy", run, ((dst, nbytes), (src, nbytes))))

    def to_host(self, dst: np.ndarray, src: int, stream: Stream) -> None:
        if not isinstance(dst, np.ndarray) or not dst.flags.c_contiguous or not dst.flags.writeable:
            raise FakeDeviceFault("to_host: dst must be a writable, contiguous numpy array")
        nbytes = dst.nbytes
        what = f"to_host of {nbytes} bytes from {src:#x}"
        self._find(src, nbytes, what)
        flat = dst.reshape(-1).view(np.uint8)

        def run() -> None:
            flat[:] = self._view(src, nbytes, what)

        self._queue(stream, _Work("to_host", run, ((src, nbytes),), keep=dst))

    def from_host(self, dst: int, src: np.ndarray, stream: Stream) -> None:
        if not isinstance(src, np.ndarray) or not src.flags.c_contiguous:
            raise FakeDeviceFault("from_host: src must be a contiguous numpy array")
        nbytes = src.nbytes
        what = f"from_host of {nbytes} bytes to {dst:#x}"
        self._find(dst, nbytes, what)
        flat = src.reshape(-1).view(np.uint8)

        def run() -> None:  # reads src now, as a device copy reads it when it runs
            self._view(dst, nbytes, what)[:] = flat

        self._queue(stream, _Work("from_host", run, ((dst, nbytes),), keep=src))

    def reduce(self, dst: int, a: int, b: int, count: int, dtype: np.dtype, op: ReduceOp,
               stream: Stream) -> None:
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        what = f"reduce ({op.name}, {count} x {dtype}) into {dst:#x}"
        self._kernel_on(stream, what)
        for ptr in (dst, a, b):
            self._find(ptr, nbytes, what)

        def run() -> None:
            reduce_into(self._typed(dst, count, dtype, what), self._typed(a, count, dtype, what),
                        self._typed(b, count, dtype, what), op)

        self._queue(stream, _Work("reduce", run, ((dst, nbytes), (a, nbytes), (b, nbytes))))

    def finish(self, ptr: int, count: int, dtype: np.dtype, op: ReduceOp, world_size: int,
               stream: Stream) -> None:
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        what = f"finish ({op.name}, {count} x {dtype}) at {ptr:#x}"
        self._kernel_on(stream, what)
        self._find(ptr, nbytes, what)

        def run() -> None:
            finish_reduction(self._typed(ptr, count, dtype, what), op, world_size)

        self._queue(stream, _Work("finish", run, ((ptr, nbytes),)))

    # ------------------------------------------------------------------------ arrays
    def zeros(self, count: int, dtype: Any) -> FakeDeviceArray:
        return FakeDeviceArray.from_host(np.zeros(count, dtype=dtype), runtime=self)


# ----------------------------------------------------------------------------- arrays


class FakeDeviceArray:
    """An array in the fake runtime's device memory (its own allocation). The host sees its
    values only through ``to_host()``; ``np.asarray`` raises.

    Example::

        x = FakeDeviceArray.from_host(np.arange(4.0))   # queued on the current stream
        comm.allreduce(x)
        x.to_host()                                      # synchronizes, then copies
    """

    __slots__ = ("runtime", "allocation", "shape", "dtype", "offset", "base", "_finalizer",
                 "__weakref__")

    def __init__(self, shape: tuple[int, ...] | int, dtype: Any,
                 runtime: FakeRuntime | None = None, *, mapped: bool = False) -> None:
        rt = runtime if runtime is not None else _default_runtime()
        self.runtime = rt
        self.shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.offset = 0
        self.base: FakeDeviceArray | None = None
        self.allocation = rt.malloc_mapped(self.nbytes) if mapped else rt.malloc(self.nbytes)
        # given back as a pool does, for reuse on the stream current now (release_soon)
        self._finalizer: weakref.finalize[Any, Any] | None = weakref.finalize(
            self, rt.release_soon, self.allocation, rt.current_stream().handle)

    def block(self, offset: int, shape: tuple[int, ...] | int, dtype: Any) -> FakeDeviceArray:
        """An array of its own in this one's memory, ``offset`` bytes in, as a caching
        allocator hands out blocks of one segment (a block's pointer is no allocation's
        base): it keeps this array alive, and its memory is freed with this one's."""
        block = object.__new__(FakeDeviceArray)
        block.runtime, block.allocation, block._finalizer = self.runtime, self.allocation, None
        block.shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
        block.dtype = np.dtype(dtype)
        block.offset, block.base = self.offset + offset, self
        if offset < 0 or offset + block.nbytes > self.nbytes:
            raise ValueError(f"a block of {block.nbytes} B at {offset} does not fit in "
                             f"{self.nbytes} B")
        return block

    @classmethod
    def empty(cls, shape: tuple[int, ...] | int, dtype: Any,
              runtime: FakeRuntime | None = None) -> FakeDeviceArray:
        """Uninitialised device memory (zeros, in fact: fresh memfd pages)."""
        return cls(shape, dtype, runtime)

    @classmethod
    def from_host(cls, values: Any, runtime: FakeRuntime | None = None, *,
                  dtype: Any = None) -> FakeDeviceArray:
        """A device array holding a copy of ``values``, queued on the calling thread's
        current stream (the host copy stays alive until the copy runs)."""
        host = np.ascontiguousarray(np.array(values, dtype=dtype))
        arr = cls(host.shape, host.dtype, runtime)
        rt = arr.runtime
        rt.from_host(arr.ptr, host, rt.current_stream())
        return arr

    @property
    def ptr(self) -> int:
        return self.allocation.ptr + self.offset

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def to_host(self) -> np.ndarray:
        """The values, once the calling thread's current stream has done its work."""
        out = np.empty(self.shape, self.dtype)
        rt = self.runtime
        stream = rt.current_stream()
        rt.to_host(out, self.ptr, stream)
        rt.synchronize(stream)
        return out

    def close(self) -> None:
        """Give the device memory back now, as dropping the array does (the runtime's
        ``release_soon``: work still queued on it is a fault); a block's goes with the array
        it lies in."""
        if self._finalizer is None:
            raise ValueError("a block's memory is given back with the array it lies in")
        self._finalizer()
        self.runtime.live_allocations()  # a safe point: the free happens here

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(
            "a FakeDeviceArray lives in (fake) device memory and the host cannot read it "
            "directly; use .to_host() for a copy")

    def __repr__(self) -> str:
        return f"FakeDeviceArray(shape={self.shape}, dtype={self.dtype}, ptr={self.ptr:#x})"


def _default_runtime() -> FakeRuntime:
    from ..core.device import runtime

    rt = runtime("fake")
    assert isinstance(rt, FakeRuntime)
    return rt
