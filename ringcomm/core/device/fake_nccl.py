"""A strict fake of NCCL over the fake device runtime: the NCCL engine's plans, group calls
and watchdog are tested on a CPU against NCCL's rules (``nccl.py``'s docstring), broken
rules failing at once, for ranks that are threads of one process (``run_group``) or
processes (``ringcomm.init``, the benchmark).

- What NCCL's ranks share (the messages each pair has launched, each collective's parts)
  lives in a small broker that the process drawing the unique id serves, on a Unix socket
  in the abstract namespace (nothing in the file system, gone with the process); the id
  carries its address and key. A rank's calls talk to it over its own connection.
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
  until they abort too, as they would on a GPU (and when the broker's process is gone).
  A communicator used after its end is a fault.
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
import time
from collections import defaultdict
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np

from ..dtypes import REDUCE_OPS, ReduceOp, finish_reduction, reduce_into
from .fake import FakeDeviceFault, FakeRuntime, _Item
from .nccl import UNIQUE_ID_BYTES, NcclComm, NcclLibrary, nccl_dtype, nccl_op
from .runtime import Stream

_MAGIC = b"RCFKNCCL"
_ID = struct.Struct("<8sH32s")  # magic, address length, key; then the address
_POLL_S = 0.0005  # how often a waiting call asks the broker again


class FakeNccl(NcclLibrary):
    name = "fake"

    def __init__(self, rt: FakeRuntime) -> None:
        self.rt = rt

    def available(self) -> bool:
        return True

    def version(self) -> str:
        return "fake"

    def unique_id(self) -> bytes:
        """A broker served by this process from now on, its address and key as the id."""
        broker = _Broker()
        _SERVED[broker.address] = broker
        address = broker.address.encode()
        uid = _ID.pack(_MAGIC, len(address), broker.key) + address
        if len(uid) > UNIQUE_ID_BYTES:
            raise FakeDeviceFault(f"a fake NCCL address of {len(address)} bytes is too long")
        return uid.ljust(UNIQUE_ID_BYTES, b"\0")

    def connect(self, world_size: int, unique_id: bytes, rank: int) -> NcclComm:
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise FakeDeviceFault(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got "
                                  f"{len(unique_id)}")
        magic, length, key = _ID.unpack_from(unique_id)
        if magic != _MAGIC:
            raise FakeDeviceFault("not a fake NCCL unique id")
        address = unique_id[_ID.size:_ID.size + length].decode()
        if not 0 <= rank < world_size:
            raise FakeDeviceFault(f"rank {rank} of an NCCL communicator of {world_size}")
        try:
            conn = Client(address, family="AF_UNIX", authkey=key)
        except OSError as err:
            raise FakeDeviceFault(f"NCCL init: the id's broker cannot be reached ({err})") \
                from None
        comm = _Comm(self.rt, conn, rank, world_size, address)
        broker = _SERVED.get(address)
        if broker is not None:
            with broker.lock:
                broker.local += 1
        problem = comm.ask("join", rank, world_size)
        if problem:
            raise FakeDeviceFault(problem)
        deadline = time.monotonic() + self.rt.hang_timeout
        while (missing := comm.ask("missing")) > 0:
            if time.monotonic() > deadline:
                raise FakeDeviceFault(f"NCCL init hang: rank {rank} waited "
                                      f"{self.rt.hang_timeout:g} s for {missing} more ranks")
            time.sleep(_POLL_S)
        return comm


class _Broker:
    """What the ranks of one communicator share, served to their connections by a daemon
    thread of the process that drew the id; ends once every rank has left (or its process
    is gone). Its own process's ranks wait for that when they end their communicators, so
    that what they sent outlives them, as a GPU's delivered bytes would (the last of them to
    end waits, so ranks that are threads of one process never wait for each other)."""

    def __init__(self) -> None:
        self.key = os.urandom(32)
        name = f"\0ringcomm-fake-nccl-{os.getpid()}-{os.urandom(6).hex()}"
        self.listener = Listener(name, family="AF_UNIX", authkey=self.key)
        self.address = name
        self.lock = threading.Lock()
        self.world = 0
        self.joined: set[int] = set()
        self.left: set[int] = set()  # ranks that ended their communicators, or are gone
        self.over = threading.Event()  # every rank has
        self.local = 0  # communicators of this process's ranks not ended yet
        self.sent: dict[tuple[int, int], list[bytes]] = defaultdict(list)
        self.receives: dict[tuple[int, int], int] = defaultdict(int)
        self.collectives: dict[int, dict[int, tuple[tuple[Any, ...], bytes]]] = \
            defaultdict(dict)
        threading.Thread(target=self._accept, name="ringcomm-fake-nccl", daemon=True).start()

    def _accept(self) -> None:
        try:
            while True:
                conn = self.listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        except OSError:
            return  # closed: every rank left

    def _serve(self, conn: Connection) -> None:
        rank = -1
        with conn:
            while True:
                try:
                    verb, *args = conn.recv()
                except (EOFError, OSError):  # its process is gone: it has left
                    if rank >= 0:
                        with self.lock:
                            self._leave(rank)
                    return
                if verb == "join":
                    rank = args[0]
                with self.lock:
                    conn.send(getattr(self, f"_{verb}")(*args))
                if verb == "leave":
                    return

    def _join(self, rank: int, world: int) -> str:
        if self.world and world != self.world:
            return f"rank {rank} connects with {world} ranks to an NCCL id others used with " \
                f"{self.world}"
        if rank in self.joined:
            return f"rank {rank} connects twice with one NCCL id"
        self.world = world
        self.joined.add(rank)
        return ""

    def _missing(self) -> int:
        return self.world - len(self.joined)

    def _send(self, src: int, dst: int, data: bytes) -> int:
        box = self.sent[(src, dst)]
        box.append(data)
        return len(box) - 1

    def _recv(self, src: int, dst: int) -> int:
        self.receives[(src, dst)] += 1
        return self.receives[(src, dst)] - 1

    def _met(self, asks: list[tuple[bool, int, int, int]]) -> list[Any]:
        """For each (send?, src, dst, index): a send's whether its receive was launched; a
        receive's message, once its send was (None before)."""
        out: list[Any] = []
        for send, src, dst, index in asks:
            if send:
                out.append(self.receives[(src, dst)] > index)
            else:
                box = self.sent[(src, dst)]
                out.append(box[index] if len(box) > index else None)
        return out

    def _post(self, number: int, rank: int, shape: tuple[Any, ...], data: bytes) -> None:
        self.collectives[number][rank] = (shape, data)

    def _parts(self, number: int) -> dict[int, tuple[tuple[Any, ...], bytes]] | None:
        posted = self.collectives[number]
        return dict(posted) if len(posted) == self.world else None

    def _leave(self, rank: int) -> None:
        self.left.add(rank)
        if len(self.left) >= self.world:
            self.listener.close()
            self.over.set()
            _SERVED.pop(self.address, None)


