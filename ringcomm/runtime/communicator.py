"""The communicator: the public object. It checks arguments, picks an algorithm, and runs
ops one after another on its own worker thread.

Why a worker thread: ops must run in the order they were issued on every rank (that is what
keeps ranks in step), and ``async_op=True`` must let the caller compute while bytes move.
One thread per communicator, fed by a queue, gives both, like a CUDA stream. Arguments are
checked on the caller's thread before anything is queued, so a mistake raises at the call.

Point-to-point ops never hold the worker: a send queues its messages and completes once
they have left this process; a receive is *posted* and completes when its message arrives,
while the worker goes on with later ops and looks for messages whenever it is idle. So two
ranks that each post a receive before their send (``batch_isend_irecv`` does) cannot
deadlock, and ``recv(x, src=None)`` takes the first message from any rank. Messages between
two ranks match in the order they were sent; tags must agree (a mismatch is a
``DesyncError``, not a silent reorder).

Failure contract: an op that fails raises a typed ``CommError`` naming this rank and the op;
before raising, the rank tells every peer (``abort``), so that they raise too instead of
waiting out their timeout. A communicator that has failed stays failed (``CommAborted``):
ranks cannot tell how far their peers got, so the only safe next step is a new one.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import queue
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from ..core import config
from ..core.arrays import Buffer, HostBuffer, as_buffer, concatenate
from ..core.config import DEFAULT_INLINE_BYTES
from ..core.dtypes import ReduceOp, dtype_code, dtype_name, reduce_op
from ..errors import (
    ArgumentError,
    CommAborted,
    CommError,
    DesyncError,
    RemoteError,
)
from ..plan import cost
from ..plan.collectives import COLLECTIVES, Collective
from ..plan.settings import Settings
from ..plan.topology import Topology
from ..schedules import ALLREDUCE, ON_BOARD
from ..schedules import board as board_schedules
from ..transport import board
from ..transport.base import Transport
from ..transport.header import OpDescriptor, OpKind, algorithm_code, reduce_code
from .board_program import (
    BoardProgram,
    board_header,
    board_program,
    run_board,
    run_board_whole,
)
from .context import OpContext, TraceEvent
from .executor import run_schedule
from .p2p import P2PEngine, P2POp
from .work import Work

log = logging.getLogger("ringcomm")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _names_bad_input(
        method: Callable[Concatenate[Communicator, _P], _R]
) -> Callable[Concatenate[Communicator, _P], _R]:
    """Argument errors raised while checking a call name this rank and the op, like every
    other error of a running collective. Typed with a ParamSpec, so the wrapped method keeps
    its signature for IDEs and type checkers."""

    @functools.wraps(method)
    def checked(self: Communicator, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except ArgumentError as err:
            if err.op is not None:
                raise
            raise ArgumentError(err.detail, rank=self.rank, op=method.__name__,
                                peer=err.peer) from None

    return checked


@dataclass(slots=True)  # made once per op: no frozen-attribute overhead
class _Collective:
    """A collective on its way to the worker: its entry in the table of collectives, the
    op as the wire sees it (less the algorithm, which the schedule names) and its buffers.
    The schedule is built from the same fields, on the worker."""

    spec: Collective
    dtype: np.dtype
    buffers: dict[str, Buffer]
    result: Any
    reduce: ReduceOp | None = None
    arg: int = -1
    count: int = 0  # the block: what the schedule cuts and every pair agrees on
    segment: int = 0  # bytes: the agreed setting, whatever the dtype makes of it
    send_counts: tuple[int, ...] | None = None
    recv_counts: tuple[int, ...] | None = None
    algorithm: str | None = None  # None: the table's choice


_SEQ = struct.Struct("<Q")  # a header's first field


@dataclass(frozen=True, slots=True)
class _BoardPlan:
    """A blocking allreduce on the board, ready to run again: everything about it but
    the buffer and the sequence number (``Communicator._allreduce_now``)."""

    program: BoardProgram
    reduce: ReduceOp
    desc: OpDescriptor  # of sequence number 0
    header: bytes  # the post's, packed, for sequence number 0

    after_seq: bytes = field(init=False)  # the header but its first field

    def __post_init__(self) -> None:
        object.__setattr__(self, "after_seq", self.header[_SEQ.size:])

    def header_of(self, seq: int) -> bytes:
        return _SEQ.pack(seq) + self.after_seq


# the plan of every allreduce in a group of one: the result is the input (checked once)
_ALONE = _BoardPlan(None, None, None, b"")  # type: ignore[arg-type]


# What the worker's queue carries: a collective with its sequence number and name, or a
# point-to-point op.
_Queued = tuple[_Collective, int, str] | P2POp


class Communicator:
    """A group of ``world_size`` ranks, seen from ``rank``, over a ``Transport``.

    Build one with ``ringcomm.init``, which does the rendezvous and hands it the
    ``settings`` and the ``topology`` that every rank agreed on there. Groups inside one
    process (tests, ``ringcomm.runtime.local``) build them directly over in-memory transports,
    where every rank reads the same environment; ``segment_bytes`` overrides the agreed
    segment size (every rank must pass the same).

    Arrays may be numpy arrays or torch CPU tensors, used in place, or of any kind
    registered in ``ringcomm.core.arrays`` (a device array is staged through host memory).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        timeout: float = 300.0,
        settings: Settings | None = None,
        topology: Topology | None = None,
        segment_bytes: int | None = None,
        on_close: Sequence[Callable[[], None]] = (),
        connect: Callable[[tuple[int, ...], str], Transport] | None = None,
    ) -> None:
        settings = settings or Settings.local(segment_bytes=segment_bytes)
        if segment_bytes is None:
            segment_bytes = settings.segment_bytes
        if segment_bytes <= 0:
            raise ArgumentError(f"segment_bytes must be positive, got {segment_bytes}")
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.settings = settings
        self.topology = topology or Topology.single_host(self.world_size)
        self.timeout = float(timeout)
        self.segment_bytes = int(segment_bytes)
        self._chosen: dict[tuple[int, int], str] = {}  # (bytes, itemsize) -> allreduce algorithm
        self._board_plans: dict[tuple[np.dtype, int, str], _BoardPlan] = {}
        self._one_shot_bytes = board_schedules.one_shot_bytes(self.world_size)
        self.trace: list[TraceEvent] | None = None
        self._on_close = list(on_close)
        self._connect = connect  # (member ranks, tag) -> this rank's transport among them
        self._split_numbers = itertools.count()
        self._seq = itertools.count()
        self._p2p_sent = [0] * self.world_size
        self._p2p = P2PEngine(self)
        self.inline_bytes = inline_bytes(self.topology.spare_core(self.rank))
        self._failure: CommError | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[_Queued, concurrent.futures.Future[Any]] | None] = \
            queue.SimpleQueue()
        self._count_lock = threading.Lock()
        self._outstanding = 0  # ops issued and not finished (posted receives count as busy)
        self._worker = threading.Thread(target=self._work, name=f"ringcomm-rank{self.rank}",
                                        daemon=True)
        self._worker.start()

    def adopt(self, settings: Settings) -> None:
        """Run with ``settings`` from now on: every rank must adopt the same at the same
        point (as ``ringcomm.bootstrap.link_probe`` does at init), since choices follow from
        them."""
        self.settings = settings
        self._chosen.clear()
        self._board_plans.clear()

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each host, hosts in the order of their lowest rank: gathered from
        every rank at init, the same on every rank."""
        return self.topology.hosts

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks that share this rank's host (this one included)."""
        return next(h for h in self.topology.hosts if self.rank in h)

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """A communicator of the ranks that pass the same ``color`` (every rank calls this,
        as with ``MPI_Comm_split``), ranked by ``key`` (default: this rank), then by rank;
        ``color=None`` takes no part and gets None. The new one has its own links, so
        its ops never mix with this one's; close it before this one.

        Example::

            local = comm.split(comm.hosts.index(comm.local_ranks))  # one per host
        """
        if self._connect is None:
            raise ArgumentError("this communicator was built without a way to connect "
                                "subgroups (build it with ringcomm.init or run_group)",
                                rank=self.rank, op="split")
        for value, what in ((color, "color"), (key, "key")):
            if value is not None and (not isinstance(value, (int, np.integer)) or
                                      isinstance(value, bool) or value < 0):
                raise ArgumentError(f"split: {what} must be a non-negative int or None, got "
                                    f"{value!r}", rank=self.rank, op="split")
        mine = np.array([-1 if color is None else color,
                         self.rank if key is None else key], np.int64)
        everyone = np.empty(2 * self.world_size, np.int64)
        self.allgather(everyone, mine)
        number = next(self._split_numbers)
        if color is None:
            return None
        pairs = everyone.reshape(-1, 2)
        members = tuple(sorted((r for r in range(self.world_size) if pairs[r][0] == color),
                               key=lambda r: (pairs[r][1], r)))
        transport = self._connect(members, f"split{number}/{color}")
        sub = Communicator(transport, timeout=self.timeout, settings=self.settings,
                           topology=Topology(tuple(self.topology.ranks[r] for r in members)),
                           segment_bytes=self.segment_bytes, connect=None)
        sub.barrier()  # every member is connected
        return sub

    # ------------------------------------------------------------------ collectives
    @_names_bad_input
    def allreduce(self, x: Any, op: str = "sum", *, algorithm: str | None = None,
                  async_op: bool = False) -> Any:
        """Reduce ``x`` across ranks, in place; every rank gets the result. Returns ``x``.

        ``algorithm`` (``ring``, ``tree``, ``dbtree``, ``hd``, ``rd``, ``hier``, or on the
        shared board ``board`` and ``twoshot``) forces one for this call, as
        ``RINGCOMM_ALGO`` (which must be the same on every rank) does for all. By default a
        group whose ranks share one host runs every allreduce on the shared board (one-shot
        up to ``one_shot_bytes``, two-shot above), and any other group takes the cost
        model's cheapest link algorithm (``ringcomm.plan.cost``). The automatic choice is a
        function of the size, the dtype, the board that all ranks set up together, the
        settings agreed at init and the table of every rank's host and cores, so it is the
        same on every rank; a forced one that differs between ranks is caught at the first
        message or post.
        """
        data = as_buffer(x, name="x")
        if algorithm is None and not async_op and self._allreduce_now(data, op):
            return x
        rop = reduce_op(op, data.dtype)
        name = self.allreduce_algorithm(data.nbytes, data.dtype.itemsize, algorithm)
        return self._submit(_Collective(
            COLLECTIVES["allreduce"], data.dtype, {"data": data}, x, rop, count=data.count,
            segment=self.segment_bytes, algorithm=name), async_op)

    @_names_bad_input
    def allreduce_now(self, x: Any, op: str = "sum") -> bool:
        """``allreduce(x, op)`` if it can run on this thread from start to end at once (the
        short way: a group on one host's board, nothing queued, no trace kept); else False,
        having done nothing. For a caller lending memory only for the call: a view that
        keeps nothing alive must not reach an op that might outlive it."""
        return self._allreduce_now(as_buffer(x, name="x"), op)

    def allreduce_algorithm(self, nbytes: int, itemsize: int = 4,
                            forced: str | None = None) -> str:
        """The allreduce algorithm this communicator runs for ``nbytes`` of ``itemsize``-byte
        elements: ``forced``, else the agreed ``RINGCOMM_ALGO``, else with a shared board
        the one-shot or the two-shot by size, else the cost model's choice from the agreed
        settings and topology (the same on every rank)."""
        if forced is not None:
            name = forced.lower() if isinstance(forced, str) else forced
            if name in ON_BOARD:
                self._check_board(name, nbytes)
            elif name not in ALLREDUCE:
                raise ArgumentError(
                    f"allreduce algorithm {forced!r} is unknown; use one of "
                    f"{', '.join((*ALLREDUCE, *ON_BOARD))}, or leave it unset for the "
                    "automatic choice")
            return name
        if self.settings.algorithm is not None:
            return self.settings.algorithm
        if self.transport.board is not None:
            return "board" if nbytes <= self._one_shot_bytes else "twoshot"
        key = (nbytes, itemsize)
        chosen = self._chosen.get(key)
        if chosen is None:  # the model costs tens of microseconds: ask once per size
            chosen = self._chosen[key] = cost.choose(
                "allreduce", self.world_size, nbytes, itemsize,
                segment_bytes=self.segment_bytes,
                params=self.settings.cost_params(self.world_size),
                share=self.topology.cores_per_rank, hosts=self.topology.hosts,
                remote=self.settings.remote)
        return chosen

    def _allreduce_now(self, data: Buffer, op: str) -> bool:
        """The short way for the commonest call, a blocking allreduce on the shared board
        (or in a group of one, which has nothing to exchange): its plan is made once per
        dtype, size and op, and it runs on the caller's thread without an op record, a
        queue or a schedule walk. Returns False, having done nothing, where the general way
        must take it (no board, ops still queued, a trace to keep or a line to log per op,
        a closed or failed communicator: that way raises what it must)."""
        key = (data.dtype, data.count, op)
        plan = self._board_plans.get(key)
        if plan is None:
            alone = self.world_size == 1
            if (not isinstance(op, str) or self.settings.algorithm is not None
                    or (self.transport.board is None and not alone)):
                return False
            rop = reduce_op(op, data.dtype)
            if alone:
                self._board_plans[key] = _ALONE
                return self._allreduce_now(data, op)
            algorithm = self.allreduce_algorithm(data.nbytes, data.dtype.itemsize)
            program = board_program(COLLECTIVES["allreduce"].schedule(
                self.rank, self.world_size, data.count, self._segment(data),
                algorithm=algorithm, piece=board.SLOT_BYTES // data.dtype.itemsize))
            desc = OpDescriptor(int(OpKind.ALLREDUCE), 0, dtype_code(data.dtype),
                                algorithm_code(algorithm), reduce_code(rop), -1,
                                self.segment_bytes, data.count)
            header = board_header(desc, data.dtype.itemsize)
            if len(self._board_plans) >= 256:  # many sizes: keep the latest
                del self._board_plans[next(iter(self._board_plans))]
            plan = self._board_plans[key] = _BoardPlan(program, rop, desc, header)
        if self.trace is not None or log.isEnabledFor(logging.DEBUG):  # the general way
            return False  # keeps a trace and logs a line per op
        with self._count_lock:
            if self._outstanding or self._closed or self._failure is not None or \
                    self._p2p.busy:  # ``idle`` spelled out: the hottest path
                return False
            self._outstanding += 1
        seq = next(self._seq)
        if plan is _ALONE:  # the values stay; a staged buffer still goes through its stages
            try:
                data.before_op()
                data.after_op()
            finally:
                self._op_done()
            return True
        name = f"allreduce #{seq}"
        try:
            if plan.program.whole is not None and type(data) is HostBuffer:
                run_board_whole(plan.program, data.region(0, data.count), self.transport,
                                plan.header_of(seq), time.monotonic() + self.timeout, name,
                                plan.reduce)
            else:
                run_board(plan.program, {"data": data}, self.transport,
                          OpContext(plan.desc, name, data.dtype,
                                    time.monotonic() + self.timeout, plan.reduce),
                          header=plan.header_of(seq))
        except CommError as err:
            self._fail(err, seq)
            self._p2p.fail_all(err)
            raise
        finally:
            self._op_done()
        return True

    @property
    def _board_bytes(self) -> int:
        """The largest message this group's broadcasts and all-gathers put on the board in
        one post for every rank to read; -1 without a board."""
        return board_schedules.SMALL_BYTES if self.transport.board is not None else -1

    def _check_board(self, algorithm: str, nbytes: int) -> None:
        if self.transport.board is None:
            raise ArgumentError(
                f"algorithm {algorithm!r} needs the shared board, which this group does not "
                "have (its ranks span hosts, shared memory is off, or RINGCOMM_BOARD=0 on "
                "some rank); choose another algorithm")
        if algorithm == "board" and nbytes > board.SLOT_BYTES:
            raise ArgumentError(f"algorithm 'board' takes at most {board.SLOT_BYTES} B per "
                                f"rank, got {nbytes} B; choose 'twoshot' or another algorithm")

    @_names_bad_input
    def broadcast(self, x: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Copy root's ``x`` into ``x`` on every rank. Returns ``x``."""
        self._check_rank(root, "root")
        data = as_buffer(x, name="x", reads=self.rank == root)
        algorithm = "board" if data.nbytes <= self._board_bytes else None
        return self._submit(_Collective(COLLECTIVES["broadcast"], data.dtype, {"data": data}, x,
                                        arg=root, count=data.count, segment=self.segment_bytes,
                                        algorithm=algorithm), async_op)

    @_names_bad_input
    def reduce(self, x: Any, root: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        """Reduce ``x`` across ranks into root's ``x``; other ranks' ``x`` is left unchanged."""
        data = as_buffer(x, name="x")
        self._check_rank(root, "root")
        rop = reduce_op(op, data.dtype)
        return self._submit(_Collective(
            COLLECTIVES["reduce"], data.dtype, {"data": data}, x, rop, arg=root,
            count=data.count, segment=self.segment_bytes), async_op)

    @_names_bad_input
    def allgather(self, out: Any, x: Any, *, async_op: bool = False) -> Any:
        """Concatenate every rank's ``x`` (rank order) into ``out`` on every rank."""
        data = as_buffer(x, name="x", writable=False)
        result = as_buffer(out, name="out", reads=False)
        self._check_same_dtype(result, data, "out", "x")
        self._check_size(result, data.count * self.world_size, "out", "world_size * x.size")
        algorithm = "board" if data.nbytes <= self._board_bytes else None
        return self._submit(_Collective(
            COLLECTIVES["allgather"], data.dtype, {"input": data, "output": result}, out,
            count=data.count, segment=self.segment_bytes, algorithm=algorithm), async_op)

    @_names_bad_input
    def reduce_scatter(self, out: Any, x: Any, op: str = "sum", *,
                       async_op: bool = False) -> Any:
        """Reduce ``x`` (``world_size`` equal blocks) across ranks; rank ``r`` gets block ``r``."""
        data = as_buffer(x, name="x", writable=False)
        result = as_buffer(out, name="out", reads=False)
        self._check_same_dtype(result, data, "out", "x")
        self._check_size(data, result.count * self.world_size, "x", "world_size * out.size")
        rop = reduce_op(op, data.dtype)
        return self._submit(_Collective(
            COLLECTIVES["reduce_scatter"], data.dtype, {"input": data, "output": result}, out,
            rop, count=result.count, segment=self.segment_bytes), async_op)

    @_names_bad_input
    def gather(self, out: Any | None, x: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Concatenate every rank's ``x`` into root's ``out``; ``out`` is ignored elsewhere."""
        self._check_rank(root, "root")
        data = as_buffer(x, name="x", writable=False)
        buffers: dict[str, Buffer] = {"input": data}
        if self.rank == root:
            if out is None:
                raise ArgumentError("gather: the root must pass `out` for the result")
            result = as_buffer(out, name="out", reads=False)
            self._check_same_dtype(result, data, "out", "x")
            self._check_size(result, data.count * self.world_size, "out", "world_size * x.size")
            buffers["output"] = result
        return self._submit(_Collective(
            COLLECTIVES["gather"], data.dtype, buffers, out, arg=root, count=data.count,
            segment=self.segment_bytes), async_op)

    @_names_bad_input
    def scatter(self, x: Any, inputs: Any | None = None, root: int = 0, *,
                async_op: bool = False) -> Any:
        """Root's ``inputs`` (one array of ``world_size`` blocks, or a list of them) is cut
        into blocks; rank ``r`` receives block ``r`` into ``x``."""
        self._check_rank(root, "root")
        result = as_buffer(x, name="x", reads=False)
        buffers: dict[str, Buffer] = {"output": result}
        if self.rank == root:
            if inputs is None:
                raise ArgumentError("scatter: the root must pass `inputs`")
            if isinstance(inputs, (list, tuple)):
                if len(inputs) != self.world_size:
                    raise ArgumentError(
                        f"scatter: {len(inputs)} inputs for a world of {self.world_size}")
                parts = [as_buffer(t, name=f"inputs[{i}]", writable=False)
                         for i, t in enumerate(inputs)]
                for i, part in enumerate(parts):
                    self._check_same_dtype(part, result, f"inputs[{i}]", "x")
                    self._check_size(part, result.count, f"inputs[{i}]", "x.size")
                source: Buffer = concatenate(parts, "inputs")
            else:
                source = as_buffer(inputs, name="inputs", writable=False)
                self._check_same_dtype(source, result, "inputs", "x")
                self._check_size(source, result.count * self.world_size, "inputs",
                                 "world_size * x.size")
            buffers["input"] = source
        return self._submit(_Collective(
            COLLECTIVES["scatter"], result.dtype, buffers, x, arg=root, count=result.count,
            segment=self.segment_bytes), async_op)

    @_names_bad_input
    def alltoall(
        self,
        out: Any,
        x: Any,
        *,
        out_splits: Sequence[int] | None = None,
        in_splits: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Any:
        """Block ``i`` of ``x`` goes to rank ``i``; block ``j`` of ``out`` comes from rank ``j``.

        Blocks are equal unless ``in_splits``/``out_splits`` give their sizes (elements)."""
        data = as_buffer(x, name="x", writable=False)
        result = as_buffer(out, name="out", reads=False)
        self._check_same_dtype(result, data, "out", "x")
        send_counts = self._splits(in_splits, data, "in_splits", "x")
        recv_counts = self._splits(out_splits, result, "out_splits", "out")
        return self._submit(_Collective(
            COLLECTIVES["alltoall"], data.dtype, {"input": data, "output": result}, out,
            segment=self.segment_bytes, send_counts=send_counts, recv_counts=recv_counts), async_op)

    @_names_bad_input
    def barrier(self, *, async_op: bool = False) -> Any:
        """Return once every rank has entered the barrier."""
        empty = HostBuffer(np.zeros(0, np.uint8), "barrier")
        algorithm = "board" if self.transport.board is not None else None
        return self._submit(_Collective(COLLECTIVES["barrier"], empty.dtype, {"data": empty},
                                        None, algorithm=algorithm), async_op)

    @_names_bad_input
    def send(self, x: Any, dst: int, tag: int = 0, *, async_op: bool = False) -> Any:
        """Send ``x`` to rank ``dst``; matched, in order, by ``recv(src=this rank)`` there.

        Completes once the data has left this process (the receiver need not have posted
        its receive yet, except for large payloads that wait in the socket)."""
        data = as_buffer(x, name="x", writable=False)
        self._check_rank(dst, "dst", allow_self=False)
        self._check_tag(tag)
        if self._closed:
            raise CommAborted("this communicator is closed", rank=self.rank)
        seq = self._p2p_sent[dst]
        self._p2p_sent[dst] += 1
        op = P2POp(True, dst, int(tag), data, seq, f"send #{seq} to rank {dst}", x)
        return self._enqueue(op, op.name, async_op)

    @_names_bad_input
    def recv(self, x: Any, src: int | None = None, tag: int = 0, *,
             async_op: bool = False) -> Any:
        """Receive into ``x`` the next message that rank ``src`` sent to this rank.

        ``src=None`` takes the next message from any rank; the returned ``Work`` (with
        ``async_op=True``) then tells which in ``work.source``. Returns ``x``."""
        data = as_buffer(x, name="x", reads=False)
        if src is None:
            if self.world_size == 1:
                raise ArgumentError("recv from any source in a world of one rank: there is "
                                    "no other rank to receive from", rank=self.rank)
            name = "recv from any rank"
        else:
            self._check_rank(src, "src", allow_self=False)
            name = f"recv from rank {src}"
        self._check_tag(tag)
        op = P2POp(False, src, int(tag), data, -1, name, x)
        return self._enqueue(op, name, async_op)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Finish queued ops, stop the worker, close the links (and the store, if ours).

        Sends still in flight get until their deadline to leave; receives still waiting for
        their message fail with ``CommAborted``. If a peer's message of a collective is
        waiting that no op here took, the ranks disagreed about an op in a way this rank
        could not see while it only sent (two ranks that both think they are a broadcast's
        root): everything is closed all the same, then ``DesyncError`` says so."""
        self._close(check=True)

    def _close(self, *, check: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        if threading.current_thread() is not self._worker:
            self._worker.join()
        stray = self.transport.leftover() if self._failure is None else None
        self.transport.close()
        for fn in self._on_close:
            fn()
        if stray is not None:
            err = DesyncError(
                f"a message of rank {stray.sender}'s {stray.describe()} was still waiting "
                "here, and no op of this rank took it: the ranks disagreed about an op (a "
                "rank whose part of it only sends, like a broadcast's root, returns before it "
                "can tell). Every rank must call the same collectives in the same order with "
                "the same root.", rank=self.rank, op="close", peer=stray.sender)
            if check:
                raise err
            log.warning("%s", err)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._close(check=exc_type is None)  # never hide the error already on its way

    def __repr__(self) -> str:
        return f"<ringcomm.Communicator rank {self.rank} of {self.world_size}>"

    # ------------------------------------------------------------------ internals
    def _submit(self, op: _Collective, async_op: bool) -> Any:
        if self._closed:
            raise CommAborted("this communicator is closed", rank=self.rank)
        seq = next(self._seq)
        name = f"{op.spec.name} #{seq}"
        return self._enqueue((op, seq, name), name, async_op)

    def _enqueue(self, item: _Queued, name: str, async_op: bool) -> Any:
        if self._closed:
            raise CommAborted("this communicator is closed", rank=self.rank)
        inline = not isinstance(item, P2POp) and (not async_op or self._small(item[0]))
        with self._count_lock:
            # A collective with nothing ahead of it runs on the caller's thread when the
            # caller waits for it anyway, or when it is no larger than ``inline_bytes``
            # (64 KiB; every size where the host has no spare core for the worker): the
            # order is the same, and two thread hand-offs (tens of microseconds each on a
            # busy machine, more than a small op takes) are saved. Such an async op then
            # returns completed, its error (if any) kept for ``wait``. The worker cannot
            # start anything meanwhile: its queue is empty and no receive is posted.
            inline = inline and self.idle
            self._outstanding += 1
        if inline:
            assert not isinstance(item, P2POp)  # only collectives run inline
            try:
                result = self._run(*item)
            except BaseException as err:
                if self._failure is not None:
                    self._p2p.fail_all(self._failure)
                if async_op and isinstance(err, Exception):
                    return Work.finished(name, self.timeout, error=err)
                raise
            finally:
                self._op_done()
            return Work.finished(name, self.timeout, result) if async_op else result
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        work = Work(future, name, self.timeout)
        if isinstance(item, P2POp):
            item.work = work
        self._queue.put((item, future))
        return work if async_op else work.wait()

    def _small(self, op: _Collective) -> bool:
        return all(b.nbytes <= self.inline_bytes for b in op.buffers.values())

    @property
    def idle(self) -> bool:
        """Whether nothing is queued or in flight here (no op for the worker, no receive
        posted): a blocking op started now on this thread runs on it from start to end, so
        memory lent only for the call (a view that keeps nothing alive) is safe to use."""
        return self._outstanding == 0 and not self._p2p.busy

    def _op_done(self) -> None:
        with self._count_lock:
            self._outstanding -= 1

    def _work(self) -> None:
        p2p = self._p2p
        while True:
            if p2p.busy:
                try:
                    entry = self._queue.get_nowait()
                except queue.Empty:
                    p2p.progress()
                    continue
            else:
                entry = self._queue.get()
            if entry is None:
                p2p.close()
                return
            item, future = entry
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                if isinstance(item, P2POp):
                    p2p.start(item, future)
                    continue
                try:
                    future.set_result(self._run(*item))
                except BaseException as err:  # noqa: BLE001 - delivered via the future
                    future.set_exception(err)
                    if self._failure is not None:
                        p2p.fail_all(self._failure)
            finally:
                self._op_done()

    def _fail(self, err: CommError, seq: int) -> None:
        """Mark this communicator failed and, unless a peer told us, tell every peer."""
        self._failure = err
        if not isinstance(err, RemoteError):
            self.transport.abort(seq, f"{type(err).__name__}: {err}")

    def _run(self, op: _Collective, seq: int, name: str) -> Any:
        if self._failure is not None:
            raise CommAborted(
                f"an earlier op failed ({self._failure}); this communicator cannot be used "
                "any more: create a new one", rank=self.rank, op=name,
            )
        dtype = np.dtype(op.dtype)
        schedule = op.spec.schedule(
            self.rank, self.world_size, op.count, max(1, op.segment // max(1, dtype.itemsize)),
            root=op.arg, algorithm=op.algorithm, hosts=self.topology.hosts,
            nbytes=op.count * dtype.itemsize, send_counts=op.send_counts,
            recv_counts=op.recv_counts, piece=board.SLOT_BYTES // dtype.itemsize)
        buffers = op.buffers
        if schedule.scratch:
            buffers = dict(buffers, scratch=HostBuffer(self._scratch(dtype, schedule.scratch),
                                                       "scratch"))
        desc = OpDescriptor(int(op.spec.kind), seq, dtype_code(dtype),
                            algorithm_code(schedule.algorithm), reduce_code(op.reduce), op.arg,
                            op.segment, op.count, op.send_counts, op.recv_counts)
        ctx = OpContext(desc, name, dtype, time.monotonic() + self.timeout, op.reduce)
        started = time.perf_counter()
        try:
            run_schedule(schedule, buffers, self.transport, ctx, self.trace)
        except CommError as err:
            self._fail(err, seq)
            raise
        if log.isEnabledFor(logging.DEBUG):  # the arguments cost more than a small message
            log.debug("rank %d %s: %s/%s, %d B %s%s, %.1f us", self.rank, name,
                      schedule.collective, schedule.algorithm, op.count * dtype.itemsize,
                      dtype_name(dtype), f" {op.reduce.name}" if op.reduce else "",
                      (time.perf_counter() - started) * 1e6)
        return op.result

    _scratch_buf: np.ndarray | None = None

    def _scratch(self, dtype: np.dtype, count: int) -> np.ndarray:
        """Reusable scratch memory: grows to the largest need, never shrinks."""
        need = count * dtype.itemsize
        if self._scratch_buf is None or self._scratch_buf.nbytes < need:
            self._scratch_buf = np.empty(need, np.uint8)
        return self._scratch_buf[:need].view(dtype)

    def _segment(self, data: Buffer) -> int:
        return max(1, self.segment_bytes // max(1, data.dtype.itemsize))

    def _check_rank(self, r: int, what: str, *, allow_self: bool = True) -> None:
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool):
            raise ArgumentError(f"{what} must be an int rank, got {r!r}", rank=self.rank)
        if not 0 <= r < self.world_size:
            raise ArgumentError(
                f"{what}={r} is out of range: ranks are 0..{self.world_size - 1}",
                rank=self.rank)
        if not allow_self and r == self.rank:
            raise ArgumentError(f"{what}={r} is this rank itself", rank=self.rank)

    def _check_tag(self, tag: int) -> None:
        if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool) or \
                not 0 <= tag < 2**31:
            raise ArgumentError(f"tag must be an int in 0..2**31-1, got {tag!r}", rank=self.rank)

    def _check_same_dtype(self, a: Buffer, b: Buffer, an: str, bn: str) -> None:
        if a.dtype != b.dtype:
            raise ArgumentError(
                f"{an} is {dtype_name(a.dtype)} but {bn} is {dtype_name(b.dtype)}; "
                "they must match", rank=self.rank)

    def _check_size(self, a: Buffer, want: int, an: str, wantn: str) -> None:
        if a.count != want:
            raise ArgumentError(
                f"{an} has {a.count} elements but must have {wantn} = {want}", rank=self.rank)

    def _splits(self, splits: Sequence[int] | None, arr: Buffer, what: str,
                arrn: str) -> tuple[int, ...]:
        n = self.world_size
        if splits is None:
            if arr.count % n:
                raise ArgumentError(
                    f"{arrn} has {arr.count} elements, not divisible by world_size {n}; "
                    f"pass {what}", rank=self.rank)
            return (arr.count // n,) * n
        counts = tuple(int(s) for s in splits)
        if len(counts) != n or any(c < 0 for c in counts) or sum(counts) != arr.count:
            raise ArgumentError(
                f"{what}={list(counts)} must be {n} non-negative sizes adding up to "
                f"{arrn}.size = {arr.count}", rank=self.rank)
        return counts


EVERY_SIZE = sys.maxsize


def inline_bytes(spare_core: bool = True) -> int:
    """Async collectives up to this many bytes per buffer run on the caller's thread when
    nothing is queued (``RINGCOMM_INLINE_BYTES``; 0 sends every async op to the worker).
    Below it an op takes less than the thread hand-offs it would cost; above it, overlap
    with the caller's work (DDP's buckets during backward) pays, where there is a
    ``spare_core`` for the worker to run on. Where there is none (a rank per core), the
    worker would take turns with its own rank on one core, so every size runs inline: DDP's
    step at world size 2 on two cores, 11.1 ms with its buckets handed to the worker, takes
    9.1 ms so (7.1 MiB of gradients)."""
    value: int | None = config.value("inline_bytes")
    if value is None:
        return DEFAULT_INLINE_BYTES if spare_core else EVERY_SIZE
    return value
