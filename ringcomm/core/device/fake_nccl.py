"""A strict fake of NCCL over the fake device runtime, for ranks that are threads of one
process (``run_group``): the NCCL engine's plans, group calls and watchdog are tested on a
CPU against NCCL's rules (``nccl.py``'s docstring), broken rules failing at once.

- Calls are items on the fake runtime's lazy streams: a group runs when something waits
  for its stream, reading its sends' memory then, in stream order.
- A send ends only when its peer has launched the matching receive (NCCL's rendezvous, the
  strictest case: no message is buffered), so plans that deadlock on a GPU deadlock here;
  a receive ends when the matching send has been launched and its byte count matches
  (else ``FakeDeviceFault``, where NCCL would hang or truncate).
- Collectives end once every rank has launched the same one (kind, count, dtype, op and
  root checked), each rank's result folded in rank order.
- ``connect`` waits for every rank, as ``ncclCommInitRank`` does; ``abort`` ends this rank's
  queued and future work without data and ``async_error`` says so; the peers keep waiting
  until they abort too. A communicator used after its end is a fault.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..dtypes import ReduceOp, finish_reduction, reduce_into
from .fake import FakeDeviceFault, FakeRuntime, _Item
from .nccl import UNIQUE_ID_BYTES, NcclComm, NcclLibrary, nccl_dtype, nccl_op
from .runtime import Stream


class FakeNccl(NcclLibrary):
    name = "fake"

    def __init__(self, rt: FakeRuntime) -> None:
        self.rt = rt

    def available(self) -> bool:
        return True

    def version(self) -> str:
        return "fake"

    def unique_id(self) -> bytes:
        import os

        return os.urandom(UNIQUE_ID_BYTES)

    def connect(self, world_size: int, unique_id: bytes, rank: int) -> NcclComm:
        rt = self.rt
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise FakeDeviceFault(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got "
                                  f"{len(unique_id)}")
        if not 0 <= rank < world_size:
            raise FakeDeviceFault(f"rank {rank} of an NCCL communicator of {world_size}")
        with _FABRICS_LOCK:
            fabric = _FABRICS.setdefault(unique_id, _Fabric(world_size))
        with fabric.cond:
            if fabric.world_size != world_size:
                raise FakeDeviceFault(f"rank {rank} connects with {world_size} ranks to an "
                                      f"NCCL id others used with {fabric.world_size}")
            if rank in fabric.joined:
                raise FakeDeviceFault(f"rank {rank} connects twice with one NCCL id")
            comm = _Comm(rt, fabric, rank, world_size)
            fabric.joined[rank] = comm
            fabric.cond.notify_all()
            deadline = time.monotonic() + rt.hang_timeout
            while len(fabric.joined) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FakeDeviceFault(f"NCCL init hang: rank {rank} waited {rt.hang_timeout:g} "
                                          f"s for {world_size - len(fabric.joined)} more ranks")
                fabric.cond.wait(min(left, 0.05))
        return comm


_FABRICS: dict[bytes, _Fabric] = {}
_FABRICS_LOCK = threading.Lock()


@dataclass
class _Fabric:
    """What the ranks of one communicator share: who joined, the sends and receives each
    pair has launched, and each collective's contributions by its number."""

    world_size: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    joined: dict[int, _Comm] = field(default_factory=dict)
    sent: dict[tuple[int, int], list[np.ndarray]] = field(
        default_factory=lambda: defaultdict(list))
    receives: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    collectives: dict[int, dict[int, tuple[tuple[object, ...], np.ndarray]]] = field(
        default_factory=lambda: defaultdict(dict))


@dataclass
class _Call:
    send: bool
    ptr: int
    nbytes: int
    peer: int
    index: int = -1  # the k-th of its pair and direction, once launched


