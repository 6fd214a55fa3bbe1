"""The buffer protocol: what an engine needs of an array, whatever kind of array it is.

The communicator turns every array argument into a ``Buffer`` with ``as_buffer``; the
engines and the point-to-point engine use nothing else of it:

    before_op()                    once, before the op reads or writes the buffer
    address, dtype, count, nbytes  where its host memory starts (to tell which pending sends
                                   read a region about to be written) and how much there is
    region(offset, count)          a 1-D numpy view of host memory to send from or receive into
    copy(dst, src)                 ``dst[:] = src``, both views of regions
    reduce_into(dst, a, payload, op, divide_by)
                                   ``dst = a (op) payload``, then ``avg``'s division
    after_op()                     once, after the op is done with it (only if it succeeded)

A buffer says where its memory lives (``memory``: ``HOST`` for memory the CPU addresses, a
device's name otherwise), and an engine or link says which memory it moves. A buffer whose
memory an engine does not move is staged for it by its kind (``staged_for``), once per op:
that is the kind's job, not the caller's. Three buffers cover every kind of array:

- ``HostBuffer``, for memory the CPU addresses (numpy arrays, torch CPU tensors): regions
  are views of the caller's memory, so results land in place without a copy, and the hooks
  do nothing.
- ``DeviceBuffer``, for memory in a device runtime (``ringcomm.core.device.runtime``), as
  it is: what a device engine takes (a pointer, the runtime, the producer event recorded on
  the caller's stream at issue, the caller's stream to order the results on), and what
  ``staged_for`` stages for the others.
- ``StagedBuffer``, a device buffer staged for host memory: a host mirror of the whole
  buffer, moved by the runtime on a staging stream. ``before_op`` waits for the producer,
  then copies the array into the mirror if the op reads it; ``after_op`` copies the mirror
  back if the op writes it and makes the caller's stream wait for that copy. When an op
  fails, ``after_op`` is not called and the device memory keeps its old values. Whole
  buffers keep the executor unaware of devices, at a price: the copies do not overlap the
  wire (the device engines do better).

An ``ArrayKind`` turns one type of array into a buffer, or says clearly why it cannot;
``register`` adds one and ``as_buffer`` finds it. numpy and torch CPU are registered here
(torch by duck typing: it is never imported here). A device kind is a ``DeviceKind``, which
only says where an array is (``layout``: runtime, pointer, dtype, count, device, stream);
``ringcomm.core.device.kinds`` has them and registers them.
"""

from __future__ import annotations

import abc
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# numpy first: without it, ml_dtypes fails with an ImportError that names no module
import numpy as np  # isort: split

import ml_dtypes

from ..errors import ArgumentError
from .device.runtime import DeviceRuntime, Event, Stream
from .dtypes import ReduceOp, dtype_code, finish_reduction, reduce_into

HOST = "host"  # memory the CPU addresses
HOST_ONLY = frozenset({HOST})  # what an engine or link that moves host memory says it moves


class Buffer(abc.ABC):
    """``count`` elements of ``dtype`` as the executor sees them (see the module docstring).

    Made for one op and used by it only: the hooks run once each.
    """

    __slots__ = ("name", "dtype", "count", "nbytes")

    name: str
    dtype: np.dtype
    count: int
    nbytes: int
    memory = HOST  # where its memory lives

    def staged_for(self, moves: frozenset[str]) -> Buffer:
        """This buffer as an engine that moves ``moves`` takes it: itself where it moves this
        buffer's memory, else a staged copy its kind makes (once per op)."""
        if self.memory in moves:
            return self
        raise ArgumentError(f"{self.name} lives in {self.memory} memory, which this engine "
                            f"does not move ({', '.join(sorted(moves))}), and its kind cannot "
                            "stage it")

    @property
    @abc.abstractmethod
    def address(self) -> int:
        """Where the memory that ``region`` views starts: two regions whose byte ranges from
        here do not overlap never share memory."""

    @abc.abstractmethod
    def region(self, offset: int, count: int) -> np.ndarray:
        """Elements ``[offset, offset + count)`` as a 1-D numpy view of host memory."""

    @abc.abstractmethod
    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src`` (a region of any buffer of the op) into ``dst``, a region of this one."""

    @abc.abstractmethod
    def reduce_into(self, dst: np.ndarray, a: np.ndarray, payload: Any, op: ReduceOp,
                    divide_by: int = 1) -> None:
        """``dst = a (op) payload`` for a result meant for a region of this buffer: ``dst``
        is that region, or the transport's outgoing message standing in for it. ``divide_by``
        is the world size where this completes the region's reduction (``avg`` divides)."""

    @abc.abstractmethod
    def before_op(self) -> None:
        """Make the array's current values readable through ``region``."""

    @abc.abstractmethod
    def after_op(self) -> None:
        """Make what the op wrote through ``region`` the array's values, visible to whoever
        reads the array next."""


