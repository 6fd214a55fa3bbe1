"""The board as a channel: posts and takes with the waits and checks every take needs.

The shared board (``board``) is the second data plane of a group whose ranks share one host:
where a link carries one pair's messages, the board carries every rank's posts. Like a link
it is an object of its own that an engine uses (``ringcomm.engines.board``) and that a
wrapper can stand in front of (``ringcomm.transport.wrappers``), so that whatever watches
messages (a tracer, a fault injector, a checksum) sees the board's posts and takes as it
sees the links' sends and receives.

``post`` puts this rank's part of an op on the board once every peer has made the post
before; ``take`` returns a peer's part in place once it is posted, after comparing its
header with this rank's own (``DesyncError`` naming both ranks and what differs; a post
its rank withdrew, ``withdraw``, because its op failed there: ``RemoteError``). How a
rank waits for a post is the channel kind's own (``_wait``): ranks in processes spin, then
sleep until the poster rings their doorbell, while watching the links and the control plane
(``ShmBoardChannel``); ranks that are threads of one process wait on a condition
(``ringcomm.transport.inmemory``).
"""

from __future__ import annotations

import abc
import contextlib
import os
import time
import weakref
from typing import Any, NoReturn, Protocol

import numpy as np
import zmq

from ..core.dtypes import ReduceOp
from ..errors import CommTimeout, DesyncError, PeerLostError, RemoteError
from .board import Board, WholeTake, fold_whole
from .header import Header, OpKind, check
from .link import Wait
from .local_link import LocalLink
from .pipe import Doorbell, ring
from .shm_ring import fence
from .zmq_control import STALL_PROBE_S, ZmqControl

_WATCH_EVERY = 16  # a wait that spins looks at the links and control plane this often
_DOZE_MS = 20  # the longest a wait sleeps between looks at the board


def board_wait(op: str, deadline: float, header: bytes, peer: int) -> Wait:
    """The state of a wait for ``peer``'s post of the op whose board header is ``header``:
    what its messages and probes are compared with."""
    return Wait(op, deadline, expected_post(header, peer))


def expected_post(header: bytes, peer: int) -> Header:
    """What ``peer``'s post (or message) of the op whose board header is ``header`` says."""
    return Header.unpack(header)._replace(sender=peer)


class Screening(Protocol):
    """What a board wait needs of the transport beside it (``Transport.screen``)."""

    def screen(self, peer: int, wait: Wait) -> None: ...