class _Group(_Item):
    """One group's calls, as one item on the stream."""

    __slots__ = ("comm", "calls", "launched")

    def __init__(self, comm: _Comm, calls: list[_Call]) -> None:
        super().__init__(f"nccl group of {len(calls)} calls on rank {comm.rank}",
                         tuple((c.ptr, c.nbytes) for c in calls))
        self.comm = comm
        self.calls = calls
        self.launched = False

    def run(self, rt: FakeRuntime, block: bool, deadline: float) -> bool:
        comm, fabric, me = self.comm, self.comm.fabric, self.comm.rank
        with fabric.cond:
            if not self.launched:
                self.launched = True
                for c in self.calls:
                    if c.send:
                        box = fabric.sent[(me, c.peer)]
                        c.index = len(box)
                        box.append(rt._view(c.ptr, c.nbytes, "nccl send").copy())
                    else:
                        c.index = fabric.receives[(c.peer, me)]
                        fabric.receives[(c.peer, me)] += 1
                fabric.cond.notify_all()
            while not comm.aborted and not all(self._met(c) for c in self.calls):
                if not block:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = [c for c in self.calls if not self._met(c)]
                    raise FakeDeviceFault(f"device hang: rank {me}'s NCCL group waits for "
                                          + ", ".join(f"rank {c.peer}'s "
                                                      f"{'receive' if c.send else 'send'}"
                                                      for c in waiting))
                fabric.cond.wait(min(left, 0.05))
            if comm.aborted:
                return True  # an aborted communicator's work ends without data
            for c in self.calls:
                if not c.send:
                    message = fabric.sent[(c.peer, me)][c.index]
                    if message.nbytes != c.nbytes:
                        raise FakeDeviceFault(f"rank {me} receives {c.nbytes} B from rank "
                                              f"{c.peer}, whose send has {message.nbytes} B")
                    rt._view(c.ptr, c.nbytes, "nccl recv")[:] = message
        return True

    def _met(self, c: _Call) -> bool:
        fabric, me = self.comm.fabric, self.comm.rank
        if c.send:
            return fabric.receives[(me, c.peer)] > c.index
        return len(fabric.sent[(c.peer, me)]) > c.index


class _Collective(_Item):
    __slots__ = ("comm", "number", "shape", "src", "dst", "launched")

    def __init__(self, comm: _Comm, number: int, shape: tuple[object, ...], src: int,
                 src_bytes: int, dst: int, dst_bytes: int) -> None:
        super().__init__(f"nccl {shape[0]} #{number} on rank {comm.rank}",
                         ((src, src_bytes), (dst, dst_bytes)))
        self.comm, self.number, self.shape = comm, number, shape
        self.src, self.dst = (src, src_bytes), (dst, dst_bytes)
        self.launched = False

    def run(self, rt: FakeRuntime, block: bool, deadline: float) -> bool:
        comm, fabric, me = self.comm, self.comm.fabric, self.comm.rank
        with fabric.cond:
            posted = fabric.collectives[self.number]
            if not self.launched:
                self.launched = True
                posted[me] = (self.shape, rt._view(*self.src, "nccl collective").copy())
                fabric.cond.notify_all()
            while not comm.aborted and len(posted) < comm.world_size:
                if not block:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(comm.world_size)) - set(posted))
                    raise FakeDeviceFault(f"device hang: rank {me}'s NCCL {self.shape[0]} waits "
                                          f"for ranks {missing}")
                fabric.cond.wait(min(left, 0.05))
            if comm.aborted:
                return True
            shapes = {r: s for r, (s, _) in posted.items()}
            if len(set(shapes.values())) > 1:
                raise FakeDeviceFault(f"NCCL collective #{self.number} differs between ranks: "
                                      f"{shapes}")
            parts = [posted[r][1] for r in range(comm.world_size)]
        out = rt._view(*self.dst, "nccl collective")
        out[:] = _result(self.shape, parts, me, comm.world_size)
        return True


def _result(shape: tuple[object, ...], parts: list[np.ndarray], rank: int,
            world: int) -> np.ndarray:
    kind, count, dtype, op, root = shape
    assert isinstance(count, int) and isinstance(dtype, np.dtype) and isinstance(root, int)
    typed = [p.view(dtype) for p in parts]

    def fold() -> np.ndarray:
        assert isinstance(op, ReduceOp)
        total = typed[0].copy()
        for part in typed[1:]:
            reduce_into(total, total, part, op)
        finish_reduction(total, op, world)
        return total

    if kind == "all_reduce":
        return fold().view(np.uint8)
    if kind == "reduce_scatter":
        return fold()[rank * count:(rank + 1) * count].view(np.uint8)
    if kind == "all_gather":
        return np.concatenate(typed).view(np.uint8)
    if kind == "broadcast":
        return typed[root].view(np.uint8)
    if kind == "reduce":
        return (fold() if rank == root else typed[rank]).view(np.uint8)
    raise AssertionError(kind)


