"""NCCL through CuPy (``cupy.cuda.nccl``), imported only when a group uses the NCCL engine.

Streams are the device runtime's (``Stream.handle`` is the ``cudaStream_t``), pointers are
plain ints, byte counts go to NCCL as ``ncclUint8`` elements. CuPy 14's unique id is 128
``bytes`` and ``NcclCommunicator`` takes nothing else (measured: a tuple is a
``TypeError``), so the id travels and is handed over as it came.

``CupyNccl(module)`` takes the module to call: CuPy's by default, or
``ringcomm.testing.FakeCupyNccl`` on a machine without a GPU, so this adapter is what the
CPU tests run too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import ReduceOp
from .nccl import UNIQUE_ID_BYTES, NcclComm, NcclLibrary, nccl_dtype, nccl_op
from .runtime import Stream

_UINT8 = 1  # ncclUint8: point-to-point messages are counted in bytes


class CupyNccl(NcclLibrary):
    """NCCL through ``module`` (``cupy.cuda.nccl`` unless given; see the module docstring)."""

    def __init__(self, module: Any = None, name: str = "cupy") -> None:
        self._module = module
        self.name = name

    def _nccl(self) -> Any:
        if self._module is None:
            from cupy.cuda import nccl

            self._module = nccl
        return self._module

    def available(self) -> bool:
        try:
            nccl = self._nccl()
        except ImportError:  # CuPy built without NCCL
            return False
        return bool(getattr(nccl, "available", True))

    def version(self) -> str:
        try:
            v = int(self._nccl().get_version())
        except (ImportError, AttributeError, RuntimeError):
            return "-"
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else \
            f"{v // 1000}.{v // 100 % 10}.{v % 100}"

    def unique_id(self) -> bytes:
        uid = self._nccl().get_unique_id()
        if not isinstance(uid, bytes) or len(uid) != UNIQUE_ID_BYTES:
            raise RuntimeError(f"NCCL's unique id came as {type(uid).__name__} of {len(uid)}; "
                               f"CuPy 14 gives {UNIQUE_ID_BYTES} bytes (install cupy>=14)")
        return uid

    def connect(self, world_size: int, unique_id: bytes, rank: int) -> NcclComm:
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got "
                             f"{len(unique_id)}")
        nccl = self._nccl()
        return _Comm(nccl, nccl.NcclCommunicator(world_size, bytes(unique_id), rank), rank,
                     world_size)


class _Comm(NcclComm):
    def __init__(self, nccl: Any, comm: Any, rank: int, world_size: int) -> None:
        self._nccl = nccl
        self._comm = comm
        self.rank = rank
        self.world_size = world_size
        self._ended = ""  # how it ended, once it has

    def group_start(self) -> None:
        self._nccl.groupStart()

    def group_end(self) -> None:
        self._nccl.groupEnd()

    def send(self, ptr: int, nbytes: int, peer: int, stream: Stream) -> None:
        self._comm.send(ptr, nbytes, _UINT8, peer, stream.handle)

    def recv(self, ptr: int, nbytes: int, peer: int, stream: Stream) -> None:
        self._comm.recv(ptr, nbytes, _UINT8, peer, stream.handle)

    def all_reduce(self, src: int, dst: int, count: int, dtype: np.dtype, op: ReduceOp,
                   stream: Stream) -> None:
        self._comm.allReduce(src, dst, count, nccl_dtype(dtype), nccl_op(op), stream.handle)

    def reduce_scatter(self, src: int, dst: int, count: int, dtype: np.dtype, op: ReduceOp,
                       stream: Stream) -> None:
        self._comm.reduceScatter(src, dst, count, nccl_dtype(dtype), nccl_op(op),
                                 stream.handle)

    def all_gather(self, src: int, dst: int, count: int, dtype: np.dtype,
                   stream: Stream) -> None:
        self._comm.allGather(src, dst, count, nccl_dtype(dtype), stream.handle)

    def broadcast(self, src: int, dst: int, count: int, dtype: np.dtype, root: int,
                  stream: Stream) -> None:
        self._comm.broadcast(src, dst, count, nccl_dtype(dtype), root, stream.handle)

    def reduce(self, src: int, dst: int, count: int, dtype: np.dtype, op: ReduceOp, root: int,
               stream: Stream) -> None:
        self._comm.reduce(src, dst, count, nccl_dtype(dtype), nccl_op(op), root,
                          stream.handle)

    def abort(self) -> None:
        if not self._ended:
            self._ended = "aborted (ncclCommAbort)"
            self._comm.abort()

    def destroy(self) -> None:
        if not self._ended:
            self._ended = "destroyed"
            self._comm.destroy()

    def async_error(self) -> str | None:
        if self._ended:  # its handle is freed: asking NCCL would read freed memory
            return f"the communicator was {self._ended}" if "abort" in self._ended else None
        try:
            self._comm.check_async_error()
        except Exception as err:  # noqa: BLE001 - CuPy's NcclError, said in words
            return f"{type(err).__name__}: {err}"
        return None
