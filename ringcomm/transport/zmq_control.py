"""The ZeroMQ control plane, and waiting on a link while watching it.

Every rank binds one control socket; peers push aborts and probes to it. A link that waits
for data polls its own file descriptor or socket together with the control socket, so an
abort from any rank (or a probe from a rank in another op) ends the wait at once.

A receive that has waited ``STALL_PROBE_S`` sends the peer it waits for a *probe* naming
the op it is in and the header it expects. A peer that waits in a different collective
under the same sequence number (say ``broadcast #1`` against ``allreduce #1``) raises
``DesyncError`` at once: schedules in which nobody receives a wrong header (trees,
halving-doubling) would otherwise wait for the timeout.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from collections.abc import Callable, Container

import zmq

from ..core.rate_limit import RateLimitedLog
from ..errors import CommTimeout, DesyncError, PeerLostError
from .auth import FRAME_OVERHEAD
from .header import SIZE as HEADER_SIZE
from .header import Header, OpKind, differences
from .link import ControlPlane, Link, Wait, remote_error

log = logging.getLogger("ringcomm")

MAX_ABORT_BYTES = 4096  # an abort's text (``Transport.abort`` cuts it to this)
MAX_OP_NAME_BYTES = 256  # what a probe says after its header: the op's name
# the most one frame to the control socket may hold: a notice's header, an abort's text, a
# probe's header and op name (a larger frame drops its connection before it is read)
MAX_NOTICE_BYTES = max(MAX_ABORT_BYTES, HEADER_SIZE + MAX_OP_NAME_BYTES)
# notices queued unread per connection: a peer sends one abort, and a probe a second at
# most while it waits; past this ZeroMQ stops reading that connection (the peer's notices
# wait in its own process), so a stranger's flood holds at most about 270 kB here
QUEUED_NOTICES = 64
_POLL_SLICE_MS = 1000
_ABORT_GRACE_MS = 500  # a peer that closed may have failed on an abort still on its way here
STALL_PROBE_S = 1.0  # a receive stalled this long asks its peer which op it is in
WAKE_ENDPOINT = "inproc://ringcomm-wake"  # the control socket's own door, for ``wake``
_CONTROL_EVERY = 8  # a spinning receive polls (control plane, pipe) on every 8th turn
_CHECKED_AT_ONCE = QUEUED_NOTICES + 1  # notices ``check_aborted`` reads at most: a queue, whole


def decode_notice(frames: list[bytes], rank: int,
                  peers: Container[int]) -> tuple[Header, bytes, Header | None]:
    """A control-plane message to ``rank``: an abort or a probe from one of its ``peers``,
    as ``(header, payload, probed)`` where ``probed`` is the header a probe expects (None
    for an abort; an abort from ``rank`` itself is its ``wake``). Anything else (another
    number of frames, a header that does not decode, another kind, an unknown sender, a
    payload over its bound) is a ``ValueError`` saying what was wrong."""
    if len(frames) != 2:
        raise ValueError(f"{len(frames)} frames (a notice has 2)")
    raw, payload = frames
    if len(raw) != HEADER_SIZE:
        raise ValueError(f"a header of {len(raw)} B (expected {HEADER_SIZE})")
    try:
        header = Header.unpack(raw)
    except DesyncError as err:
        raise ValueError(err.detail) from None
    if header.kind not in (OpKind.ABORT, OpKind.PROBE):
        raise ValueError(f"kind {header.kind} (a notice is an abort or a probe)")
    if header.sender not in peers and not (header.sender == rank
                                           and header.kind == OpKind.ABORT):  # its own wake
        raise ValueError(f"sender {header.sender}, which is not a peer of rank {rank}")
    if header.kind == OpKind.ABORT:
        if len(payload) > MAX_ABORT_BYTES:
            raise ValueError(f"an abort of {len(payload)} B (at most {MAX_ABORT_BYTES})")
        return header, payload, None
    if not HEADER_SIZE <= len(payload) <= HEADER_SIZE + MAX_OP_NAME_BYTES:
        raise ValueError(f"a probe of {len(payload)} B (a header and an op's name)")
    try:
        probed = Header.unpack(payload[:HEADER_SIZE])
    except DesyncError as err:
        raise ValueError(f"a probe's header: {err.detail}") from None
    return header, payload, probed


class ZmqControl(ControlPlane):
    """This rank's control socket (``socket``, bound by the transport for its peers, and
    here to ``WAKE_ENDPOINT`` for ``wake``) and push sockets to the peers' control sockets,
    made on first use with ``connect``."""

    def __init__(self, rank: int, socket: zmq.Socket, endpoints: dict[int, str],
                 connect: Callable[..., zmq.Socket]) -> None:
        self.rank = rank
        self.socket = socket
        self.endpoints = endpoints  # peer -> its control socket's address
        self._connect = connect
        self._push: dict[int, zmq.Socket] = {}
        # what the socket admits, set before its first bind (ZeroMQ copies a socket's
        # options to its connections when it binds): notices, not more
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_NOTICE_BYTES + FRAME_OVERHEAD)
        socket.setsockopt(zmq.RCVHWM, QUEUED_NOTICES)
        socket.bind(WAKE_ENDPOINT)  # inproc: one per ZeroMQ context, so one per transport
        # every line a stranger's input makes this rank write (refused notices, refused
        # handshakes on its links) goes through one limit per transport
        self.refusals = RateLimitedLog(log, per_second=1.0, burst=10)
        self._wake: zmq.Socket | None = None  # used by whichever thread aborts, one at a time
        self._wake_lock = threading.Lock()
        # the socket is read by whichever thread waits (an op on the caller's thread, another
        # on the worker): one at a time, as a ZeroMQ socket is not safe to share, so that
        # no thread takes part of another's notice
        self._reading = threading.Lock()
        self._grace_ms = _ABORT_GRACE_MS  # how long a lost peer waits for an abort to explain it

    def _to(self, peer: int) -> zmq.Socket:
        sock = self._push.get(peer)
        if sock is None:
            endpoint = self.endpoints[peer]
            # an ipc push is watched until its handshake (then its socket file may go)
            sock = self._push[peer] = self._connect(
                endpoint, peer=peer if endpoint.startswith("ipc://") else None)
        return sock

    def connect(self, peers: list[int]) -> None:
        """Connect to ``peers``' control sockets now rather than on first use (an ipc
        socket's file goes once the group is set up; an abort must not wait for a tcp
        handshake)."""
        for peer in peers:
            self._to(peer)

    def abort(self, peer: int, header: Header, text: bytes) -> None:
        self._to(peer).send_multipart((header.pack(), text))

    def wake(self, header: Header, text: bytes) -> None:
        self._send_own([header.pack(), text])

    def probe(self, peer: int, expected: Header, op: str) -> None:
        probe = Header.control(OpKind.PROBE, expected.seq, self.rank)
        self._to(peer).send_multipart((probe.pack(), expected.pack() + op.encode()))

    def handle(self, wait: Wait) -> None:
        """Read one notice. An abort raises RemoteError; a probe from a rank that waits in
        the same op as this one (same sequence number) but sees it differently raises
        DesyncError; other probes are fine and dropped, and so is anything that is not a
        notice from a peer (logged with the reason). Nothing, where another thread has
        taken the notice that the caller's poll saw."""
        with self._reading:
            notice = self._next_notice(self.socket)
        if notice is None:
            return
        frames, (header, payload, probed) = notice
        if probed is None:
            raise remote_error(header, payload, self.rank, wait.op)
        mine = wait.expected
        if mine is None or mine.is_p2p or probed.is_p2p or probed.seq != mine.seq:
            return
        # what they expect from this rank, as sent by them; an all-to-all's counts belong
        # to pairs and cannot be compared across them
        theirs = probed._replace(
            sender=header.sender,
            count=mine.count if mine.kind == OpKind.ALLTOALL else probed.count)
        diffs = differences(mine, theirs, rank=self.rank)
        if diffs:
            their_op = payload[HEADER_SIZE:].decode(errors="replace")
            raise DesyncError(
                f"rank {header.sender} waits in {their_op} while this rank waits in "
                f"{wait.op}, and the ranks disagree about it: {'; '.join(diffs)}. Every rank "
                "must call the same collectives in the same order with the same dtype, "
                "element count, reduce op and root.",
                rank=self.rank, op=wait.op, peer=header.sender,
            )

    def check_aborted(self, seq: int, op: str) -> None:
        """Raise the ``RemoteError`` of a peer's abort waiting here that names collective
        ``seq`` or an earlier one (the first the peer does not complete). Looks at a few
        notices at most: probes about op ``seq`` or an earlier one are stale (this rank is
        past them) and dropped; the others (probes of later ops, aborts of later ops, this
        rank's own wake) go back to the socket for the waits that take them. Costs one poll
        when nothing is waiting."""
        sock = self.socket
        if not sock.poll(0, zmq.POLLIN):
            return
        back: list[list[bytes]] = []
        with self._reading:
            try:
                for _ in range(_CHECKED_AT_ONCE):
                    if not sock.poll(0, zmq.POLLIN):
                        return
                    notice = self._next_notice(sock)
                    if notice is None:
                        continue
                    frames, (header, payload, probed) = notice
                    if probed is None and header.sender != self.rank and header.seq <= seq:
                        raise remote_error(header, payload, self.rank, op)
                    if probed is not None and probed.seq <= seq:
                        continue  # a peer asked about an op this rank is done with
                    back.append(frames)
            finally:
                for frames in back:
                    try:
                        self._send_own(frames, zmq.NOBLOCK)
                    except zmq.Again:  # the socket's queue is full (of a stranger's notices)
                        self.refusals.warning("a notice dropped", "rank %d's control plane "
                                              "dropped a notice: its queue is full", self.rank)

    def _next_notice(self, sock: zmq.Socket
                     ) -> tuple[list[bytes], tuple[Header, bytes, Header | None]] | None:
        """The next message on the control socket and what it says (``decode_notice``),
        taken whole by the caller, which holds ``_reading``; None where there is none (or
        not any more: another thread took it) or it is not a notice (logged why)."""
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        try:
            return frames, decode_notice(frames, self.rank, self.endpoints)
        except ValueError as err:
            self.refusals.warning("a notice dropped", "rank %d's control plane dropped a "
                                  "message: %s", self.rank, err)
            return None

    def _send_own(self, frames: list[bytes], flags: int = 0) -> None:
        """Put a notice on this rank's own control socket (through ``WAKE_ENDPOINT``)."""
        with self._wake_lock:
            if self._wake is None:
                self._wake = self._connect(WAKE_ENDPOINT)
            self._wake.send_multipart(frames, flags)

    def explain_loss(self, op: str) -> None:
        """Before reporting a lost peer: an abort from some rank, arriving within a grace
        period, explains it better (a peer may close because another rank failed and
        aborted it), and is raised instead."""
        grace_end = time.monotonic() + self._grace_ms / 1000
        wait = Wait(op, grace_end)
        while self.socket.poll(max(0, int((grace_end - time.monotonic()) * 1000))):
            self.handle(wait)

    def closing(self) -> None:
        self._grace_ms = 0

    def close(self) -> None:
        self.refusals.flush()  # how many lines were held back, where some were
        for sock in self._push.values():
            sock.close(linger=500)
        with self._wake_lock:
            if self._wake is not None:
                self._wake.close(linger=0)