class _Comm(NcclComm):
    def __init__(self, rt: FakeRuntime, fabric: _Fabric, rank: int, world_size: int) -> None:
        self.rt, self.fabric = rt, fabric
        self.rank, self.world_size = rank, world_size
        self.aborted = False
        self.ended = ""  # why it may not be used: "aborted" or "destroyed"
        self._depth = 0
        self._calls: list[_Call] = []
        self._stream: Stream | None = None
        self._collectives = 0

    def _usable(self, what: str) -> None:
        if self.ended:
            raise FakeDeviceFault(f"rank {self.rank}: {what} on an NCCL communicator already "
                                  f"{self.ended}")

    def group_start(self) -> None:
        self._usable("groupStart")
        self._depth += 1

    def group_end(self) -> None:
        self._usable("groupEnd")
        if self._depth == 0:
            raise FakeDeviceFault("ncclGroupEnd without ncclGroupStart")
        self._depth -= 1
        if self._depth == 0 and self._calls:
            assert self._stream is not None
            self.rt._queue(self._stream, _Group(self, self._calls))
            self._calls, self._stream = [], None

    def _p2p(self, call: _Call, stream: Stream) -> None:
        self._usable("send" if call.send else "recv")
        if not 0 <= call.peer < self.world_size or call.peer == self.rank:
            raise FakeDeviceFault(f"rank {self.rank}: an NCCL call with peer {call.peer}")
        self.rt._find(call.ptr, call.nbytes, "nccl call")
        if self._depth == 0:  # alone: a group of its own
            self.rt._queue(stream, _Group(self, [call]))
            return
        if self._stream is not None and self._stream is not stream:
            raise FakeDeviceFault("calls of one NCCL group on two streams")
        self._stream = stream
        self._calls.append(call)

    def send(self, ptr: int, nbytes: int, peer: int, stream: Stream) -> None:
        self._p2p(_Call(True, ptr, nbytes, peer), stream)

    def recv(self, ptr: int, nbytes: int, peer: int, stream: Stream) -> None:
        self._p2p(_Call(False, ptr, nbytes, peer), stream)

    def _collective(self, kind: str, src: int, dst: int, count: int, dtype: np.dtype,
                    op: ReduceOp | None, root: int, stream: Stream, src_count: int,
                    dst_count: int) -> None:
        self._usable(kind)
        if self._depth:
            raise FakeDeviceFault(f"NCCL {kind} inside a group: ringcomm's plans never do that")
        dtype = np.dtype(dtype)
        nccl_dtype(dtype)
        if op is not None:
            nccl_op(op)
        number = self._collectives
        self._collectives += 1
        self.rt._queue(stream, _Collective(self, number, (kind, count, dtype, op, root), src,
                                           src_count * dtype.itemsize, dst,
                                           dst_count * dtype.itemsize))

    def all_reduce(self, src: int, dst: int, count: int, dtype: np.dtype, op: ReduceOp,
                   stream: Stream) -> None:
        self._collective("all_reduce", src, dst, count, dtype, op, -1, stream, count, count)

    def reduce_scatter(self, src: int, dst: int, count: int, dtype: np.dtype, op: ReduceOp,
                       stream: Stream) -> None:
        self._collective("reduce_scatter", src, dst, count, dtype, op, -1, stream,
                         count * self.world_size, count)

    def all_gather(self, src: int, dst: int, count: int, dtype: np.dtype,
                   stream: Stream) -> None:
        self._collective("all_gather", src, dst, count, dtype, None, -1, stream, count,
                         count * self.world_size)

    def broadcast(self, src: int, dst: int, count: int, dtype: np.dtype, root: int,
                  stream: Stream) -> None:
        self._collective("broadcast", src, dst, count, dtype, None, root, stream, count, count)

    def reduce(self, src: int, dst: int, count: int, dtype: np.dtype, op: ReduceOp, root: int,
               stream: Stream) -> None:
        self._collective("reduce", src, dst, count, dtype, op, root, stream, count, count)

    def abort(self) -> None:
        if self.ended == "destroyed":
            raise FakeDeviceFault(f"rank {self.rank}: ncclCommAbort on a destroyed communicator")
        with self.fabric.cond:
            self.aborted = True
            self.fabric.cond.notify_all()
        self._leave("aborted")

    def destroy(self) -> None:
        self._usable("destroy")
        self._leave("destroyed")

    def _leave(self, how: str) -> None:
        self.ended = how
        with _FABRICS_LOCK, self.fabric.cond:
            self.fabric.joined.pop(self.rank, None)
            if not self.fabric.joined:  # the last rank gone: the id is dead
                for uid, fabric in list(_FABRICS.items()):
                    if fabric is self.fabric:
                        del _FABRICS[uid]

    def async_error(self) -> str | None:
        return "the communicator was aborted (ncclCommAbort)" if self.aborted else None
