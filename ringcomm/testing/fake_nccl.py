"""A strict fake of CuPy's ``cupy.cuda.nccl`` (CuPy 14) over the fake device runtime, so
ringcomm's NCCL adapter (``ringcomm.core.device.cupy_nccl``), the NCCL engine, its plans
and its watchdog are tested on a CPU for ranks that are threads of one process
(``run_group``) or processes (``ringcomm.init``, the benchmark).

It is a fake of the outside library, at the level ringcomm calls it: the same names and
arguments (``get_unique_id()`` -> 128 ``bytes``; ``NcclCommunicator(ndev, commId, rank)``;
``groupStart``/``groupEnd`` per thread; ``send(ptr, count, datatype, peer, stream)`` with
streams and pointers as ints; ``abort``, ``destroy``, ``check_async_error``), so a mistake
in how ringcomm calls CuPy fails here as it fails on a GPU.

- What NCCL's ranks share (the messages each pair has launched, each collective's parts)
  lives in a small broker that the process drawing the unique id serves, on a Unix socket
  in the abstract namespace (nothing in the file system, gone with the process); the id
  carries its address and key. A rank's calls talk to it over its own connection.
- Calls are items on the fake runtime's lazy streams: a group runs when something waits
  for its stream, reading its sends' memory then, in stream order.
- A send ends only when its peer has launched the matching receive (NCCL's rendezvous, the
  strictest case: no message is buffered), so plans that deadlock on a GPU deadlock here.
- Collectives end once every rank has launched the same one, each rank's result folded in
  rank order.
- ``NcclCommunicator`` waits for every rank, as ``ncclCommInitRank`` does; ``abort`` ends
  this rank's queued and future work without data; the peers keep waiting until they abort
  too, as they would on a GPU (and when the broker's process is gone).

What it refuses, and why (a ``TypeError`` as CuPy raises it, else ``FakeNcclError`` as
NCCL's status, or ``FakeDeviceFault`` for what a GPU would punish later):

=========================================================  =====================================
refusal                                                    source
=========================================================  =====================================
``commId`` that is not ``bytes`` (a tuple, a list)          measured, CuPy 14.2 on an H100:
                                                           ``TypeError: Argument 'commId' has
                                                           incorrect type (expected bytes, got
                                                           tuple)``
``commId`` of other than 128 bytes                         CuPy's nccl.pyx: ``assert
                                                           len(commId) == NCCL_UNIQUE_ID_BYTES``
a call on a communicator after ``destroy``/``abort``        CuPy sets its handle to NULL; NCCL's
(``check_async_error`` included)                            argument check: ncclInvalidArgument
a peer outside ``0..ndev-1``, a rank outside it at init,  NCCL's argument check:
a datatype or reduction NCCL does not have                  ncclInvalidArgument
an id no fake drew; an id whose drawer is gone; a rank      NCCL's bootstrap fails or hangs there
that joins twice or with another world size                 (the id names a root that must live;
                                                           each rank joins once)
``groupEnd`` without ``groupStart``                        NCCL: ncclInvalidUsage
a receive whose size differs from its send's; ranks that   undefined in NCCL (a send and its
launch different collectives (kind, count, type, op,       receive, and every rank's collective,
root)                                                      must match): a hang or garbage there
a wait that never ends                                     a hang on a GPU (given up after
                                                           ``RINGCOMM_FAKE_DEVICE_TIMEOUT``)
=========================================================  =====================================

Allowed, as NCCL allows them: calls of one group on several streams (the group then orders
every one of them, NCCL's "mixing multiple streams within a group"), collectives inside a
group, a send to oneself, ``abort`` or ``destroy`` of a communicator already ended (CuPy
does nothing then).
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
import time
import weakref
from collections import defaultdict
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np

from ..core.device.nccl import NCCL_DTYPES, NCCL_OPS, UNIQUE_ID_BYTES
from ..core.dtypes import DTYPE_NAMES, REDUCE_OPS, ReduceOp, finish_reduction, reduce_into
from .fake_device import FakeDeviceFault, FakeRuntime, _Item

_MAGIC = b"RCFKNCCL"
_ID = struct.Struct("<8sH32s")  # magic, address length, key; then the address
_POLL_S = 0.0005  # how often a waiting call asks the broker again


#: the NCCL this fake was modelled on (ncclGetVersion's number: 2.28.9, measured on the H100)
MODELLED_VERSION = 22809
_DTYPE_OF = {NCCL_DTYPES[name]: dtype for dtype, name in DTYPE_NAMES.items()
             if name in NCCL_DTYPES}
_OP_OF = {code: REDUCE_OPS[name] for name, code in NCCL_OPS.items()}
# ncclResult_t codes the fake returns, as CuPy's NcclError names them
_INVALID_ARGUMENT, _INVALID_USAGE = 4, 5


class FakeNcclError(RuntimeError):
    """A failed NCCL call, as ``cupy_backends.cuda.libs.nccl.NcclError``: ``status`` is
    NCCL's ``ncclResult_t``."""

    _NAMES = {_INVALID_ARGUMENT: "NCCL_ERROR_INVALID_ARGUMENT",
              _INVALID_USAGE: "NCCL_ERROR_INVALID_USAGE"}

    def __init__(self, status: int, what: str) -> None:
        self.status = status
        super().__init__(f"{self._NAMES.get(status, status)}: {what}")