_SERVED: dict[str, _Broker] = {}  # the brokers this process serves, by address


class _Call:
    __slots__ = ("send", "ptr", "nbytes", "peer", "index")

    def __init__(self, send: bool, ptr: int, nbytes: int, peer: int) -> None:
        self.send, self.ptr, self.nbytes, self.peer = send, ptr, nbytes, peer
        self.index = -1  # the k-th of its pair and direction, once launched


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
        comm, me = self.comm, self.comm.rank
        if comm.aborted:
            return True  # an aborted communicator's work ends without data
        if not self.launched:
            self.launched = True
            for c in self.calls:
                if c.send:
                    c.index = comm.ask("send", me, c.peer,
                                       bytes(rt._view(c.ptr, c.nbytes, "nccl send")))
                else:
                    c.index = comm.ask("recv", c.peer, me)
        while True:
            if comm.aborted:
                return True  # an aborted communicator's work ends without data
            met = comm.ask("met", [(c.send, me if c.send else c.peer, c.peer if c.send else me,
                                    c.index) for c in self.calls])
            if all(m is not None and m is not False for m in met):
                break
            if not block:
                return False
            if time.monotonic() > deadline:
                waiting = [c for c, m in zip(self.calls, met, strict=True) if m in (None, False)]
                raise FakeDeviceFault(f"device hang: rank {me}'s NCCL group waits for "
                                      + ", ".join(f"rank {c.peer}'s "
                                                  f"{'receive' if c.send else 'send'}"
                                                  for c in waiting))
            time.sleep(_POLL_S)
        for c, message in zip(self.calls, met, strict=True):
            if not c.send:
                if len(message) != c.nbytes:
                    raise FakeDeviceFault(f"rank {me} receives {c.nbytes} B from rank {c.peer}, "
                                          f"whose send has {len(message)} B")
                rt._view(c.ptr, c.nbytes, "nccl recv")[:] = np.frombuffer(message, np.uint8)
        return True