class BoardChannel(abc.ABC):
    """Rank ``board.rank``'s posts and takes on a board shared by ``board.world_size`` ranks,
    beside ``transport`` (whose links a wait watches for a lost peer or an abort)."""

    kind = "board"
    wakes_by_flag = False  # a sleeping peer says so on the board (else: wake after each post)
    _fused = False  # ``round_whole`` reads the board itself (the channels that own one)
    quick_turns = 0  # how often ``round_whole`` yields the core for a post before ``_wait``

    def __init__(self, board: Board, transport: Screening) -> None:
        self.board = board
        # weakly: the transport holds this channel, and a cycle would leave the transport
        # (and its ZeroMQ context, whose end waits for its sockets) to the garbage collector
        self.transport = transport if isinstance(transport, weakref.ProxyTypes) \
            else weakref.proxy(transport)
        self.rank = board.rank
        self.world_size = board.world_size

    def post(self, header: bytes, payload: np.ndarray | None, deadline: float,
             op: str, at: int = 0) -> None:
        """Put this rank's part of a board op (its ``header``, packed, and ``payload`` or
        None, from element ``at`` of its slot) on the board, once every peer has made the
        post before (they may still read the slot this one overwrites: a rank runs at most
        one post ahead of the slowest)."""
        board = self.board
        for peer in board.behind():
            self._wait(peer, board.number, op, deadline, header)
        board.post(header, payload, at)
        self._posted()

    def take(self, peer: int, header: bytes, dtype: np.dtype, count: int, deadline: float,
             op: str, at: int = 0) -> np.ndarray:
        """``count`` elements of ``dtype`` from element ``at`` of ``peer``'s current board
        post, in place (valid until this rank's next post), once it is posted with this
        rank's own ``header`` (packed; every rank's post of an op carries the same bytes)."""
        board = self.board
        number = board.number
        if board.posted(peer) < number:
            self._wait(peer, number, op, deadline, header)
        if not board.matches(peer, header):
            self._disagrees(peer, header, op)
        return board.payload(peer, dtype, count, at)

    def round_whole(self, header: bytes, data: np.ndarray, takes: tuple[WholeTake, ...],
                    reduce: ReduceOp | None, deadline: float, op: str) -> None:
        """A ``post`` of all of ``data`` (1-d), then a ``take`` of each peer's whole post in
        ``takes`` (peer, copy it or fold it in after or before, whether that completes it):
        the one-shot allreduce of the smallest calls. A channel of its own board does it in
        one go (``Board.round_whole``, with this channel's waits and checks); a wrapper
        (``_fused`` False) through its ``post`` and ``take``, which it may override. The
        local ``step`` says where a failure left it: 0 the post, ``k`` the ``k``-th take."""
        if self._fused:
            self.board.round_whole(header, data, takes, reduce, deadline, op, self)
            return
        step = 0
        self.post(header, data, deadline, op)
        for step, (peer, does, final) in enumerate(takes, 1):  # noqa: B007 - see above
            fold_whole(data, self.take(peer, header, data.dtype, data.size, deadline, op),
                       does, final, reduce, self.world_size)

    def _disagrees(self, peer: int, header: bytes, op: str) -> None:
        """``peer``'s post does not carry ``header``: raise what the difference means (a
        withdrawn post: ``RemoteError``; another op: ``DesyncError``)."""
        posted = self.posted_header(peer, op)
        if posted.kind == OpKind.ABORT:
            self._withdrawn(peer, op)
        check(expected_post(header, peer), posted, rank=self.rank, op=op)

    @property
    def posts(self) -> int:
        """How many posts this rank has made (an op starts at this number)."""
        return self.board.number

    def withdraw(self, since: int) -> None:
        """This rank's op, which started after post ``since``, failed: withdraw the latest
        post it made in it (if any, and shown), so that a peer that has not taken it yet
        raises instead of completing the op. Best effort: a board already let go of (a
        close that did not wait for the op) is left as it is."""
        board = self.board
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            if board.number > since and board.posted(self.rank) >= board.number:
                board.withdraw()

    def _withdrawn(self, peer: int, op: str) -> NoReturn:
        """``peer``'s post of this op is withdrawn: its op failed there."""
        raise RemoteError(f"rank {peer} failed in this op after it posted its part on the "
                          "shared board, and withdrew the post", rank=self.rank, op=op,
                          peer=peer)

    def posted_header(self, peer: int, op: str) -> Header:
        """The header of ``peer``'s post that a take now reads, once it is posted; a
        ``DesyncError`` naming the peer where its slot holds no post at all (one was lost on
        the way, and a later one shows its count)."""
        try:
            return self.board.header(peer)
        except DesyncError:
            raise DesyncError(f"rank {peer}'s board post of this op is missing: its count "
                              "says it is there, its slot holds none (was it lost on the "
                              "way?)", rank=self.rank, op=op, peer=peer) from None

    def wait_for(self, peer: int, header: bytes, deadline: float, op: str) -> None:
        """Return once ``peer`` has made the post a ``take`` now would read, waiting as
        ``take`` does: for a wrapper that reads a post's header before taking it."""
        number = self.board.number
        if self.board.posted(peer) < number:
            self._wait(peer, number, op, deadline, header)

    def leftover(self) -> Header | None:
        """The header of a post that a peer made and this rank never took (a board op this
        rank never ran): at close, proof that the ranks disagreed about an op. A post its
        peer withdrew (its op failed there) is an abort's header: the peer still entered an
        op this rank never ran."""
        board = self.board
        for peer in range(self.world_size):
            if peer != self.rank and board.posted(peer) > board.number:
                return board.header(peer, board.number + 1)
        return None

    def describe(self) -> str:
        return f"shared board of {self.world_size} ranks"

    @abc.abstractmethod
    def _wait(self, peer: int, number: int, op: str, deadline: float, header: bytes) -> None:
        """Return once ``peer`` has made ``number`` posts of the op whose board header is
        ``header`` (packed); raise as a receive would (the deadline, a lost peer, an abort,
        a message showing that the ranks disagree). Most waits end within moments, so a
        channel may make the ``Wait`` (``board_wait``) only once the wait goes on."""

    def _posted(self) -> None:  # noqa: B027 - optional hook
        """This rank has just posted: wake the peers that sleep waiting for it."""

    def close(self) -> None:
        """Let go of the board (a closed channel is not used again)."""
        self.board.close()