_MODULES: weakref.WeakKeyDictionary[FakeRuntime, FakeCupyNccl] = weakref.WeakKeyDictionary()
_MODULES_LOCK = threading.Lock()


class FakeCupyNccl:
    """A fake of the ``cupy.cuda.nccl`` module for the fake runtime ``rt`` (module
    docstring): what ``ringcomm.core.device.cupy_nccl.CupyNccl`` is given instead of
    CuPy's module on a machine without a GPU."""

    available = True
    NcclError = FakeNcclError

    def __init__(self, rt: FakeRuntime) -> None:
        self.rt = rt
        self._thread = threading.local()  # each thread's group: depth, pending calls

    @classmethod
    def of(cls, rt: FakeRuntime) -> FakeCupyNccl:
        """The one fake module of runtime ``rt`` (CuPy's module is one per process: group
        calls of every communicator on a thread are one group)."""
        with _MODULES_LOCK:
            module = _MODULES.get(rt)
            if module is None:
                module = _MODULES[rt] = cls(rt)
            return module

    def get_version(self) -> int:
        return MODELLED_VERSION

    def get_unique_id(self) -> bytes:
        """A broker served by this process from now on; its address and key as the id."""
        broker = _Broker()
        _SERVED[broker.address] = broker
        address = broker.address.encode()
        uid = _ID.pack(_MAGIC, len(address), broker.key) + address
        if len(uid) > UNIQUE_ID_BYTES:
            raise FakeDeviceFault(f"a fake NCCL address of {len(address)} bytes is too long")
        return uid.ljust(UNIQUE_ID_BYTES, b"\0")

    def NcclCommunicator(self, ndev: int, commId: Any, rank: int  # noqa: N802, N803 - CuPy's
                         ) -> FakeNcclCommunicator:
        return FakeNcclCommunicator(self, ndev, commId, rank)

    # ------------------------------------------------------------------ group calls
    def _group(self) -> tuple[int, list[tuple[FakeNcclCommunicator, Any, int]]]:
        state = self._thread
        if not hasattr(state, "depth"):
            state.depth, state.pending = 0, []
        return state.depth, state.pending

    def groupStart(self) -> None:  # noqa: N802 - CuPy's name
        self._group()
        self._thread.depth += 1

    def groupEnd(self) -> None:  # noqa: N802 - CuPy's name
        depth, pending = self._group()
        if depth == 0:
            raise FakeNcclError(_INVALID_USAGE, "ncclGroupEnd without ncclGroupStart")
        self._thread.depth = depth - 1
        if depth > 1 or not pending:
            return
        self._thread.pending = []
        by_comm: dict[FakeNcclCommunicator, list[tuple[Any, int]]] = {}
        for comm, call, stream in pending:
            by_comm.setdefault(comm, []).append((call, stream))
        for comm, calls in by_comm.items():
            comm._launch(calls)

    def _in_group(self, comm: FakeNcclCommunicator, call: Any, stream: int) -> bool:
        """Keep ``call`` for the thread's open group (True), or say there is none."""
        depth, pending = self._group()
        if depth:
            pending.append((comm, call, stream))
        return bool(depth)


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
                if self.over.is_set():  # closing a listener does not end an accept already
                    conn.close()        # waiting in it: a rank that connects late finds the
                    return              # broker gone all the same
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
                with self.lock:
                    answer = getattr(self, f"_{verb}")(*args)
                if verb == "join" and not answer:
                    rank = args[0]  # a refused join is no member: its end leaves nothing
                conn.send(answer)
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

    def __init__(self, comm: FakeNcclCommunicator, calls: list[_Call]) -> None:
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

    def __init__(self, comm: FakeNcclCommunicator, number: int, shape: tuple[Any, ...], src: int,
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


class FakeNcclCommunicator:
    """A fake ``cupy.cuda.nccl.NcclCommunicator`` (module docstring)."""

    def __init__(self, module: FakeCupyNccl, ndev: int, commId: Any, rank: int  # noqa: N803
                 ) -> None:
        if not isinstance(commId, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                            f"{type(commId).__name__})")
        assert len(commId) == UNIQUE_ID_BYTES
        magic, length, key = _ID.unpack_from(commId)
        if magic != _MAGIC:
            raise FakeDeviceFault("not a fake NCCL unique id (the fake draws its own: "
                                  "get_unique_id)")
        if not 0 <= rank < ndev:
            raise FakeNcclError(_INVALID_ARGUMENT, f"rank {rank} of a communicator of {ndev}")
        self.module = module
        self.rt = rt = module.rt
        self.address = address = commId[_ID.size:_ID.size + length].decode()
        self.rank, self.world_size = rank, ndev
        self.aborted = False
        self.ended = ""  # "aborted" or "destroyed", once it is
        self._lock = threading.Lock()  # items may run on any thread that waits
        self._collectives = 0
        try:
            conn = Client(address, family="AF_UNIX", authkey=key)
            conn.send(("join", rank, ndev))
            problem = conn.recv()
        except (OSError, EOFError) as err:
            raise FakeDeviceFault(f"NCCL init: the id's broker cannot be reached "
                                  f"({err or type(err).__name__})") from None
        self._conn: Connection | None = conn
        broker = _SERVED.get(address)
        if broker is not None:
            with broker.lock:
                broker.local += 1
        if problem:
            self._disconnect()
            raise FakeDeviceFault(problem)
        deadline = time.monotonic() + rt.hang_timeout
        while (missing := self.ask("missing")) > 0:
            if time.monotonic() > deadline:
                self._disconnect()
                raise FakeDeviceFault(f"NCCL init hang: rank {rank} waited "
                                      f"{rt.hang_timeout:g} s for {missing} more ranks")
            time.sleep(_POLL_S)

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
        if self.ended:  # CuPy's handle is NULL now: NCCL's argument check refuses it
            raise FakeNcclError(_INVALID_ARGUMENT, f"rank {self.rank}: {what} on an NCCL "
                                f"communicator already {self.ended}")

    # ------------------------------------------------------------------ calls
    def _p2p(self, call: _Call, stream: int) -> None:
        self._usable("ncclSend" if call.send else "ncclRecv")
        if not 0 <= call.peer < self.world_size:
            raise FakeNcclError(_INVALID_ARGUMENT, f"rank {self.rank}: an NCCL call with "
                                f"peer {call.peer} (ranks 0..{self.world_size - 1})")
        self.rt._find(call.ptr, call.nbytes, "nccl call")
        self.rt.external_stream(stream)  # a stream of this process's
        if not self.module._in_group(self, call, stream):
            self._launch([(call, stream)])

    def _launch(self, calls: list[tuple[Any, int]]) -> None:
        """Queue a group's calls (or one call alone): its collectives in call order, then its
        point-to-point calls as one item; calls on several streams order every one of them
        (NCCL: as if the group were posted on each)."""
        rt = self.rt
        streams = list(dict.fromkeys(rt.external_stream(stream) for _, stream in calls))
        first, others = streams[0], streams[1:]
        for other in others:  # the group starts once every stream has reached it
            before = rt.new_event()
            rt.record(before, other)
            rt.wait_event(first, before)
        p2p = [call for call, _ in calls if isinstance(call, _Call)]
        for call, _ in calls:
            if not isinstance(call, _Call):
                rt._queue(first, call)
        if p2p:
            rt._queue(first, _Group(self, p2p))
        if others:  # and no stream goes on before the group is over
            after = rt.new_event()
            rt.record(after, first)
            for other in others:
                rt.wait_event(other, after)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._p2p(_Call(True, sendbuf, count * _itemsize(datatype), peer), stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._p2p(_Call(False, recvbuf, count * _itemsize(datatype), peer), stream)

    def _collective(self, kind: str, src: int, dst: int, count: int, datatype: int,
                    op: int | None, root: int, stream: int, src_count: int,
                    dst_count: int) -> None:
        self._usable(f"nccl {kind}")
        dtype = _dtype(datatype)
        reduction = None if op is None else _op(op)
        self.rt.external_stream(stream)
        number = self._collectives
        self._collectives += 1
        shape = (kind, count, dtype, None if reduction is None else reduction.name, root)
        item = _Collective(self, number, shape, src, src_count * dtype.itemsize, dst,
                           dst_count * dtype.itemsize)
        if not self.module._in_group(self, item, stream):
            self._launch([(item, stream)])

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int,  # noqa: N802
                  op: int, stream: int) -> None:
        self._collective("all_reduce", sendbuf, recvbuf, count, datatype, op, -1, stream,
                         count, count)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int,  # noqa: N802
                      datatype: int, op: int, stream: int) -> None:
        self._collective("reduce_scatter", sendbuf, recvbuf, recvcount, datatype, op, -1,
                         stream, recvcount * self.world_size, recvcount)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,  # noqa: N802
                  stream: int) -> None:
        self._collective("all_gather", sendbuf, recvbuf, count, datatype, None, -1, stream,
                         count, count * self.world_size)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        self._collective("broadcast", sendbuff, recvbuff, count, datatype, None, root, stream,
                         count, count)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
               root: int, stream: int) -> None:
        self._collective("reduce", sendbuf, recvbuf, count, datatype, op, root, stream, count,
                         count)

    # ------------------------------------------------------------------ the end
    def abort(self) -> None:
        if self.ended:  # CuPy: nothing once its handle is NULL
            return
        self.aborted = True
        self._leave("aborted")

    def destroy(self) -> None:
        if self.ended:
            return
        self._leave("destroyed")

    def _leave(self, how: str) -> None:
        self.ended = how
        self.ask("leave", self.rank)
        last, broker = self._disconnect()
        if last and broker is not None and how == "destroyed":
            broker.over.wait(self.rt.hang_timeout)

    def _disconnect(self) -> tuple[bool, _Broker | None]:
        """Close the connection; whether this was the last of this process's ranks of a
        broker served here (that one waits for the other processes' ranks, which may still
        read what it sent), and that broker."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        broker = _SERVED.get(self.address)
        if broker is None:
            return False, None
        with broker.lock:
            broker.local -= 1
            return broker.local == 0, broker

    def check_async_error(self) -> None:
        self._usable("ncclCommGetAsyncError")


def _dtype(datatype: int) -> np.dtype:
    try:
        return _DTYPE_OF[datatype]
    except KeyError:
        raise FakeNcclError(_INVALID_ARGUMENT, f"datatype {datatype}") from None


def _itemsize(datatype: int) -> int:
    return _dtype(datatype).itemsize


def _op(op: int) -> ReduceOp:
    try:
        return _OP_OF[op]
    except KeyError:
        raise FakeNcclError(_INVALID_ARGUMENT, f"reduction {op}") from None