class _Collective(_Item):
    __slots__ = ("comm", "number", "shape", "src", "dst", "launched")

    def __init__(self, comm: _Comm, number: int, shape: tuple[Any, ...], src: int,
                 src_bytes: int, dst: int, dst_bytes: int) -> None:
        super().__init__(f"nccl {shape[0]} #{number} on rank {comm.rank}",
                         ((src, src_bytes), (dst, dst_bytes)))
        self.comm, self.number, self.shape = comm, number, shape
        self.src, self.dst = (src, src_bytes), (dst, dst_bytes)
        self.launched = False

    def run(self, rt: FakeRuntime, block: bool, deadline: float) -> bool:
        comm, me = self.comm, self.comm.rank
        if comm.aborted:
            return True
        if not self.launched:
            self.launched = True
            comm.ask("post", self.number, me, self.shape,
                     bytes(rt._view(*self.src, "nccl collective")))
        while True:
            if comm.aborted:
                return True
            parts = comm.ask("parts", self.number)
            if parts is not None:
                break
            if not block:
                return False
            if time.monotonic() > deadline:
                raise FakeDeviceFault(f"device hang: rank {me}'s NCCL {self.shape[0]} "
                                      f"#{self.number} waits for other ranks")
            time.sleep(_POLL_S)
        shapes = {r: s for r, (s, _) in parts.items()}
        if len(set(shapes.values())) > 1:
            raise FakeDeviceFault(f"NCCL collective #{self.number} differs between ranks: "
                                  f"{shapes}")
        data = [np.frombuffer(parts[r][1], np.uint8) for r in range(comm.world_size)]
        rt._view(*self.dst, "nccl collective")[:] = _result(self.shape, data, me,
                                                            comm.world_size)
        return True


def _result(shape: tuple[Any, ...], parts: list[np.ndarray], rank: int,
            world: int) -> np.ndarray:
    kind, count, dtype, op_name, root = shape
    typed = [p.view(dtype) for p in parts]

    def fold() -> np.ndarray:
        op: ReduceOp = REDUCE_OPS[op_name]
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




# what a call waits on reads when the broker is gone (its process died): nothing arrives
_UNANSWERED: dict[str, Any] = {
    "met": lambda asks: [None] * len(asks),  # no receive launched, no message
    "missing": lambda: 1,  # a rank never joins
    "parts": lambda number: None,  # a collective never complete
    "send": lambda *_: 1 << 62, "recv": lambda *_: 1 << 62,  # indices never reached
}


class _Comm(NcclComm):
    def __init__(self, rt: FakeRuntime, conn: Connection, rank: int, world_size: int,
                 address: str) -> None:
        self.rt = rt
        self.address = address
        self.rank, self.world_size = rank, world_size
        self.aborted = False
        self.ended = ""  # why it may not be used: "aborted" or "destroyed"
        self._conn: Connection | None = conn
        self._lock = threading.Lock()  # items may run on any thread that waits
        self._depth = 0
        self._calls: list[_Call] = []
        self._stream: Stream | None = None
        self._collectives = 0

    def ask(self, verb: str, *args: Any) -> Any:
        """The broker's answer (an unreachable broker is a peer that never answers: the
        call waits, as NCCL's would, until an abort or the fake's hang timeout)."""
        with self._lock:
            if self._conn is None:
                raise FakeDeviceFault(f"rank {self.rank}: NCCL used after it ended")
            try:
                self._conn.send((verb, *args))
                return self._conn.recv()
            except (EOFError, OSError, pickle.PicklingError):
                return _UNANSWERED.get(verb, lambda: None)(*args)

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
        shape = (kind, count, dtype, None if op is None else op.name, root)
        self.rt._queue(stream, _Collective(self, number, shape, src, src_count * dtype.itemsize,
                                           dst, dst_count * dtype.itemsize))

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
        self.aborted = True
        self._leave("aborted")

    def destroy(self) -> None:
        self._usable("destroy")
        self._leave("destroyed")

    def _leave(self, how: str) -> None:
        self.ended = how
        self.ask("leave", self.rank)
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        broker = _SERVED.get(self.address)
        if broker is not None:  # served here: the last of this process's ranks to end an
            with broker.lock:   # orderly way waits for the other processes' ranks, which
                broker.local -= 1  # may still read what it sent
                last = broker.local == 0
            if last and how == "destroyed":
                broker.over.wait(self.rt.hang_timeout)

    def async_error(self) -> str | None:
        return "the communicator was aborted (ncclCommAbort)" if self.aborted else None
