"""A ZeroMQ link: a PUSH socket to the peer's PULL socket, ``tcp://`` between hosts (and
``ipc://`` on one host when shared memory is off).

- Large payloads leave with ``copy=False`` (no copy into ZeroMQ) and are tracked, so the
  executor knows when the buffer may change again. Small ones are copied: cheaper than
  tracking. Payloads are received straight into their destination (``recv_into``) or, when
  they are to be reduced, as a ZeroMQ frame that the reduction reads in place.
- A socket monitor on the receiving socket notices the peer's connection closing, so a
  dead peer becomes a ``PeerLostError`` at once rather than a timeout.
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
        if len(raw) != HEADER_SIZE or not self.pull.getsockopt(zmq.RCVMORE):
            raise CommError(f"malformed message from rank {self.peer}", rank=self.rank,
                            op=wait.op, peer=self.peer)
        return Header.unpack(raw)

    def recv_payload(self, op: str) -> Any:
        return self.pull.recv(copy=False).buffer

    def recv_payload_into(self, out: np.ndarray, op: str) -> int:
        n = self.pull.recv_into(out)  # type: ignore[arg-type]  # a buffer: see send
        if n != out.nbytes:
            raise CommError(f"payload of {n} B from rank {self.peer}, expected {out.nbytes} B",
                            rank=self.rank, op=op, peer=self.peer)
        return n

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
            if parse_monitor_message(msg)["event"] == zmq.EVENT_DISCONNECTED:
                self.lost = True
