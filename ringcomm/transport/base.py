"""What every channel provides: ordered, checked point-to-point messages between ranks.

A ``Transport`` is one rank's set of channels to all its peers. ``send`` never blocks (the
message is queued; a zero-copy send returns a handle that says when the buffer may be
reused); ``recv``/``recv_into`` block until the next message from that peer arrives, the
op's deadline passes, the peer is lost, or another rank reports a failure (``abort``).

Collectives and point-to-point messages are two streams on one channel: a message of the
other stream that arrives first is set aside, so a ``send`` issued before a collective
does not break the collective on the receiver. Within a stream, the header of every
message is compared with what the receiver expects (``header.check``).
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections import deque
from typing import Any, Protocol

import numpy as np

from ..errors import CommTimeout, RemoteError
from .header import Header, OpKind, check


class SendHandle(Protocol):
    """Returned by a send still in flight. If ``reads_buffer``, the payload's memory must not
    change until ``done``; either way the op waits for it before it returns."""

    reads_buffer: bool

    @property
    def done(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...


class Transport(abc.ABC):
    """Channels from one rank to every other rank of a group."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        # stash[peer][is_p2p]: messages of the other stream that arrived first
        self._stash: list[tuple[deque, deque]] = [(deque(), deque()) for _ in range(world_size)]
        self.waiting_for: Header | None = None  # the message a receive waits for, if any
        self.waiting_op = ""  # the op running, for errors raised below a send or receive

    # ---------------------------------------------------------------- for subclasses
    @abc.abstractmethod
    def _send(self, peer: int, header: Header, payload: np.ndarray | None) -> SendHandle | None:
        """Queue header + payload to ``peer``; never blocks."""

    @abc.abstractmethod
    def _recv_header(self, peer: int, deadline: float, op: str) -> Header:
        """Wait for the next message from ``peer``; raise CommTimeout / PeerLostError /
        RemoteError (an abort from any rank) when that happens first."""

    @abc.abstractmethod
    def _recv_payload(self, peer: int) -> Any:
        """The payload of the message whose header was just read, as a buffer."""

    def _discard_payload(self, peer: int) -> None:
        """Drop the payload of a message that is not the one expected (an error follows)."""
        self._recv_payload(peer)

    @abc.abstractmethod
    def _recv_payload_into(self, peer: int, out: np.ndarray) -> int:
        """Receive the payload straight into ``out``; return its size in bytes."""

    def _peek(self, peer: int) -> bool:
        """Whether a message from ``peer`` can be read without waiting; False where the
        transport cannot tell cheaply (receives then go in schedule order)."""
        return False

    def reserve(self, peer: int, nbytes: int) -> np.ndarray | None:
        """A writable ``nbytes`` buffer (uint8) that the next ``send_reserved`` to ``peer``
        delivers without copying it again, or None where the transport has none (then
        build the payload in your own memory and ``send`` it)."""
        return None

    def send_reserved(self, peer: int, header: Header) -> SendHandle | None:
        """Send the buffer the last ``reserve(peer, ...)`` returned, now filled."""
        raise NotImplementedError(f"{type(self).__name__} has no reserved buffers")

    @abc.abstractmethod
    def _send_abort(self, peer: int, header: Header, text: bytes) -> None:
        """Deliver an abort notice so that ``peer`` wakes up even while it waits on others."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # ---------------------------------------------------------------- public
    def send(self, peer: int, header: Header, payload: np.ndarray | None) -> SendHandle | None:
        return self._send(peer, header, payload)

    def recv(self, peer: int, expected: Header, deadline: float, op: str) -> Any:
        """Receive the next message of ``expected``'s stream from ``peer`` and return its
        payload (a buffer of ``expected.nbytes`` bytes)."""
        stashed = self._match(peer, expected, deadline, op)
        return stashed if stashed is not None else self._recv_payload(peer)

    def recv_into(self, peer: int, expected: Header, out: np.ndarray, deadline: float,
                  op: str) -> None:
        """Like ``recv``, but the payload lands in ``out`` (no intermediate buffer)."""
        stashed = self._match(peer, expected, deadline, op)
        target = out.reshape(-1).view(np.uint8)
        if stashed is not None:
            target[:] = np.frombuffer(stashed, dtype=np.uint8)
        elif expected.nbytes:
            self._recv_payload_into(peer, target)
        else:
            self._recv_payload(peer)

    def ready(self, peer: int) -> bool:
        """Whether a collective's receive from ``peer`` would find a message waiting: a hint
        for taking independent receives in arrival order, never a promise (the message may
        be point-to-point, or an abort that the receive then raises)."""
        return bool(self._stash[peer][0]) or self._peek(peer)

    def wait_sent(self, peer: int, handle: SendHandle, deadline: float, op: str) -> None:
        """Wait until a zero-copy send to ``peer`` no longer reads its buffer. Transports
        that can tell should also raise PeerLostError / RemoteError when that happens first."""
        if not handle.wait(max(0.0, deadline - time.monotonic())):
            raise CommTimeout(
                f"a send to rank {peer} did not leave this process in time (is it alive?)",
                rank=self.rank, op=op, peer=peer,
            )

    def abort(self, seq: int, text: str) -> None:
        """Tell every peer that this rank failed, so that none of them waits for it."""
        header = Header.control(OpKind.ABORT, seq, self.rank)
        for peer in range(self.world_size):
            if peer != self.rank:
                # best effort: the peer may be gone already
                with contextlib.suppress(Exception):
                    self._send_abort(peer, header, text.encode()[:4096])

    def leftover(self) -> Header | None:
        """The header of a collective message that has arrived and that no op of this rank
        took, if there is one: at close, proof that the ranks disagreed about an op (a rank
        whose part of an op only sends cannot tell during it). Reads what is waiting, so it
        is only for a transport about to close."""
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            if self._stash[peer][0]:
                return self._stash[peer][0][0][0]
            if not self._peek(peer):
                continue
            try:
                header = self._recv_header(peer, time.monotonic(), "close")
            except Exception:  # noqa: BLE001 - a peer gone or failed: nothing to prove here
                continue
            if header.kind not in (OpKind.ABORT, OpKind.PROBE, OpKind.P2P):
                return header
        return None

    # ---------------------------------------------------------------- matching
    def _match(self, peer: int, expected: Header, deadline: float, op: str) -> Any | None:
        """Read headers from ``peer`` until one of ``expected``'s stream arrives; check it.

        Returns the payload if it had been set aside earlier, else None (the payload is
        still to be read by the caller)."""
        self.waiting_for, self.waiting_op = expected, op
        mine = self._stash[peer][int(expected.is_p2p)]
        if mine:
            header, payload = mine.popleft()
            check(expected, header, rank=self.rank, op=op)
            return payload
        while True:
            header = self._recv_header(peer, deadline, op)
            if header.kind == OpKind.ABORT:
                self.raise_remote(header, self._recv_payload(peer), op)
            if header.is_p2p != expected.is_p2p:
                other = self._stash[peer][int(header.is_p2p)]
                other.append((header, bytes(self._recv_payload(peer))))
                continue
            if header != expected:
                self._discard_payload(peer)
                check(expected, header, rank=self.rank, op=op)
            return None

    def raise_remote(self, header: Header, payload: Any, op: str) -> None:
        text = bytes(payload).decode(errors="replace")
        raise RemoteError(
            f"rank {header.sender} failed and aborted the group: {text}",
            rank=self.rank, op=op, peer=header.sender,
        )
