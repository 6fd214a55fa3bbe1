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
- ``DeviceBuffer``, for memory it does not address (a device), as it is: what an engine that
  moves that memory would take, and what ``staged_for`` stages for the others.
- ``StagedBuffer``, a device buffer staged for host memory: a host mirror of the whole
  buffer. ``before_op`` waits for the device work that produces the array, then copies it
  into the mirror if the op reads it; ``after_op`` copies the mirror back if the op writes
  it, then records that the result is there, so later device work can wait for it. When an
  op fails, ``after_op`` is not called and the device memory keeps its old values. Whole
  buffers keep the executor unaware of devices, at a price: the copies do not overlap the
  wire (staging region by region would need the executor to say which regions it reads and
  which it writes).

An ``ArrayKind`` turns one type of array into a buffer, or says clearly why it cannot;
``register`` adds one and ``as_buffer`` finds it. numpy and torch CPU are registered here
(torch by duck typing: it is never imported here). A device kind is a ``DeviceKind``: a
check (``layout``), the producer to wait for, taken on the caller's thread when the op is
issued (what a CUDA kind takes from the current stream), and ``wait_for``, ``to_host``,
``from_host`` and ``record``. ``ringcomm.core.fake_device`` is one, so a CuPy or torch CUDA
kind is the same few methods and changes neither the algorithms nor the executor.
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Sequence
from typing import Any

# numpy first: without it, ml_dtypes fails with an ImportError that names no module
import numpy as np  # isort: split

import ml_dtypes

from ..errors import ArgumentError
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


class DeviceBuffer(Buffer):
    """A device array as it is (see the module docstring): its kind, the array, what the op
    does with it, and the producer taken when the op was issued (on the caller's thread).
    An engine that moves its memory takes it as it is; for the others ``staged_for`` makes
    the host mirror. Until a device engine exists, every op stages it."""

    __slots__ = ("kind", "array", "reads", "writes", "producer")

    def __init__(self, kind: DeviceKind, array: Any, name: str, dtype: np.dtype, count: int,
                 *, reads: bool, writes: bool) -> None:
        self.kind = kind
        self.array = array
        self.name = name
        self.dtype = dtype
        self.count = count
        self.nbytes = count * dtype.itemsize
        self.reads = reads
        self.writes = writes
        self.producer = kind.producer(array)

    @property
    def memory(self) -> str:  # type: ignore[override]  # the kind's, not the class's
        return self.kind.memory

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


class StagedBuffer(HostBuffer):
    """A device buffer staged for host memory (see the module docstring): regions, copies and
    reductions work on a host mirror of all of it; the hooks move it."""

    __slots__ = ("_device",)

    def __init__(self, device: DeviceBuffer) -> None:
        super().__init__(np.empty(device.count, device.dtype), device.name)
        self._device = device

    def before_op(self) -> None:
        device = self._device
        device.kind.wait_for(device.array, device.producer)
        if device.reads:
            device.kind.to_host(device.array, self._host)

    def after_op(self) -> None:
        device = self._device
        if device.writes:
            device.kind.from_host(device.array, self._host)
        device.kind.record(device.array)


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
    """Arrays in memory the host cannot address (``memory`` names it): buffers are
    ``DeviceBuffer`` objects, staged through host memory for engines that move host memory."""

    memory = "device"

    def buffer(self, x: Any, name: str, writable: bool, reads: bool) -> Buffer:
        dtype, count = self.layout(x, name)
        return DeviceBuffer(self, x, name, dtype, count, reads=reads, writes=writable)

    @abc.abstractmethod
    def layout(self, x: Any, name: str) -> tuple[np.dtype, int]:
        """``x``'s element dtype (as numpy names it) and element count; an
        ``ArgumentError`` for what this kind cannot move."""

    def producer(self, x: Any) -> Any:
        """Taken when the op is issued, on the caller's thread: what ``wait_for`` waits for
        (a CUDA kind: an event recorded on the current stream). None by default."""
        return None

    @abc.abstractmethod
    def wait_for(self, x: Any, producer: Any) -> None:
        """Return once the work that ``producer`` stands for has written ``x``."""

    @abc.abstractmethod
    def to_host(self, x: Any, out: np.ndarray) -> None:
        """Copy all of ``x`` into ``out`` (1-D, host memory), finished on return."""

    @abc.abstractmethod
    def from_host(self, x: Any, src: np.ndarray) -> None:
        """Copy ``src`` (1-D, host memory) into all of ``x``."""

    @abc.abstractmethod
    def record(self, x: Any) -> None:
        """Mark the op done with ``x``: later work that reads ``x`` waits for this point."""


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
_numpy_first = True


def register(kind: ArrayKind) -> None:
    """Accept ``kind``'s arrays from now on, in every communicator."""
    global _numpy_first
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
    accepted = " or ".join(kind.noun for kind in reversed(_KINDS))
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


