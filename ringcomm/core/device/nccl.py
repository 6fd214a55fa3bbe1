"""The NCCL seam: the few NCCL calls ringcomm makes, behind one interface.

Why a seam: the NCCL engine (``ringcomm.engines.nccl``) runs ringcomm's own schedules as
NCCL sends and receives in group calls, and NCCL's own collectives as one more algorithm;
it needs a communicator, group calls, point-to-point calls, the collectives, and a way to
end a communicator that hangs. Behind this interface (``ringcomm.core.device.nccl_library``
gives a runtime's): CuPy's ``cupy.cuda.nccl`` (``cupy_nccl``, for a machine with a GPU) and
a strict fake over the fake device runtime (``fake_nccl``), so the engine, its plans and its
watchdog are tested on a CPU.

NCCL's rules, which every library here keeps:

- A communicator is made by every rank at once from one unique id (128 bytes) that one rank
  draws and the others read: ``connect`` blocks until all ranks have called it.
- Calls are queued on a stream and return at once. A send waits, on the device, for the
  peer's matching receive (the k-th send from a to b meets the k-th receive at b from a, with
  the same byte count); calls made between ``group_start`` and ``group_end`` run together,
  so a send and a receive between the same two ranks must share a group.
- There is no timeout. A communicator whose work waits for ever is ended with ``abort``,
  on every rank (a rank that does not abort keeps waiting); its queued work then ends
  without moving data, ``async_error`` says so, and it is never used again. ``destroy`` is
  the orderly end, once its work is done; CuPy's garbage collection would call the blocking
  destroy, so ringcomm always ends a communicator explicitly.
"""

from __future__ import annotations

import abc

import numpy as np

from ..dtypes import ReduceOp
from .runtime import Stream

UNIQUE_ID_BYTES = 128


class NcclComm(abc.ABC):
    """One rank's NCCL communicator (see the module docstring)."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def group_start(self) -> None: ...

    @abc.abstractmethod
    def group_end(self) -> None: ...

    @abc.abstractmethod
    def send(self, ptr: int, nbytes: int, peer: int, stream: Stream) -> None:
        """Queue a send of ``nbytes`` at device pointer ``ptr`` to ``peer``."""

    @abc.abstractmethod
    def recv(self, ptr: int, nbytes: int, peer: int, stream: Stream) -> None:
        """Queue a receive of ``nbytes`` from ``peer`` into ``ptr``."""

    @abc.abstractmethod
    def all_reduce(self, src: int, dst: int, count: int, dtype: np.dtype, op: ReduceOp,
                   stream: Stream) -> None: ...

    @abc.abstractmethod
    def reduce_scatter(self, src: int, dst: int, count: int, dtype: np.dtype, op: ReduceOp,
                       stream: Stream) -> None:
        """``count`` is each rank's share (``dst``'s elements)."""

    @abc.abstractmethod
    def all_gather(self, src: int, dst: int, count: int, dtype: np.dtype,
                   stream: Stream) -> None:
        """``count`` is each rank's share (``src``'s elements)."""

    @abc.abstractmethod
    def broadcast(self, src: int, dst: int, count: int, dtype: np.dtype, root: int,
                  stream: Stream) -> None: ...

    @abc.abstractmethod
    def reduce(self, src: int, dst: int, count: int, dtype: np.dtype, op: ReduceOp, root: int,
               stream: Stream) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None:
        """End the communicator now: its queued work ends without waiting for peers."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """End the communicator once its work is done (the orderly close)."""

    @abc.abstractmethod
    def async_error(self) -> str | None:
        """What went wrong in the communicator's queued work (an abort included), or None."""


class NcclLibrary(abc.ABC):
    """How communicators are made (see the module docstring)."""

    name: str  # "cupy" | "fake"

    @abc.abstractmethod
    def available(self) -> bool:
        """Whether NCCL can be used here."""

    @abc.abstractmethod
    def version(self) -> str:
        """NCCL's version, as ``ringcomm env`` shows it ("2.27.3"; "-" where unknown)."""

    @abc.abstractmethod
    def unique_id(self) -> bytes:
        """A fresh unique id (``UNIQUE_ID_BYTES``), drawn by one rank for all."""

    @abc.abstractmethod
    def connect(self, world_size: int, unique_id: bytes, rank: int) -> NcclComm:
        """This rank's communicator; blocks until every rank has connected."""


# reductions as NCCL numbers them (ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg)
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
# dtypes as NCCL numbers them (ncclInt8 .. ncclBfloat16)
NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
               "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}


def nccl_takes(dtype: np.dtype, op: str | None = None) -> bool:
    """Whether NCCL's own calls take ``dtype`` (and the reduction named ``op``): where they
    do not (bool, complex, int16, uint16; the bitwise reductions), the nccl engine runs
    ringcomm's schedules as NCCL groups, which move bytes."""
    return np.dtype(dtype).name in NCCL_DTYPES and (op is None or op in NCCL_OPS)


def nccl_dtype(dtype: np.dtype) -> int:
    """NCCL's number for ``dtype``; an error naming it where NCCL has none (bool, complex)."""
    try:
        return NCCL_DTYPES[np.dtype(dtype).name]
    except KeyError:
        raise ValueError(f"NCCL has no {np.dtype(dtype).name} type; the NCCL engine moves "
                         f"{', '.join(NCCL_DTYPES)}") from None


def nccl_op(op: ReduceOp) -> int:
    """NCCL's number for ``op``; an error where NCCL has none (the bitwise reductions)."""
    try:
        return NCCL_OPS[op.name]
    except KeyError:
        raise ValueError(f"NCCL has no {op.name!r} reduction; the NCCL engine reduces with "
                         f"{', '.join(NCCL_OPS)}") from None
