"""A ZeroMQ link: a PUSH socket to the peer's PULL socket, ``tcp://`` between hosts (and
``ipc://`` on one host when shared memory is off).

- Large payloads leave with ``copy=False`` (no copy into ZeroMQ) and are tracked, so the
  executor knows when the buffer may change again. Small ones are copied: cheaper than
  tracking. Payloads are received straight into their destination (``recv_into``) or, when
  they are to be reduced, as a ZeroMQ frame that the reduction reads in place.
- A socket monitor on the receiving socket notices the peer's connection closing, so a
  dead peer becomes a ``PeerLostError`` at once rather than a timeout; a stranger's
  connection closing does not count (``Arrivals``).
- A send never blocks (no high-water mark on the sending side), which is what lets
  schedules queue sends ahead of their receives without deadlock.
- A receiving socket admits only what a peer may send (``bound_receiving``, before it
  binds): a frame of at most one segment (``payload_bound``), and a queue of unread
  messages of about ``QUEUE_BYTES`` per connection; a stranger's frame that claims more
  drops its connection before anything is allocated for it. Without a token anyone who
  reaches a tcp port can send to it, so a message that is not ringcomm's is described as
  what it is and where it arrived, never blamed on the peer; a stranger's refused handshake
  is logged (at a bounded rate) as an unknown peer at its address.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import CommError, CommTimeout, DesyncError, PeerLostError
from . import auth
from .header import SIZE as HEADER_SIZE
from .header import WIRE_VERSION, Header
from .link import Wait
from .zmq_control import PolledLink, ZmqControl

ZERO_COPY_MIN_BYTES = 64 * 1024  # below this a copy is cheaper than tracking (pyzmq's own limit)
_SEND_POLL_S = 0.05  # how often a wait for a send looks for a lost peer or an abort
_LOST_GRACE_S = 1.0  # a send to a peer whose connection closed may still be finishing
# The least frame a link admits whatever the segment: every message is cut into segments,
# and the few that are not are smaller (a binomial broadcast's, up to
# ``plan.select.SMALL_BROADCAST_BYTES``; an abort's text, 4 KiB; a device notice)
SMALLEST_BOUND = 64 << 10
# the bound of a transport made without an agreed segment (tools and tests set one up alone)
UNAGREED_BOUND = 16 << 20
QUEUE_BYTES = 256 << 20  # about the most one connection's unread messages may hold
_LEAST_QUEUED = 2  # messages a receiving socket queues per connection, however large
_ADDRESSES_KEPT = 64  # accepted connections whose address a link remembers at once


def payload_bound(segment_bytes: int) -> int:
    """The largest payload a link admits in one message, with ``segment_bytes`` agreed at
    init (0: none agreed): schedules cut messages into segments, and the few sent whole are
    smaller than ``SMALLEST_BOUND``; a communicator's segment may not grow past it later."""
    if segment_bytes <= 0:
        return UNAGREED_BOUND
    return max(int(segment_bytes), SMALLEST_BOUND)