class PolledLink(Link):
    """A link whose incoming data shows up in a ``zmq.Poller`` (a socket or a pipe's file
    descriptor), waited on together with the control plane."""

    def __init__(self, rank: int, peer: int, control: ZmqControl, spin_s: float) -> None:
        super().__init__(rank, peer)
        self.control = control
        self.spin_s = spin_s
        self.poller = zmq.Poller()
        self.poller.register(control.socket, zmq.POLLIN)

    @abc.abstractmethod
    def _readable(self, events: dict) -> bool:
        """Whether ``events`` (from ``poller``) show this link's data."""

    def _ready_or_lost(self, wait: Wait) -> bool:
        """Checked on every turn: True if data is there; raise if the peer is known lost."""
        return False

    def _on_events(self, events: dict) -> None:
        """Handle this link's own other events (a socket monitor's)."""

    def _doze(self, sleeping: bool) -> bool:
        """Called with True before the wait blocks in ``poll`` and with False after it: a
        link whose data does not wake ``poll`` by itself arranges for its sender to wake it.
        Returns True if the data turned up meanwhile (then the wait does not block)."""
        return False

    max_sleep_ms = _POLL_SLICE_MS  # the longest one blocking poll lasts
    # True where ``_ready_or_lost`` sees the data without a system call (a mailbox): the
    # spin then polls the control plane and the link's descriptor only every few turns
    cheap_spin = False

    def peer_lost(self, op: str, what: str = "") -> None:
        """Raise PeerLostError, unless an abort from some rank explains it better."""
        self.control.explain_loss(op)
        what = what or (f"the connection from rank {self.peer} closed while this rank waited "
                        "for its data")
        raise PeerLostError(f"{what}: rank {self.peer} died or left the group early",
                            rank=self.rank, op=op, peer=self.peer)

    def wait_readable(self, wait: Wait) -> None:
        """Wait until the peer's data is here, handling aborts, probes, a lost connection
        and the deadline meanwhile. A receive polls without sleeping for ``spin_s`` first
        (yielding the CPU on every turn): waking a process that sleeps costs tens of
        microseconds."""
        control = self.control.socket
        started = time.monotonic()
        probe_at: float | None = started + STALL_PROBE_S
        spin_until = started + self.spin_s
        turn = 0
        while True:
            if self._ready_or_lost(wait):
                return
            now = time.monotonic()
            left = wait.deadline - now
            if left <= 0:
                raise CommTimeout(f"no message from rank {self.peer} within the timeout",
                                  rank=self.rank, op=wait.op, peer=self.peer)
            if probe_at is not None and now >= probe_at:
                probe_at = None
                if wait.expected is not None and not wait.expected.is_p2p:
                    self.control.probe(self.peer, wait.expected, wait.op)
            wake = left if probe_at is None else min(left, probe_at - now)
            if now < spin_until:
                turn += 1
                if self.cheap_spin and turn % _CONTROL_EVERY:
                    os.sched_yield()
                    continue
                events = dict(self.poller.poll(0))
                if not events:
                    os.sched_yield()
                    continue
            else:
                if self._doze(True):
                    self._doze(False)
                    return
                try:
                    events = dict(self.poller.poll(
                        min(self.max_sleep_ms, max(1, int(wake * 1000)))))
                finally:
                    self._doze(False)
            # data first: a peer's message sent before another rank's abort may arrive with
            # it, and the op it belongs to can still finish (the abort stays queued for the
            # next wait, so the op after it raises)
            if self._readable(events):
                return
            if control in events:
                self.control.handle(wait)
            self._on_events(events)