class HostBuffer(Buffer):
    """A buffer over host memory: every region is a view of ``host`` (no copies)."""

    __slots__ = ("_host",)

    def __init__(self, host: np.ndarray, name: str = "x") -> None:
        self._host = host
        self.name = name
        self.dtype = host.dtype
        self.count = host.size
        self.nbytes = host.nbytes

    @property
    def address(self) -> int:
        return self._host.ctypes.data

    @property
    def whole(self) -> np.ndarray:
        """All of the buffer (1-d): ``region(0, count)`` without making a view."""
        return self._host

    def region(self, offset: int, count: int) -> np.ndarray:
        return self._host[offset: offset + count]

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def reduce_into(self, dst: np.ndarray, a: np.ndarray, payload: Any, op: ReduceOp,
                    divide_by: int = 1) -> None:
        reduce_into(dst, a, payload, op)
        if divide_by > 1:
            finish_reduction(dst, op, divide_by)

    def before_op(self) -> None:
        pass

    def after_op(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {self.count} x {self.dtype}>"


@dataclass(frozen=True)
class DeviceLayout:
    """What a device kind reads off one of its arrays (``DeviceKind.layout``): the runtime
    whose memory holds it, the device pointer of element 0, the element dtype (as numpy
    names it) and count, and the stream the caller's work on it is queued on (None: the
    runtime's current stream on the calling thread)."""

    runtime: DeviceRuntime
    pointer: int
    dtype: np.dtype
    count: int
    device: int
    stream: Stream | None = None


class DeviceBuffer(Buffer):
    """A device array as it is (see the module docstring), for one op: where it is
    (``runtime``, ``pointer``, ``device``), what the op does with it (``reads``, ``writes``),
    and how the op is ordered against the caller, as CUDA orders work:

    - ``producer``: an event recorded on ``caller_stream`` when the op was issued (on the
      caller's thread): whatever reads or writes the array waits for it first.
    - ``caller_stream``: the stream the caller's work on the array is queued on; whoever
      finishes the op makes it wait for the op's last work on the array, and sets ``done``
      to that point (an event), which the torch backend's ``Work.wait`` uses.
    - ``then``: work the caller wants queued on ``caller_stream`` once the op is done there
      (copying a joined list of tensors back into each, say), called by whoever finishes
      the op with the buffer; it returns the event recorded after that work, which becomes
      ``done``.

    An engine that moves its memory takes it as it is; for the others ``staged_for`` makes
    the host mirror."""

    __slots__ = ("array", "runtime", "pointer", "device", "reads", "writes", "producer",
                 "caller_stream", "done", "then", "_staging")

    def __init__(self, array: Any, layout: DeviceLayout, name: str, *, reads: bool,
                 writes: bool) -> None:
        runtime = layout.runtime
        self.array = array
        self.runtime = runtime
        self.pointer = layout.pointer
        self.device = layout.device
        self.name = name
        self.dtype = layout.dtype
        self.count = layout.count
        self.nbytes = layout.count * layout.dtype.itemsize
        self.reads = reads
        self.writes = writes
        stream = layout.stream if layout.stream is not None else runtime.current_stream()
        self.caller_stream = stream
        self.producer = runtime.new_event()
        runtime.record(self.producer, stream)
        self.done: Event | None = None
        self.then: Callable[[DeviceBuffer], Event] | None = None
        # made here, on the caller's thread, whose current device is the array's
        self._staging = staging_stream(runtime, layout.device, stream)

    @property
    def memory(self) -> str:  # type: ignore[override]  # the runtime's, not the class's
        return self.runtime.memory

    def staged_for(self, moves: frozenset[str]) -> Buffer:
        if self.memory in moves:
            return self
        return StagedBuffer(self)

    def _device_only(self) -> Any:
        raise TypeError(f"{self.name} is in {self.memory} memory: an engine that moves host "
                        "memory takes its staged_for() copy")

    @property
    def address(self) -> int:
        return int(self._device_only())

    def region(self, offset: int, count: int) -> np.ndarray:
        return self._device_only()

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        self._device_only()

    def reduce_into(self, dst: np.ndarray, a: np.ndarray, payload: Any, op: ReduceOp,
                    divide_by: int = 1) -> None:
        self._device_only()

    def before_op(self) -> None:
        self._device_only()

    def after_op(self) -> None:
        self._device_only()

    def __repr__(self) -> str:
        return f"<DeviceBuffer {self.name}: {self.count} x {self.dtype} in {self.memory}>"


# (id of the runtime, device, handle of the caller's stream) -> the staging stream
_STAGING: dict[tuple[int, int, int], Stream] = {}
_STAGING_LOCK = threading.Lock()


def staging_stream(runtime: DeviceRuntime, device: int, caller: Stream) -> Stream:
    """The stream that staging copies of arrays on ``device`` whose work is queued on
    ``caller`` run on: made on first use by the calling thread (whose current device must be
    ``device``). Apart from the caller's stream, so that staging waits only for what the
    producer event covers; one per caller's stream, so that callers on different streams
    (threads, or ranks in one process) do not wait for each other's copies."""
    key = (id(runtime), device, caller.handle)
    stream = _STAGING.get(key)
    if stream is None:
        with _STAGING_LOCK:
            stream = _STAGING.get(key)
            if stream is None:
                stream = _STAGING[key] = runtime.new_stream()
    return stream


class _InFlight:
    """Objects that queued device work still uses (a host mirror being copied to the
    device, the device array it is copied into), each kept referenced until its event is
    surely done. Nothing polls the events (a poll is a question to the device on every
    op); instead, past ``LIMIT`` entries or ``LIMIT_BYTES`` of host mirrors held, the oldest
    is waited for and let go, which by then has long finished on a real device."""

    LIMIT = 64
    LIMIT_BYTES = 64 << 20

    def __init__(self) -> None:
        self._held: deque[tuple[DeviceRuntime, Event, int, tuple[Any, ...]]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()

    def hold(self, runtime: DeviceRuntime, event: Event, nbytes: int, *objects: Any) -> None:
        with self._lock:
            self._held.append((runtime, event, nbytes, objects))
            self._bytes += nbytes
        while True:
            with self._lock:
                if len(self._held) <= self.LIMIT and self._bytes <= self.LIMIT_BYTES:
                    return
                oldest = self._held.popleft()
                self._bytes -= oldest[2]
            oldest[0].event_synchronize(oldest[1])

    def let_go_done(self, runtime: DeviceRuntime) -> None:
        """Let go of what ``runtime``'s finished work held (a communicator's close, once its
        streams are done): a user's array is not kept alive past the group that used it."""
        with self._lock:
            held = list(self._held)
        finished = {id(entry) for entry in held
                    if entry[0] is runtime and runtime.event_done(entry[1])}
        if not finished:
            return
        with self._lock:
            kept = deque(entry for entry in self._held if id(entry) not in finished)
            self._bytes = sum(entry[2] for entry in kept)
            self._held = kept

    def __len__(self) -> int:
        return len(self._held)


IN_FLIGHT = _InFlight()


def keep_until_done(runtime: DeviceRuntime, event: Event, nbytes: int, *objects: Any) -> None:
    """Keep ``objects`` (``nbytes`` of host memory among them) referenced until the latest
    record of ``event`` (made on a stream of ``runtime``) is done: what queued device work
    reads or writes must outlive it."""
    IN_FLIGHT.hold(runtime, event, nbytes, *objects)


class StagedBuffer(HostBuffer):
    """A device buffer staged for host memory (see the module docstring): regions, copies and
    reductions work on a host mirror of all of it; the hooks move it, on the staging
    stream of the array's runtime and device (``staging_stream``).

    ``before_op`` makes the staging stream wait for the producer, and, if the op reads the
    array, copies it into the mirror and blocks until the copy is done (the executor reads
    the mirror next). ``after_op``, if the op wrote the array, queues the copy back, records
    ``done`` after it and makes the caller's stream wait for it: the host does not block,
    and the mirror and the array are kept referenced until ``done`` (``keep_until_done``)
    rather than waited for, since nothing on the host needs the copy finished."""

    __slots__ = ("_device",)

    def __init__(self, device: DeviceBuffer) -> None:
        super().__init__(np.empty(device.count, device.dtype), device.name)
        self._device = device

    def before_op(self) -> None:
        device = self._device
        runtime, stream = device.runtime, device._staging
        runtime.wait_event(stream, device.producer)
        if device.reads:
            runtime.to_host(self._host, device.pointer, stream)
            runtime.synchronize(stream)

    def after_op(self) -> None:
        device = self._device
        if not device.writes:
            return  # read on the host before the op went on: nothing left on the device
        runtime, stream = device.runtime, device._staging
        runtime.from_host(device.pointer, self._host, stream)
        done = runtime.new_event()
        runtime.record(done, stream)
        runtime.wait_event(device.caller_stream, done)
        device.done = done
        keep_until_done(runtime, done, device.nbytes, self._host, device.array)
        if device.then is not None:  # the caller's own work after the op, as on a device
            device.done = device.then(device)


# --------------------------------------------------------------------------- kinds


class ArrayKind(abc.ABC):
    """One type of array that the communicator accepts."""

    noun = "an array"  # what an error calls it: "x must be a numpy array or ..."

    @abc.abstractmethod
    def owns(self, x: Any) -> bool:
        """Whether ``x`` is of this kind; if so, this kind's ``buffer`` takes or refuses it."""

    @abc.abstractmethod
    def buffer(self, x: Any, name: str, writable: bool, reads: bool) -> Buffer:
        """``x`` as a buffer, or an ``ArgumentError`` that says what to pass instead."""


class HostKind(ArrayKind):
    """Arrays in host memory: a buffer is a flat view of the array itself."""

    def buffer(self, x: Any, name: str, writable: bool, reads: bool) -> Buffer:
        return HostBuffer(self.flat_view(x, name, writable), name)

    @abc.abstractmethod
    def flat_view(self, x: Any, name: str, writable: bool) -> np.ndarray:
        """A 1-D numpy view sharing memory with ``x``; refuses what cannot be viewed without
        a copy, because results written into a copy would be lost silently."""


class DeviceKind(ArrayKind):
    """Arrays in a device runtime's memory, which the host cannot address: buffers are
    ``DeviceBuffer`` objects, staged through host memory for engines that move host memory.
    A kind only says where an array is (``layout``); the buffer does the rest through the
    runtime. ``ringcomm.core.device.kinds`` has the kinds (CuPy, torch CUDA, the
    ``__cuda_array_interface__`` and DLPack protocols, the fake runtime's arrays)."""

    def buffer(self, x: Any, name: str, writable: bool, reads: bool) -> Buffer:
        return DeviceBuffer(x, self.layout(x, name, writable), name, reads=reads,
                            writes=writable)

    @abc.abstractmethod
    def layout(self, x: Any, name: str, writable: bool) -> DeviceLayout:
        """Where ``x`` is and what it holds; an ``ArgumentError`` for what this kind cannot
        move (saying what to pass instead). Called on the caller's thread when the op is
        issued."""


class NumpyKind(HostKind):
    noun = "a numpy array"

    def owns(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def flat_view(self, x: np.ndarray, name: str, writable: bool) -> np.ndarray:
        flags = x.flags
        if not flags.c_contiguous:
            raise ArgumentError(
                f"{name} is not contiguous; pass np.ascontiguousarray({name}) and copy results "
                "back")
        if writable and not flags.writeable:
            raise ArgumentError(f"{name} is read-only but the op writes its result into it")
        dtype_code(x.dtype)
        return x if x.ndim == 1 else x.reshape(-1)


class TorchCPUKind(HostKind):
    """torch tensors, recognised without importing torch; bfloat16 is viewed as
    ``ml_dtypes.bfloat16``. Tensors on a device are refused here unless a kind for them is
    registered (CUDA's is, in ``ringcomm.core.tensors``)."""

    noun = "a torch CPU tensor"

    def owns(self, x: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(x, torch.Tensor)

    def flat_view(self, t: Any, name: str, writable: bool) -> np.ndarray:
        import torch  # already imported, or ``t`` would not be a tensor

        if not t.is_cpu:
            raise ArgumentError(
                f"{name} is on {t.device}; Communicator takes host memory and CUDA tensors: "
                f"copy it with {name}.cpu() (and back after the op), or use the torch backend "
                "(dist.init_process_group('ringcomm')), which copies other tensors itself")
        if t.layout is not torch.strided:  # sparse, MKL-DNN: no memory of its own to view
            raise ArgumentError(f"{name} is a {t.layout} tensor; Communicator takes dense "
                                f"tensors: pass {name}.to_dense()")
        if not t.is_contiguous():
            raise ArgumentError(
                f"{name} is not contiguous; pass {name}.contiguous() and copy results back")
        if t.requires_grad:
            t = t.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().reshape(-1).view(ml_dtypes.bfloat16)
        try:
            arr = t.numpy()
            if arr.ndim != 1:
                arr = arr.reshape(-1)  # numpy's reshape: a fraction of torch's cost
        except TypeError:
            raise ArgumentError(f"{name} has dtype {t.dtype}, which is not supported") from None
        dtype_code(arr.dtype)
        return arr


# Asked newest first, so a kind registered later can take a type that an earlier one
# refuses (a torch CUDA kind, tensors that the torch CPU kind turns away). A plain numpy
# array goes to the numpy kind without asking the others while no registered kind claims
# numpy arrays (``_numpy_first``).
_NUMPY = NumpyKind()
_KINDS: list[ArrayKind] = [TorchCPUKind(), _NUMPY]
_FALLBACKS: list[ArrayKind] = []  # the protocol kinds, at the end of _KINDS too
_numpy_first = True


def register(kind: ArrayKind, *, fallback: bool = False) -> None:
    """Accept ``kind``'s arrays from now on, in every communicator. A ``fallback`` kind (one
    that recognises a protocol many types speak, such as ``__dlpack__``) is asked after every
    other, so the arrays of a kind of their own (numpy, torch) never pay for its checks."""
    global _numpy_first
    if fallback:
        _KINDS.append(kind)
        _FALLBACKS.append(kind)
    else:
        _KINDS.insert(0, kind)
        _numpy_first = _numpy_first and not kind.owns(np.empty(0))


def kinds() -> tuple[ArrayKind, ...]:
    """The registered kinds, in the order ``as_buffer`` asks them."""
    return tuple(_KINDS)


def as_buffer(x: Any, *, name: str = "x", writable: bool = True, reads: bool = True) -> Buffer:
    """``x`` as a buffer of its kind, for one op.

    ``writable``: the op writes results into ``x``. ``reads``: the op reads the values ``x``
    holds (False for an output the op only fills, which a device kind then does not copy
    in). Anything no kind takes is refused with an ``ArgumentError`` naming ``name``. A
    ``Buffer`` already made (by a layer above that has checked its array) is taken as it is.
    """
    if type(x) is HostBuffer:
        return x
    if type(x) is np.ndarray and _numpy_first and (reads or writable):  # the commonest
        return HostBuffer(_NUMPY.flat_view(x, name, writable), name)
    if isinstance(x, Buffer):
        return x
    if not (reads or writable):
        raise ValueError("a buffer that the op neither reads nor writes has no use")
    for kind in _KINDS:
        if kind.owns(x):
            return kind.buffer(x, name, writable, reads)
    own = [kind for kind in reversed(_KINDS) if kind not in _FALLBACKS]  # oldest first
    accepted = " or ".join(kind.noun for kind in own + _FALLBACKS)
    raise ArgumentError(f"{name} must be {accepted}, got {type(x).__name__}")


class Concatenated(HostBuffer):
    """Several buffers laid end to end in host memory of their own, as one buffer: for an op
    that takes a list of arrays (a scatter's inputs, an all-gather into a list). The parts
    are copied in when it is made (if the op reads them) and copied back into each part
    after the op (if it writes them); each part is staged by its own kind on the way."""

    __slots__ = ("_parts", "_writes", "_open")

    def __init__(self, parts: Sequence[Buffer], name: str, *, reads: bool = True,
                 writes: bool = False) -> None:
        if not parts:
            raise ArgumentError(f"{name} is empty")
        dtypes = {p.dtype for p in parts}
        if len(dtypes) > 1:
            raise ArgumentError(f"{name} holds arrays of several dtypes ("
                                f"{', '.join(sorted(map(str, dtypes)))}); they must share one")
        super().__init__(np.empty(sum(p.count for p in parts), parts[0].dtype), name)
        self._parts = [p.staged_for(HOST_ONLY) for p in parts]
        self._writes = writes
        self._open = reads  # the parts' before_op has run (they were read now)
        if reads:
            offset = 0
            for part in self._parts:
                part.before_op()
                self._host[offset: offset + part.count] = part.region(0, part.count)
                if not writes:
                    part.after_op()
                offset += part.count

    def before_op(self) -> None:
        if self._writes and not self._open:
            for part in self._parts:
                part.before_op()

    def after_op(self) -> None:
        if self._writes:
            offset = 0
            for part in self._parts:
                part.copy(part.region(0, part.count), self._host[offset: offset + part.count])
                part.after_op()
                offset += part.count


