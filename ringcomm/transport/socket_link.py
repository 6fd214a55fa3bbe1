"""A ZeroMQ link: a PUSH socket to the peer's PULL socket, ``tcp://`` between hosts (and
``ipc://`` on one host when shared memory is off).

- Large payloads leave with ``copy=False`` (no copy into ZeroMQ) and are tracked, so the
  executor knows when the buffer may change again. Small ones are copied: cheaper than
  tracking. Payloads are received straight into their destination (``recv_into``) or, when
  they are to be reduced, as a ZeroMQ frame that the reduction reads in place.
- A socket monitor on the receiving socket notices the peer's connection closing, so a
  dead peer becomes a ``PeerLostError`` at once rather than a timeout; a stranger's
  connection closing does not count (``Arrivals``).
- High-water marks are off: a send never blocks, which is what lets schedules queue sends
  ahead of their receives without deadlock.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import CommError, CommTimeout, PeerLostError
from . import auth
from .header import SIZE as HEADER_SIZE
from .header import Header
from .link import Wait
from .zmq_control import PolledLink, ZmqControl

ZERO_COPY_MIN_BYTES = 64 * 1024  # below this a copy is cheaper than tracking (pyzmq's own limit)
_SEND_POLL_S = 0.05  # how often a wait for a send looks for a lost peer or an abort
_LOST_GRACE_S = 1.0  # a send to a peer whose connection closed may still be finishing


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


def decode_header(raw: bytes, more: bool, *, rank: int, peer: int, op: str) -> Header:
    """The header frame of a message from ``peer``: exactly ``header.SIZE`` bytes, in this
    wire format, followed by its payload frame (``more``). Anything else is a ``CommError``
    saying what was wrong; nothing is allocated from what the frame claims."""
    if len(raw) != HEADER_SIZE or not more:
        what = (f"a first frame of {len(raw)} B (a header is {HEADER_SIZE} B)"
                if len(raw) != HEADER_SIZE else "a header without a payload frame")
        raise CommError(f"malformed message from rank {peer}: {what}", rank=rank, op=op,
                        peer=peer)
    return Header.unpack(raw)


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
        try:
            return decode_header(raw, more, rank=self.rank, peer=self.peer, op=wait.op)
        except CommError:
            self._skip_rest(more)
            raise

    def recv_payload(self, op: str) -> Any:
        frame = self.pull.recv(copy=False)
        if frame.more:  # the frame says so: no socket option to ask
            self._check_last(op)
        return frame.buffer

    def recv_payload_into(self, out: np.ndarray, op: str) -> int:
        n = self.pull.recv_into(out)  # type: ignore[arg-type]  # a buffer: see send
        self._check_last(op)
        if n != out.nbytes:
            raise CommError(f"payload of {n} B from rank {self.peer}, expected {out.nbytes} B",
                            rank=self.rank, op=op, peer=self.peer)
        return n

    def _check_last(self, op: str) -> None:
        """A message is two frames: a third is not ringcomm's, and goes unread."""
        if self.pull.getsockopt(zmq.RCVMORE):
            self._skip_rest(True)
            raise CommError(f"a message from rank {self.peer} has more than two frames; is "
                            "every rank running the same ringcomm version?", rank=self.rank,
                            op=op, peer=self.peer)

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
            if self.arrivals.see(event["event"], int(event["value"])):
                self.lost = True
            elif event["event"] & auth.HANDSHAKE_FAILED:
                auth.log_refusal(f"rank {self.rank}'s link from rank {self.peer}",
                                 event["event"], int(event["value"]), self.describe_pull())

    def describe_pull(self) -> str:
        return self.pull.getsockopt_string(zmq.LAST_ENDPOINT)


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