class ShmBoardChannel(BoardChannel):
    """The board of ranks in processes of one host, in shared memory: a wait spins, then
    sleeps in ``poll`` until the poster rings this rank's doorbell (``bell``; ``bells``:
    the peers' doorbells, open for writing), and meanwhile watches the control plane and
    every peer's pipe (``links``)."""

    wakes_by_flag = True
    _fused = True

    def __init__(self, board: Board, transport: Screening, *, control: ZmqControl,
                 links: list[LocalLink], bell: Doorbell, bells: dict[int, int],
                 spin_s: float) -> None:
        super().__init__(board, transport)
        self.control = control
        self.spin_s = spin_s
        self.quick_turns = _WATCH_EVERY if spin_s else 0  # as ``_wait`` starts
        self._bell = bell
        self._bells = bells
        self._pipe_peer = {link.pipe_in.fd: link.peer for link in links}
        self._poller = zmq.Poller()  # what a wait watches
        self._poller.register(control.socket, zmq.POLLIN)
        self._poller.register(bell.fd, zmq.POLLIN)
        for link in links:
            self._poller.register(link.pipe_in.fd, zmq.POLLIN)

    def _wait(self, peer: int, number: int, op: str, deadline: float, header: bytes) -> None:
        """Spin (yielding the CPU on every turn) for ``spin_s``, then sleep in ``poll`` until
        a poster rings this rank's doorbell; look at the links and the control plane every
        few turns meanwhile, and ask the peer which op it is in after ``STALL_PROBE_S``."""
        posted, control = self.board.posted, self.control
        for _ in range(self.quick_turns):  # the commonest wait: a moment
            os.sched_yield()
            if posted(peer) >= number:
                return
        wait = board_wait(op, deadline, header, peer)
        started = time.monotonic()
        spin_until, probe_at = started + self.spin_s, started + STALL_PROBE_S
        if peer == self.rank:  # its own post, lost on the way (a dropped post): no one to ask
            probe_at = 0.0
        turn = 0
        while posted(peer) < number:
            turn += 1
            now = time.monotonic()
            if turn % _WATCH_EVERY == 0 or now >= spin_until:
                if now >= wait.deadline:
                    raise CommTimeout(f"rank {peer} did not post its part of this op on the "
                                      "shared board within the timeout (is it running this "
                                      "op?)" if peer != self.rank else "this rank's own post "
                                      "on the shared board never appeared (it was lost on the "
                                      "way)", rank=self.rank, op=wait.op, peer=peer)
                if probe_at and now >= probe_at:
                    probe_at = 0.0
                    assert wait.expected is not None  # a board wait knows the op's header
                    control.probe(peer, wait.expected._replace(sender=self.rank), wait.op)
            if now < spin_until:
                if turn % _WATCH_EVERY == 0:
                    events = self._poller.poll(0)
                    if events and self._watch(events, wait, peer, number):
                        return
                os.sched_yield()
                continue
            self.board.doze(True)
            try:
                if posted(peer) >= number:
                    return
                sleep_s = min(wait.deadline, probe_at or wait.deadline) - now
                events = self._poller.poll(min(_DOZE_MS, max(1, int(sleep_s * 1000))))
            finally:
                self.board.doze(False)
            if self._watch(events, wait, peer, number):
                return

    def _watch(self, events: list[tuple[Any, int]], wait: Wait, peer: int,
               number: int) -> bool:
        """Handle what ``poll`` reported during a wait for ``peer``'s post ``number``:
        notices on the control plane, and whatever a peer's pipe holds
        (``Transport.screen``). Returns True if the post has come meanwhile (then nothing
        else matters: a peer that has posted and gone on may have closed its pipes)."""
        board, bell = self.board, self._bell
        control = self.control.socket
        for what, _ in events:
            if board.posted(peer) >= number:
                return True
            if what is control:
                self.control.handle(wait)
                continue
            if what == bell.fd:
                if not bell.drain():  # every peer has closed: the pipes say why
                    self._poller.unregister(bell.fd)
                continue
            try:
                self.transport.screen(self._pipe_peer[what], wait)
            except PeerLostError:
                if board.posted(peer) >= number:
                    return True
                raise
        return board.posted(peer) >= number

    def _withdrawn(self, peer: int, op: str) -> NoReturn:
        """The abort that ``peer`` sent when its op failed says why: wait a moment for it
        on the control plane (``explain_loss`` raises it), else say the post is withdrawn."""
        self.control.explain_loss(op)
        super()._withdrawn(peer, op)

    def _posted(self) -> None:
        board = self.board
        fence()  # the count is stored before any flag is read
        for peer, bell in self._bells.items():
            if board.sleeping(peer):
                ring(bell)

    def close(self) -> None:
        super().close()
        for fd in self._bells.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._bell.close()
