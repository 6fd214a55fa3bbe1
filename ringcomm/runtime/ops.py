"""Running a communicator's ops: in issue order, on one worker thread or the caller's, each
on the engine the selector chose.

Why a worker thread: ops must run in the order they were issued on every rank (that is what
keeps ranks in step), and ``async_op=True`` must let the caller compute while bytes move.
One thread per communicator, fed by a queue, gives both, like a CUDA stream. A collective
with nothing queued ahead of it runs on the caller's thread instead when the caller waits
for it anyway, or when it is small (``inline_bytes``): the order is the same, and two thread
hand-offs are saved.

Point-to-point ops never hold the worker: the point-to-point engine (``p2p``) completes
sends as their data leaves and receives as their messages arrive, while the worker goes on
with later ops and looks for messages whenever it is idle.

Failure contract: an op that fails raises a typed ``CommError`` naming this rank and the op;
before raising, the rank tells every peer (``abort``), so that they raise too instead of
waiting out their timeout. A communicator that has failed stays failed (``CommAborted``).
The abort it sends names the first collective this rank does not complete, and a rank that
completes a collective over links asks, before it returns, whether a peer's abort for that
collective has come (``Transport.check_aborted``): a peer's message that arrived before it
failed may be all a rank needs, and no rank reports success for a collective that another
rank failed (on the board, a failed rank withdraws its post instead).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.algorithms import BOARD
from ..core.arrays import HOST, HOST_ONLY, Buffer, HostBuffer
from ..core.dtypes import ReduceOp, dtype_code, dtype_name, reduce_op
from ..engines.context import OpContext
from ..engines.wrapping import Wiring
from ..errors import CommAborted, CommError, RemoteError
from ..plan.collectives import COLLECTIVES, Collective
from ..plan.select import Choice, Selector
from ..plan.topology import Topology
from ..transport.base import Transport
from ..transport.board import SLOT_BYTES
from ..transport.header import OpDescriptor, OpKind, algorithm_code, reduce_code
from .hang_report import HangReporter, ReportStore
from .p2p import P2PEngine, P2POp
from .scratch import Scratch
from .work import Work

log = logging.getLogger("ringcomm")


@dataclass(slots=True)  # made once per op: no frozen-attribute overhead
class CollectiveCall:
    """A collective on its way to its engine: its entry in the table of collectives, the
    selector's choice, the op as the wire sees it and its buffers. The schedule is built
    from the same fields, where the op runs."""

    spec: Collective
    dtype: np.dtype
    buffers: dict[str, Buffer]
    result: Any
    choice: Choice
    memory: str  # where the buffers' memory lives (HOST, or a device's where any does)
    reduce: ReduceOp | None = None
    arg: int = -1
    count: int = 0  # the block: what the schedule cuts and every pair agrees on
    send_counts: tuple[int, ...] | None = None
    recv_counts: tuple[int, ...] | None = None


def drop_locals(err: BaseException) -> None:
    """Clear the variables of ringcomm's own frames in ``err``'s traceback (and in those of
    the errors it was raised from): the error keeps its message and where it was raised,
    but no longer the memory its op was using (views of the shared board, buffers), which
    would otherwise stay mapped for as long as the program keeps the error."""
    seen: set[int] = set()
    error: BaseException | None = err
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):
                with contextlib.suppress(RuntimeError):  # a frame still running keeps them
                    tb.tb_frame.clear()
                    # a snapshot of the locals taken earlier (the hang report reads a step
                    # from one) outlives ``clear``: reading it again drops what is gone
                    tb.tb_frame.f_locals  # noqa: B018
            tb = tb.tb_next
        error = error.__cause__ or error.__context__


@dataclass(frozen=True)
class _BetweenOps:
    """Work for the worker between two ops (``OpRunner.between_ops``)."""

    run: Callable[[], Any]


# What the worker's queue carries: a collective with its sequence number and name, a
# point-to-point op, or work between ops.
Queued = tuple[CollectiveCall, int, str] | P2POp | _BetweenOps

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ABORT_WAIT_S = 5.0  # the most ``abort`` waits for ops to unwind before it lets go
_ALONE = object()  # the plan of every allreduce in a group of one: nothing to exchange
_NO_PLAN = object()  # a call the fast entry does not take (the general way runs it)


class OpRunner:
    """The ops of one communicator (rank ``transport.rank``), run in issue order on the
    engines of ``wiring`` as ``selector`` chose them; an op that times out leaves a hang
    report, gathered through ``store`` where the group has one (``hang_report``)."""

    def __init__(self, transport: Transport, wiring: Wiring, selector: Selector,
                 topology: Topology, timeout: float, inline_bytes: int,
                 store: ReportStore | None = None) -> None:
        self.transport = transport
        self.wiring = wiring
        self.selector = selector
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.hosts = topology.hosts
        self.timeout = timeout
        self.segment_bytes = selector.group.segment_bytes
        self.inline_bytes = inline_bytes
        self.scratch = Scratch()
        self._plans: dict[tuple[np.dtype, int, str], Any] = {}  # the fast entry's
        self._seq = itertools.count()
        self._failure: CommError | None = None
        self._completed = 0  # collectives completed here: the first one this rank does not
        self.hang = HangReporter(self.rank, self.world_size, store)
        self._peers_told = False  # this rank's failure went out to its peers
        self._tell_lock = threading.Lock()
        self.closed = False
        self._queue: queue.SimpleQueue[tuple[Queued, concurrent.futures.Future[Any]] | None] \
            = queue.SimpleQueue()
        self._count_lock = threading.Lock()
        self._outstanding = 0  # ops issued and not finished (posted receives count as busy)
        # callers inside an op: running it on their own thread, or waiting for the worker to
        # run their blocking op (``closing``: closing under them is an abort)
        self._callers = 0
        self.p2p = P2PEngine(self)
        self._worker = threading.Thread(target=self._work, name=f"ringcomm-rank{self.rank}",
                                        daemon=True)
        self._worker.start()

    @property
    def failure(self) -> CommError | None:
        return self._failure

    def forget_plans(self) -> None:
        """The choices may change (new agreed settings, other engines): plan afresh."""
        self._plans.clear()

    # ------------------------------------------------------------------ issuing
    def submit(self, call: CollectiveCall, async_op: bool) -> Any:
        if self.closed:
            raise CommAborted("this communicator is closed", rank=self.rank)
        seq = next(self._seq)
        name = f"{call.spec.name} #{seq}"
        return self.enqueue((call, seq, name), name, async_op)

    def enqueue(self, item: Queued, name: str, async_op: bool) -> Any:
        if self.closed:
            raise CommAborted("this communicator is closed", rank=self.rank)
        inline = isinstance(item, tuple) and (not async_op or self._small(item[0]))
        with self._count_lock:
            if self.closed:  # looked at again where ``closing`` looks: none starts after it
                raise CommAborted("this communicator is closed", rank=self.rank)
            # A collective with nothing ahead of it runs on the caller's thread when the
            # caller waits for it anyway, or when it is no larger than ``inline_bytes``
            # (64 KiB; every size where the host has no spare core for the worker): the
            # order is the same, and two thread hand-offs (tens of microseconds each on a
            # busy machine, more than a small op takes) are saved. Such an async op then
            # returns completed, its error (if any) kept for ``wait``. The worker cannot
            # start anything meanwhile: its queue is empty and no receive is posted.
            inline = inline and self.idle
            self._outstanding += 1
            waits = inline or not async_op
            self._callers += waits
        if inline:
            assert isinstance(item, tuple)  # only collectives run inline
            try:
                result = self._run(*item)
            except BaseException as err:
                if self._failure is not None:
                    self.p2p.fail_all(self._failure)
                if async_op and isinstance(err, Exception):
                    return Work.finished(name, self.timeout, error=err)
                raise
            finally:
                self._op_done(caller=True)
            return Work.finished(name, self.timeout, result) if async_op else result
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        work = Work(future, name, self.timeout)
        if isinstance(item, P2POp):
            item.work = work
        self._queue.put((item, future))
        if async_op:
            return work
        try:
            return work.wait()
        finally:
            with self._count_lock:
                self._callers -= 1

    def _small(self, call: CollectiveCall) -> bool:
        return all(b.nbytes <= self.inline_bytes for b in call.buffers.values())

    @property
    def idle(self) -> bool:
        """Whether nothing is queued or in flight here (no op for the worker, no receive
        posted): a blocking op started now on this thread runs on it from start to end, so
        memory lent only for the call (a view that keeps nothing alive) is safe to use."""
        return self._outstanding == 0 and not self.p2p.busy

    def _op_done(self, caller: bool = False) -> None:
        with self._count_lock:
            self._outstanding -= 1
            self._callers -= caller

    # ------------------------------------------------------------------ the fast entry
    def allreduce_now(self, data: Buffer, op: str) -> bool:
        """The short way for the commonest call, a blocking allreduce on an engine with a
        fast entry (the board), or in a group of one, which has nothing to exchange: its
        plan is made once per dtype, size and op, and it runs on the caller's thread
        without an op record, a queue or a schedule walk. Returns False, having done
        nothing, where the general way must take it (no fast entry, ops still queued, a
        line to log per op, a closed or failed communicator: that way raises what it
        must)."""
        key = (data.dtype, data.count, op)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(data, op)
            if len(self._plans) >= 256:  # many sizes: keep the latest
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        if plan is _NO_PLAN or log.isEnabledFor(logging.DEBUG):  # logs a line per op
            return False
        with self._count_lock:
            if self._outstanding or self.closed or self._failure is not None or \
                    self.p2p.busy:  # ``idle`` spelled out: the hottest path
                return False
            self._outstanding += 1
            self._callers += 1
        seq = next(self._seq)
        if plan is _ALONE:  # the values stay; a staged buffer still goes through its stages
            try:
                staged = data.staged_for(HOST_ONLY)
                staged.before_op()
                staged.after_op()
                self._completed = seq + 1
            finally:
                self._op_done(caller=True)
            return True
        engine, planned = plan
        try:
            if type(data) is not HostBuffer:
                data = data.staged_for(engine.moves)
            engine.allreduce_now(planned, data, seq, time.monotonic() + self.timeout,
                                 f"allreduce #{seq}")
            self._completed = seq + 1
        except CommError as err:
            self._fail(err)
            self.p2p.fail_all(err)
            raise
        finally:
            with self._count_lock:  # ``_op_done(caller=True)``, without its call
                self._outstanding -= 1
                self._callers -= 1
        return True

    def _plan(self, data: Buffer, op: str) -> Any:
        if not isinstance(op, str) or self.selector.group.settings.algorithm is not None:
            return _NO_PLAN
        rop = reduce_op(op, data.dtype)  # a bad op raises here, named by the caller
        if self.world_size == 1:
            if data.memory == self.selector.group.device_memory:
                return _NO_PLAN  # its device engine orders it against the caller's stream
            return _ALONE
        choice = self.selector.choose("allreduce", data.nbytes, data.dtype.itemsize,
                                      memory=data.memory)
        if choice.engine != BOARD:  # the only engine with a fast entry
            return _NO_PLAN
        engine = self.wiring.engines[choice.engine]
        itemsize = data.dtype.itemsize
        schedule = COLLECTIVES["allreduce"].schedule(
            self.rank, self.world_size, data.count, max(1, self.segment_bytes // itemsize),
            algorithm=choice.algorithm, hosts=self.hosts, piece=SLOT_BYTES // itemsize)
        desc = OpDescriptor(int(OpKind.ALLREDUCE), 0, dtype_code(data.dtype),
                            algorithm_code(choice.algorithm), reduce_code(rop), -1,
                            self.segment_bytes, data.count)
        planned = engine.plan_allreduce(schedule, desc, rop, itemsize)
        return _NO_PLAN if planned is None else (engine, planned)

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        p2p = self.p2p
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
                if self._failure is not None:  # nothing more will leave: fail them now
                    p2p.fail_all(self._failure)
                p2p.close()
                return
            item, future = entry
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                if isinstance(item, P2POp):
                    try:
                        p2p.start(item, future)
                    except BaseException as err:  # noqa: BLE001 - an injected kill of a
                        future.set_exception(err)  # thread rank: its caller gets it
                    continue
                if isinstance(item, _BetweenOps):
                    try:
                        future.set_result(item.run())
                    except BaseException as err:  # noqa: BLE001 - delivered via the future
                        future.set_exception(err)
                    continue
                try:
                    future.set_result(self._run(*item))
                except BaseException as err:  # noqa: BLE001 - delivered via the future
                    drop_locals(err)  # the caller may keep it; the op's memory it may not
                    future.set_exception(err)
                    if self._failure is not None:
                        p2p.fail_all(self._failure)
            finally:
                self._op_done()

    def between_ops(self, run: Callable[[], Any]) -> Any:
        """Run ``run`` on the worker once every op issued before has finished and before any
        issued after starts, while no point-to-point message is half read: where the links
        an op uses may be swapped (wrappers put in or taken out). Returns what it returns."""
        if self.closed:
            raise CommAborted("this communicator is closed", rank=self.rank)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._count_lock:
            self._outstanding += 1  # nothing runs inline meanwhile
        self._queue.put((_BetweenOps(run), future))
        return future.result()

    def stop(self) -> None:
        """Finish what is queued, then stop the worker (from any thread but the worker), and
        let go of the memory kept for later ops."""
        self.closed = True
        self._queue.put(None)
        if threading.current_thread() is not self._worker:
            self._worker.join()
        self.scratch = Scratch()
        self._plans.clear()
        if self._failure is not None:
            drop_locals(self._failure)
            self.hang.settle()  # before the group's store is closed

    def closing(self) -> bool:
        """No op starts from here on (``Communicator.close``); whether a caller is inside
        an op now (running it on its thread, or waiting for the worker to run it): ``close``,
        on another thread, must not close what that op uses under it, nor wait out its
        timeout, so it is aborted first (``abort``). Async ops queued with nobody waiting
        finish first (``stop`` waits for them)."""
        with self._count_lock:
            self.closed = True
            return self._callers > 0

    def abort(self, reason: str) -> None:
        """Give up now (``Communicator.abort``): no op starts from here on, the op in flight,
        if any, ends with ``CommAborted`` at once whichever thread runs it (and tells the
        peers as it fails), queued ones fail, and the peers hear that this rank failed.
        Returns once nothing runs here any more (``stop`` then finds the worker idle)."""
        self.closed = True
        if self._failure is not None:  # failed before: the peers know (from it, or told it)
            return
        if not self.idle:  # one wake for each thread that may wait on the control plane
            for _ in range(1 + (self._callers > 0)):  # (a caller's op and the worker's)
                self.transport.wake(reason)
        self._failure = CommAborted(reason, rank=self.rank)
        give_up = time.monotonic() + _ABORT_WAIT_S
        while not self.idle and time.monotonic() < give_up:
            time.sleep(0.005)  # the op in flight unwinds, queued ones fail, within ms
        with contextlib.suppress(Exception):  # best effort: peers may be gone already
            self._tell_peers(f"CommAborted: {reason}")

    def _tell_peers(self, text: str) -> None:
        """Tell every peer that this rank failed, once, from whichever thread fails first
        (the worker's op, or ``abort`` on the caller's thread): one thread at a time on the
        control plane's sockets. The abort carries the number of the first collective this
        rank does not complete (the one it failed in, or the next one)."""
        with self._tell_lock:
            if self._peers_told:
                return
            self._peers_told = True
            self.transport.abort(self._completed, text)

    # ------------------------------------------------------------------ running
    def _fail(self, err: CommError) -> None:
        """Mark this communicator failed and, unless a peer told us, tell every peer; then,
        if it was a timeout (here or on the peer that told us), leave the hang report."""
        self._failure = err
        if not isinstance(err, RemoteError):
            self._tell_peers(f"{type(err).__name__}: {err}")
        self.hang.on_failure(err)

    def _segment(self, data: Buffer) -> int:
        return max(1, self.segment_bytes // max(1, data.dtype.itemsize))

    def _run(self, call: CollectiveCall, seq: int, name: str) -> Any:
        if self._failure is not None:
            raise CommAborted(
                f"an earlier op failed ({self._failure}); this communicator cannot be used "
                "any more: create a new one", rank=self.rank, op=name,
            )
        dtype = np.dtype(call.dtype)
        choice = call.choice
        engine = self.wiring.engines[choice.engine]
        segment = max(1, choice.segment_bytes // max(1, dtype.itemsize))
        schedule = call.spec.schedule(
            self.rank, self.world_size, call.count, segment, root=call.arg,
            algorithm=choice.algorithm, hosts=self.hosts, send_counts=call.send_counts,
            recv_counts=call.recv_counts, piece=SLOT_BYTES // dtype.itemsize)
        buffers, moves = call.buffers, engine.moves
        if call.memory not in moves:  # its kind stages each buffer that needs it, once
            buffers = {role: buf.staged_for(moves) for role, buf in buffers.items()}
        if schedule.scratch and HOST in moves:  # a device engine keeps its own
            buffers["scratch"] = HostBuffer(self.scratch.get(dtype, schedule.scratch), "scratch")
        desc = OpDescriptor(int(call.spec.kind), seq, dtype_code(dtype),
                            algorithm_code(schedule.algorithm), reduce_code(call.reduce),
                            call.arg, choice.segment_bytes, call.count, call.send_counts,
                            call.recv_counts)
        ctx = OpContext(desc, name, dtype, time.monotonic() + self.timeout, call.reduce)
        if engine.plans_from_every_rank:
            ctx.schedule_of = lambda r: call.spec.schedule(
                r, self.world_size, call.count, segment, root=call.arg,
                algorithm=choice.algorithm, hosts=self.hosts, send_counts=call.send_counts,
                recv_counts=call.recv_counts, piece=SLOT_BYTES // dtype.itemsize)
        started = time.perf_counter()
        try:
            engine.run(schedule, buffers, ctx)
            if engine.name != BOARD:  # a failed rank withdraws its board post instead
                self.transport.check_aborted(seq, name)
        except CommError as err:
            self._fail(err)
            raise
        self._completed = seq + 1
        if log.isEnabledFor(logging.DEBUG):  # the arguments cost more than a small message
            log.debug("rank %d %s: %s/%s on %s, %d B %s%s, %.1f us", self.rank, name,
                      schedule.collective, schedule.algorithm, choice.engine,
                      call.count * dtype.itemsize, dtype_name(dtype),
                      f" {call.reduce.name}" if call.reduce else "",
                      (time.perf_counter() - started) * 1e6)
        return call.result