def bound_receiving(sock: zmq.Socket, segment_bytes: int) -> None:
    """Make a link's receiving socket (before it binds: ZeroMQ copies a socket's options to
    its connections when it binds) admit what a peer may send and no more: frames of at most
    ``payload_bound(segment_bytes)`` (a larger one drops its connection as soon as its
    length is read, before anything is allocated for it; a header frame is smaller), and
    unread messages up to about ``QUEUE_BYTES`` per connection (then ZeroMQ stops reading
    that connection until the link takes some: the peer's sends wait in its own process)."""
    bound = payload_bound(segment_bytes)
    sock.setsockopt(zmq.MAXMSGSIZE, bound + auth.FRAME_OVERHEAD)
    sock.setsockopt(zmq.RCVHWM, max(_LEAST_QUEUED, QUEUE_BYTES // bound))


class _Tracked:
    """A send in flight: done once ZeroMQ no longer reads the frame."""

    __slots__ = ("_tracker", "reads_buffer")

    def __init__(self, tracker: zmq.MessageTracker) -> None:
        self._tracker = tracker
        self.reads_buffer = True

    @property
    def done(self) -> bool:
        return self._tracker.done

    def wait(self, timeout: float) -> bool:
        try:
            self._tracker.wait(timeout)
        except zmq.NotDone:
            return False
        return True


def decode_header(raw: bytes, more: bool, *, rank: int, peer: int, op: str,
                  where: str = "") -> Header:
    """The header frame of a message on the socket that takes ``peer``'s messages (at
    ``where``): exactly ``header.SIZE`` bytes, in this wire format, followed by its payload
    frame (``more``). Anything else is a ``CommError`` saying what arrived and where;
    nothing is allocated from what the frame claims. Ranks of one group speak one wire
    format (agreed at init), so a message that is not in it came from something else that
    reached the socket, not from ``peer``."""
    at = f"the socket for rank {peer}'s messages" + (f" ({where})" if where else "")
    if len(raw) != HEADER_SIZE or not more:
        what = (f"a first frame of {len(raw)} B (a header is {HEADER_SIZE} B)"
                if len(raw) != HEADER_SIZE else "a header without a payload frame")
        raise CommError(f"a malformed message arrived on {at}: {what}; {_NOT_OURS}",
                        rank=rank, op=op, peer=peer)
    try:
        return Header.unpack(raw)
    except DesyncError:
        version = raw[HEADER_SIZE - 4]  # the version byte, after the fields
        raise CommError(
            f"a message in wire format {version} arrived on {at}, where every rank of this "
            f"group speaks {WIRE_VERSION} (agreed at init): it is not from rank {peer}; "
            f"{_NOT_OURS}", rank=rank, op=op, peer=peer) from None


_NOT_OURS = ("no rank of the group sends such a message: something else that can reach this "
             "rank's port sent it (a token, RINGCOMM_AUTH_TOKEN, keeps strangers out)")


class SocketLink(PolledLink):
    """Messages to ``peer`` through ``push``, from it through ``pull`` (watched by
    ``monitor`` for the connection closing). The sockets belong to the transport that
    made them; the link only uses them."""

    kind = "socket"

    def __init__(self, rank: int, peer: int, control: ZmqControl, spin_s: float, *,
                 push: zmq.Socket, pull: zmq.Socket, monitor: zmq.Socket) -> None:
        super().__init__(rank, peer, control, spin_s)
        self.push, self.pull, self.monitor = push, pull, monitor
        self.lost = False
        self.arrivals = Arrivals()
        self._addresses: dict[int, str] = {}  # accepted connections' far ends, by descriptor
        self.counters = {"socket": 0}
        self.poller.register(pull, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)

    def describe(self) -> str:
        return self.push.getsockopt_string(zmq.LAST_ENDPOINT)

    # ---------------------------------------------------------------- sending
    def send(self, header: Header, payload: np.ndarray | None, op: str) -> Any:
        raw = header.pack()
        if payload is None or header.nbytes == 0:
            self.push.send_multipart((raw, b""))
            return None
        data = payload.view(np.uint8)
        self.counters["socket"] += 1
        # An ndarray is a buffer; numpy's stubs say so only for Python 3.12 and later, hence
        # the ignores here and in recv_payload_into.
        if header.nbytes < ZERO_COPY_MIN_BYTES:
            self.push.send_multipart((raw, data))  # type: ignore[arg-type]
            return None
        self.push.send(raw, zmq.SNDMORE)
        return _Tracked(self.push.send(data, copy=False, track=True))  # type: ignore[call-overload]

    def send_notice(self, header: Header, text: bytes) -> None:
        self.push.send_multipart((header.pack(), text))

    def wait_sent(self, handle: Any, wait: Wait) -> None:
        """Wait for a zero-copy send to leave, but not for a dead peer: its data would stay
        queued here until the deadline. Aborts from other ranks end it too."""
        control = self.control.socket
        poller = zmq.Poller()
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        lost_since = None
        while True:
            now = time.monotonic()
            if handle.wait(max(0.0, min(_SEND_POLL_S, wait.deadline - now))):
                return
            now = time.monotonic()
            if now >= wait.deadline:
                raise CommTimeout(
                    f"a send to rank {self.peer} did not leave this process in time (is it "
                    "alive?)", rank=self.rank, op=wait.op, peer=self.peer,
                )
            events = dict(poller.poll(0))
            if control in events:
                self.control.handle(wait)
            self._on_events(events)
            if self.lost:
                lost_since = lost_since if lost_since is not None else now
                if now - lost_since >= _LOST_GRACE_S:
                    raise PeerLostError(
                        f"the connection to rank {self.peer} closed while this rank still had "
                        f"data to send to it: rank {self.peer} died or left the group early",
                        rank=self.rank, op=wait.op, peer=self.peer,
                    )

    # ---------------------------------------------------------------- receiving
    def recv_header(self, wait: Wait) -> Header:
        try:
            raw = self.pull.recv(zmq.NOBLOCK)
        except zmq.Again:
            self.wait_readable(wait)
            raw = self.pull.recv(zmq.NOBLOCK)
        more = bool(self.pull.getsockopt(zmq.RCVMORE))
        if len(raw) == HEADER_SIZE and more:  # the way every message of a peer comes
            with contextlib.suppress(DesyncError):
                return Header.unpack(raw)
        self._skip_rest(more)
        # not a message of a rank: raises, saying what arrived and where
        return decode_header(raw, more, rank=self.rank, peer=self.peer, op=wait.op,
                             where=self.describe_pull())

    def recv_payload(self, op: str) -> Any:
        frame = self.pull.recv(copy=False)
        if frame.more:  # the frame says so: no socket option to ask
            self._check_last(op)
        return frame.buffer

    def recv_payload_into(self, out: np.ndarray, op: str) -> int:
        n = self.pull.recv_into(out)  # type: ignore[arg-type]  # a buffer: see send
        self._check_last(op)
        if n != out.nbytes:
            raise CommError(f"a payload of {n} B arrived on {self._arrived()}, where this op "
                            f"expects {out.nbytes} B from rank {self.peer}", rank=self.rank,
                            op=op, peer=self.peer)
        return n

    def _check_last(self, op: str) -> None:
        """A message is two frames: a third is not ringcomm's, and goes unread."""
        if self.pull.getsockopt(zmq.RCVMORE):
            self._skip_rest(True)
            raise CommError(f"a message of more than two frames arrived on {self._arrived()}; "
                            f"{_NOT_OURS}", rank=self.rank, op=op, peer=self.peer)

    def _arrived(self) -> str:
        return f"the socket for rank {self.peer}'s messages ({self.describe_pull()})"

    def _skip_rest(self, more: bool) -> None:
        """Drop what is left of a message refused part-way, so the next read starts on a
        message boundary."""
        while more:
            self.pull.recv(copy=False)
            more = bool(self.pull.getsockopt(zmq.RCVMORE))

    def peek(self) -> bool:
        return bool(self.pull.poll(0))

    # ---------------------------------------------------------------- waiting
    def _readable(self, events: dict) -> bool:
        return self.pull in events

    def _ready_or_lost(self, wait: Wait) -> bool:
        # checked every time: the event may have been read by an earlier wait
        if not self.lost:
            return False
        if self.pull.poll(0):
            return True
        self.peer_lost(wait.op)
        return False

    def _on_events(self, events: dict) -> None:
        if self.monitor not in events:
            return
        while True:
            try:
                msg = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(msg)
            kind, value = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._remember(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                self._addresses.pop(value, None)
            connection = self.arrivals.alone()  # the one a handshake event is about, if known
            if self.arrivals.see(kind, value):
                self.lost = True
            elif kind & auth.HANDSHAKE_FAILED:
                self._refused(kind, value, connection)

    def _remember(self, fd: int) -> None:
        """Read the address of the connection just accepted on ``fd`` while it is there
        (the monitor names a connection by its descriptor only, and a refused one closes
        within a round trip): for the log line that a refusal writes."""
        if len(self._addresses) >= _ADDRESSES_KEPT:
            self._addresses.pop(next(iter(self._addresses)))
        address = peer_address(fd, self.describe_pull())
        if address is not None:
            self._addresses[fd] = address

    def _refused(self, event: int, value: int, connection: int | None) -> None:
        """Log a failed handshake on the receiving socket (a stranger's: not the peer, who
        holds the token), at the transport's bounded rate of refusal lines."""
        why = refusal_reason(event, value)
        if why is None:  # the gatekeeper has said why
            return
        address = self._addresses.pop(connection, None) if connection is not None else None
        self.control.refusals.warning(
            "a link refused a handshake", "rank %d's socket for rank %d's messages (%s) "
            "refused a connection from an unknown peer at %s: %s", self.rank, self.peer,
            self.describe_pull(), address or "an address not known (it left before it was "
            "read)", why)

    def describe_pull(self) -> str:
        return self.pull.getsockopt_string(zmq.LAST_ENDPOINT)


def refusal_reason(event: int, value: int) -> str | None:
    """Why a receiving socket refused a handshake, from its monitor's event; None where the
    gatekeeper (ZAP) refused it and has logged why."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return None
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
            value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "its CURVE handshake does not decrypt with this token's keys (another token)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
            value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "one end uses a token and the other none"
    return f"not ZeroMQ, or not ringcomm's protocol (code {value:#x})"


def peer_address(fd: int, endpoint: str) -> str | None:
    """The address of the far end of the connection that descriptor ``fd`` holds, where it
    is still a connection to ``endpoint`` (this socket's): ``host:port`` over tcp, the
    process over ipc; None where it is gone (ZeroMQ owns the descriptor: this reads a
    duplicate of it, and a descriptor since closed, or reused for something else, is told
    apart by its own address)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if dup.family == socket.AF_UNIX:
            if f"ipc://{dup.getsockname()}" != endpoint:
                return None
            pid, uid, _ = struct.unpack("3i", dup.getsockopt(socket.SOL_SOCKET,
                                                            socket.SO_PEERCRED, 12))
            return f"a process on this host (pid {pid}, uid {uid})"
        port = dup.getsockname()[1]
        if not endpoint.endswith(f":{port}"):
            return None
        far = dup.getpeername()
        return f"[{far[0]}]:{far[1]}" if dup.family == socket.AF_INET6 else f"{far[0]}:{far[1]}"
    except OSError:
        return None
    finally:
        dup.close()


class Arrivals:
    """The connections that reach one receiving socket, from its monitor's events: whether
    the peer's connection has closed (``see`` returns True), as opposed to a stranger's.

    Anyone who can reach a tcp port can open a connection to it, and the socket's monitor
    reports that connection closing like any other; only a closing connection known to have
    finished its handshake (the peer's: with a token, only a peer holding it can finish one)
    counts, and only once no such connection is left. The monitor names an accepted
    connection by its descriptor but not the handshake, so a handshake is known to be a
    connection's only while that connection is the one in a handshake. Where a stranger's
    handshake overlaps the peer's, neither is known: the peer's loss then shows as a
    timeout, never a stranger's as a loss."""

    __slots__ = ("_handshaking", "_peers")

    def __init__(self) -> None:
        self._handshaking: list[int] = []  # descriptors accepted, not known to be done
        self._peers: set[int] = set()  # known to have finished a handshake

    def alone(self) -> int | None:
        """The descriptor of the one connection in a handshake, if only one is: the one
        the next handshake event is about (None where none is, or several are)."""
        return self._handshaking[0] if len(self._handshaking) == 1 else None

    def see(self, event: int, value: int) -> bool:
        """Take one monitor event; True when the last connection known to have finished
        its handshake has closed (the peer is gone)."""
        if event == zmq.EVENT_ACCEPTED:
            self._handshaking.append(value)
        elif event & auth.HANDSHAKE_EVENTS and len(self._handshaking) == 1:
            done = self._handshaking.pop()
            if event == auth.HANDSHAKE_SUCCEEDED:
                self._peers.add(done)
        elif event == zmq.EVENT_DISCONNECTED:
            if value in self._peers:
                self._peers.discard(value)
                return not self._peers
            if value in self._handshaking:
                self._handshaking.remove(value)
        return False
