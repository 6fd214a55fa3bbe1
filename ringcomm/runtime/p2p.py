"""Point-to-point messages (send, recv, recv from any rank) without blocking the worker.

A communicator runs its ops on one worker thread, in issue order. Collectives may block
that thread, since every rank runs them in the same order; point-to-point ops may not: two
ranks that each post a receive before their send (``batch_isend_irecv`` does exactly that)
would wait for each other forever. So the worker hands sends and receives to this engine:

- a send issues every message of ``direct.send``'s schedule at once (links never block
  on send) and completes when the link says the data has left this process;
- a receive is *posted*; whenever its queue is empty the worker waits a few milliseconds
  at a time for the first message of the oldest receive that each peer could satisfy, then
  takes the rest of that message's segments (already on their way).

A message from rank ``p`` goes to the earliest-posted receive that names ``p`` or any rank,
as in MPI; messages between two ranks match in the order they were sent, and the header
check makes a different tag, size or dtype a ``DesyncError``. Messages of collectives that
arrive meanwhile are set aside by the transport (collectives and point-to-point are two
streams), and the other way round.

A buffer's hooks run around its op: ``before_op`` when the op starts (a receive: when it
is posted), ``after_op`` when it completes (a send: once its data has left this process).

The engine relies on one property of ``Transport.recv_into``: a receive whose deadline
passes before a message of its stream arrives raises ``CommTimeout`` and consumes nothing,
so a short deadline is a poll.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.arrays import Buffer
from ..core.dtypes import dtype_code
from ..engines.progress import OpProgress, in_order
from ..errors import CommAborted, CommError, CommTimeout, PeerLostError
from ..schedules import direct
from ..transport.base import SendHandle, Transport
from ..transport.header import Header, OpKind, algorithm_code
from .work import Work

log = logging.getLogger("ringcomm")

_DIRECT = algorithm_code("direct")
POLL_S = 0.002  # how long an idle worker waits for a posted receive's message at a time


@dataclass(eq=False)
class P2POp:
    """A send or a receive on its way to the worker."""

    is_send: bool
    peer: int | None  # destination of a send; source of a receive (None: any rank)
    tag: int
    data: Buffer
    seq: int  # a send's number among the messages to ``peer``; receives learn theirs on match
    name: str
    result: Any
    work: Work | None = None


@dataclass(eq=False)
class _Posted:
    """A receive waiting for its message. ``serial`` orders it among all posted receives."""

    op: P2POp
    future: concurrent.futures.Future[Any]
    serial: int
    deadline: float


@dataclass(eq=False)
class _Sending:
    """A send whose messages have not all left this process yet."""

    op: P2POp
    future: concurrent.futures.Future[Any]
    deadline: float
    handles: list[SendHandle] = field(default_factory=list)


class Owner(Protocol):
    """What the engine uses of the communicator it serves (kept small, and an interface, so
    this module does not import the communicator that imports it)."""

    rank: int
    world_size: int
    transport: Transport
    timeout: float
    segment_bytes: int
    _failure: CommError | None

    def _segment(self, data: Buffer) -> int: ...

    def _fail(self, err: CommError) -> None: ...


class P2PEngine:
    """The pending sends and posted receives of one communicator. Only its worker thread
    touches this object."""

    def __init__(self, comm: Owner) -> None:
        self.comm = comm
        self.sending: list[_Sending] = []
        self.by_source: dict[int, deque[_Posted]] = {}
        self.any_source: deque[_Posted] = deque()
        self.matched = [0] * comm.world_size  # messages taken from each rank so far
        self.gone: set[int] = set()  # ranks whose connection closed (for any-source receives)
        self._serials = itertools.count()

    @property
    def busy(self) -> bool:
        return bool(self.sending or self.any_source or any(self.by_source.values()))

    # ---------------------------------------------------------------- entry points
    def start(self, op: P2POp, future: concurrent.futures.Future[Any]) -> None:
        comm = self.comm
        if comm._failure is not None:
            future.set_exception(CommAborted(
                f"an earlier op failed ({comm._failure}); this communicator cannot be used "
                "any more: create a new one", rank=comm.rank, op=op.name))
            return
        deadline = time.monotonic() + comm.timeout
        try:
            op.data.before_op()
        except Exception as err:  # noqa: BLE001 - the op's own error, delivered via its future
            future.set_exception(err)
            return
        if not op.is_send:
            posted = _Posted(op, future, next(self._serials), deadline)
            if op.peer is None:
                self.any_source.append(posted)
            else:
                self.by_source.setdefault(op.peer, deque()).append(posted)
            self.progress(0.0)  # a message that arrived already is taken now
            return
        sending = _Sending(op, future, deadline)
        to = op.peer
        assert to is not None, "a send names its destination"
        try:
            steps = direct.send(comm.rank, comm.world_size, to, op.data.count,
                                comm._segment(op.data)).steps
            for index, step in enumerate(steps):
                src = step.src
                assert src is not None
                header = self._header(op, comm.rank, index, src.count, op.seq)
                payload = op.data.region(src.offset, src.count) if src.count else None
                handle = comm.transport.send(to, header, payload, op.name)
                if handle is not None:
                    sending.handles.append(handle)
            comm.transport.check_delivered(to, op.name)
        except CommError as err:
            self._failed(sending, err)
            return
        self.sending.append(sending)
        self._check_sends()

    def progress(self, wait: float = POLL_S) -> None:
        """Complete what can be completed, waiting up to about ``wait`` s for messages."""
        try:
            self._check_sends()
            self._expire()
            peers = self._peers()
            if not peers:
                if self.sending and wait > 0:
                    self.sending[0].handles[0].wait(wait)  # nap instead of spinning
                return
            for peer in peers:
                if self._receive_from(peer, wait / len(peers)):
                    return  # one message per round, so queued ops are not starved
        except Exception as err:  # noqa: BLE001 - a bug here must not kill the worker
            log.exception("rank %d: point-to-point progress failed", self.comm.rank)
            self.fail_all(CommError(f"internal error in point-to-point progress: {err!r}",
                                    rank=self.comm.rank))

    def fail_all(self, cause: BaseException) -> None:
        """Fail every pending send and receive: the communicator has failed."""
        pending: list[_Posted | _Sending] = [
            *self.sending, *self.any_source, *(p for q in self.by_source.values() for p in q)]
        for item in pending:
            self._set_error(item, CommAborted(
                f"an earlier op failed ({cause}); this communicator cannot be used any more: "
                "create a new one", rank=self.comm.rank, op=item.op.name))
        self.sending.clear()
        self.any_source.clear()
        self.by_source.clear()

    def close(self) -> None:
        """On close: give sends until their deadline to leave; fail receives still waiting."""
        for posted in [*self.any_source, *(p for q in self.by_source.values() for p in q)]:
            self._set_error(posted, CommAborted(
                "the communicator was closed before this receive's message arrived",
                rank=self.comm.rank, op=posted.op.name))
        self.any_source.clear()
        self.by_source.clear()
        while self.sending:
            self._check_sends()
            if self.sending:
                self.sending[0].handles[0].wait(0.05)

    # ---------------------------------------------------------------- internals
    def _header(self, op: P2POp, sender: int, index: int, count: int, seq: int) -> Header:
        """A message's header: sender and receiver must agree on the tag, the dtype and the
        whole message's element count, not only on this segment's."""
        data = op.data
        return Header(seq, count * data.dtype.itemsize, data.count, self.comm.segment_bytes, sender,
                      index, op.tag, OpKind.P2P, dtype_code(data.dtype), _DIRECT)

    def _progress(self, op: P2POp, index: int, peer: int | None,
                  doing: str | None = None) -> OpProgress | None:
        """Where ``op`` stood when it failed at segment ``index`` of its message (-1: after
        the last), for the hang report."""
        comm, data = self.comm, op.data
        if peer is None:  # a receive from any rank that none sent to
            return OpProgress("p2p", "direct recv", 0, 0, doing or "", None)
        build = direct.send if op.is_send else direct.recv
        try:
            schedule = build(comm.rank, comm.world_size, peer, data.count, comm._segment(data))
        except Exception:  # noqa: BLE001 - the op's own error is on its way: keep it
            return None
        at = len(schedule.steps) if index < 0 else index
        return in_order("p2p", schedule, at, peer, data.dtype.itemsize, doing)

    def _check_sends(self) -> None:
        if not self.sending:
            return
        now = time.monotonic()
        still = []
        for s in self.sending:
            s.handles = [h for h in s.handles if not h.done]
            if not s.handles:
                self._complete(s.op, s.future)
            elif now >= s.deadline:
                err = CommTimeout(
                    f"the message to rank {s.op.peer} did not leave this process within "
                    f"{self.comm.timeout:g} s: rank {s.op.peer} never received it (is it "
                    "alive, and does it call recv?)", rank=self.comm.rank, op=s.op.name,
                    peer=s.op.peer)
                err.progress = self._progress(s.op, -1, s.op.peer,
                                              f"waiting for rank {s.op.peer} to take its "
                                              f"message (tag {s.op.tag})")
                self._failed(s, err)
            else:
                still.append(s)
        self.sending = still

    def _expire(self) -> None:
        now = time.monotonic()
        for posted in [*self.any_source, *(p for q in self.by_source.values() for p in q)]:
            if now >= posted.deadline:
                src = posted.op.peer
                who = "any rank" if src is None else f"rank {src}"
                err = CommTimeout(
                    f"no message from {who} within {self.comm.timeout:g} s: check that it "
                    "sends one (same tag), or raise the timeout", rank=self.comm.rank,
                    op=posted.op.name, peer=src)
                err.progress = self._progress(posted.op, 0, src, f"waiting for a message from "
                                              f"{who} (tag {posted.op.tag})")
                self._failed(posted, err)
                return

    def _peers(self) -> list[int]:
        named = [p for p, q in self.by_source.items() if q]
        if self.any_source:
            others = [p for p in range(self.comm.world_size)
                      if p != self.comm.rank and p not in self.gone]
            return sorted(set(others) | set(named))
        return named

    def _next_for(self, peer: int) -> _Posted | None:
        """The receive that the next message from ``peer`` belongs to."""
        mine = self.by_source.get(peer)
        a = mine[0] if mine else None
        b = self.any_source[0] if self.any_source else None
        if a is None or b is None:
            return a or b
        return a if a.serial < b.serial else b

    def _receive_from(self, peer: int, wait: float) -> bool:
        posted = self._next_for(peer)
        if posted is None:
            return False
        comm, op = self.comm, posted.op
        steps = direct.recv(comm.rank, comm.world_size, peer, op.data.count,
                            comm._segment(op.data)).steps
        seq = self.matched[peer]
        name = f"recv #{seq} from rank {peer}" + (" (any source)" if op.peer is None else "")
        try:
            first = steps[0].dst
            assert first is not None
            comm.transport.recv_into(peer, self._header(op, peer, 0, first.count, seq),
                                     op.data.region(first.offset, first.count),
                                     time.monotonic() + wait, name)
        except CommTimeout:
            return False  # nothing from this peer yet
        except PeerLostError as err:
            if op.peer is None:  # a rank that left cannot send; others still may
                self.gone.add(peer)
                if len(self.gone) < self.comm.world_size - 1:
                    return False
            self._unpost(posted, peer)
            self._failed(posted, err)
            return True
        except CommError as err:
            err.progress = self._progress(op, 0, peer if isinstance(err, CommTimeout) else
                                          op.peer)
            self._unpost(posted, peer)
            self._failed(posted, err)
            return True
        self._unpost(posted, peer)
        self.matched[peer] += 1
        try:
            for index, step in enumerate(steps[1:], 1):
                dst = step.dst
                assert dst is not None
                comm.transport.recv_into(peer, self._header(op, peer, index, dst.count, seq),
                                         op.data.region(dst.offset, dst.count),
                                         posted.deadline, name)
        except CommError as err:  # raised in the loop, so ``index`` is bound
            err.progress = self._progress(op, index, peer)
            self._failed(posted, err)
            return True
        if op.work is not None:
            op.work.source = peer
        self._complete(op, posted.future)
        return True

    @staticmethod
    def _complete(op: P2POp, future: concurrent.futures.Future[Any]) -> None:
        """The op's data has left or arrived: its buffer's ``after_op``, then its result."""
        try:
            op.data.after_op()
        except Exception as err:  # noqa: BLE001 - the op's own error, delivered via its future
            future.set_exception(err)
            return
        future.set_result(op.result)

    def _unpost(self, posted: _Posted, peer: int) -> None:
        if self.any_source and self.any_source[0] is posted:
            self.any_source.popleft()
        else:
            self.by_source[peer].popleft()

    def _failed(self, item: _Posted | _Sending, err: CommError) -> None:
        """``item`` failed: the communicator fails with it (peers are told), and so does
        every other pending point-to-point op."""
        if isinstance(item, _Posted):
            for queue_ in (self.any_source, *self.by_source.values()):
                if item in queue_:
                    queue_.remove(item)
        elif item in self.sending:
            self.sending.remove(item)
        self._set_error(item, err)
        self.comm._fail(err)
        self.fail_all(err)

    @staticmethod
    def _set_error(item: _Posted | _Sending, err: BaseException) -> None:
        if not item.future.done():
            item.future.set_exception(err)

