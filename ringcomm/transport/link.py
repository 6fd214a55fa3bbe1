"""A link: this rank's ordered connection to one peer, and the control plane beside it.

Why links: each kind of connection is one small class (``LocalLink``: a named pipe and a
shared-memory ring between ranks of one host; ``SocketLink``: ZeroMQ, tcp between hosts;
``InMemoryLink``: ranks that are threads of one process), and the ``Transport`` above them
holds one per peer and does what every kind shares (telling collective from point-to-point
messages, checking each header against what the op expects). A link that wraps another (a
fault injector, a checksum) or one whose buffers live on a device plugs in here without
the transport or the executor knowing.

What a receive waits for, its op and its deadline travel with the call (``Wait``), never as
state left on the link: a link serves whichever op calls it, and a stalled receive's probe
tells the peer exactly what it expects.

The control plane carries what must reach a peer even while that peer waits on somebody
else: an abort (this rank failed) and a probe (this rank has waited long in this op).
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import CommAborted, CommError, CommTimeout, RemoteError
from .header import Header


@dataclass(slots=True)
class Wait:
    """One call's own state: the op (for errors), its deadline, and for a collective's
    receive the header it expects (what a probe shows the peer)."""

    op: str
    deadline: float
    expected: Header | None = None


class SendHandle(Protocol):
    """Returned by a send still in flight. If ``reads_buffer``, the payload's memory must not
    change until ``done``; either way the op waits for it before it returns."""

    reads_buffer: bool

    @property
    def done(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...


def remote_error(header: Header, payload: Any, rank: int, op: str) -> CommError:
    """The error an abort notice from ``header.sender`` becomes on this rank: this rank's own
    (``ControlPlane.wake``) ends its op with ``CommAborted``."""
    text = bytes(payload).decode(errors="replace")
    if header.sender == rank:
        return CommAborted(text, rank=rank, op=op)
    return RemoteError(f"rank {header.sender} failed and aborted the group: {text}",
                       rank=rank, op=op, peer=header.sender)


class Link(abc.ABC):
    """Ordered messages (a header and a payload) between this rank and ``peer``.

    ``send`` never blocks (the message is queued; a zero-copy send returns a handle that says
    when the buffer may be reused). ``recv_header`` blocks until the next message arrives,
    the deadline passes (``CommTimeout``), the peer is lost (``PeerLostError``) or any rank
    aborts (``RemoteError``); its payload is then read with one of the ``recv_payload*``
    calls before the next header.
    """

    kind = "link"  # what ``describe`` calls it
    checks_delivery = False  # whether ``check_delivered`` does anything

    def __init__(self, rank: int, peer: int) -> None:
        self.rank = rank
        self.peer = peer
        # payloads sent, by path: what a user checks to see shared memory at work
        self.counters: dict[str, int] = {}

    # ---------------------------------------------------------------- sending
    @abc.abstractmethod
    def send(self, header: Header, payload: np.ndarray | None, op: str) -> SendHandle | None:
        """Queue ``header`` and ``payload`` (``header.nbytes`` bytes) to the peer."""

    def reserve(self, nbytes: int) -> np.ndarray | None:
        """A writable ``nbytes`` buffer (uint8) that the next ``send_reserved`` delivers
        without copying it again, or None where this link has none (then build the payload
        in your own memory and ``send`` it)."""
        return None

    def send_reserved(self, header: Header, op: str) -> SendHandle | None:
        """Send the buffer the last ``reserve`` returned, now filled."""
        raise NotImplementedError(f"{type(self).__name__} has no reserved buffers")

    def host_memory(self) -> tuple[tuple[int, int], ...]:
        """The shared host memory this link's payloads are written into and read from in
        place, mapped now, as (address, bytes): a shared-memory ring's payload area. A
        device channel page-locks it, so its copies to and from the device run at full
        speed with no bounce buffer. Empty where the link has none (yet)."""
        return ()

    def send_notice(self, header: Header, text: bytes) -> None:  # noqa: B027 - optional hook
        """Put an abort notice in the data stream too, where the link keeps order with the
        data (so a peer that sees this rank go reads why first). Best effort."""

    def wait_sent(self, handle: SendHandle, wait: Wait) -> None:
        """Wait until a zero-copy send no longer reads its buffer. Links that can tell also
        raise PeerLostError / RemoteError when that happens first."""
        if not handle.wait(max(0.0, wait.deadline - time.monotonic())):
            raise CommTimeout(
                f"a send to rank {self.peer} did not leave this process in time (is it alive?)",
                rank=self.rank, op=wait.op, peer=self.peer,
            )

    def check_delivered(self, op: str) -> None:  # noqa: B027 - optional hook
        """Called once an op has sent its last message to the peer: raise PeerLostError if
        the peer is gone before it took what was sent. Links whose sends fail by themselves
        when the peer is gone (a socket, a pipe) need not do anything."""

    # ---------------------------------------------------------------- receiving
    @abc.abstractmethod
    def recv_header(self, wait: Wait) -> Header:
        """The next message's header."""

    @abc.abstractmethod
    def recv_payload(self, op: str) -> Any:
        """The payload of the message whose header was just read, as a buffer (valid until
        the next ``recv_header``)."""

    @abc.abstractmethod
    def recv_payload_into(self, out: np.ndarray, op: str) -> int:
        """Receive the payload straight into ``out`` (uint8); return its size in bytes."""

    def release_payload(self) -> None:  # noqa: B027 - optional hook
        """The payload ``recv_payload`` returned has been used: its memory may go back to
        the sender now rather than at the next ``recv_header`` (a ring that drains between
        ops starts over at the front, on pages both processes have warm)."""

    def discard_payload(self, op: str) -> None:
        """Drop the payload of a message that is not the one expected (an error follows)."""
        self.recv_payload(op)

    def peek(self) -> bool:
        """Whether a message can be read without waiting; False where the link cannot tell
        cheaply (receives then go in schedule order)."""
        return False

    # ---------------------------------------------------------------- the rest
    def describe(self) -> str:
        """How this rank's messages reach the peer, for people."""
        return self.kind

    def finish_sending(self) -> None:  # noqa: B027 - optional hook
        """Let queued messages go before the transport closes (run on every link before any
        is closed, so live peers can still read what was sent to them)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the link holds. Called once."""


class ControlPlane(abc.ABC):
    """Notices that reach a peer whatever it waits on. Receiving them is the links' job
    (each kind watches the control plane while it waits for data)."""

    @abc.abstractmethod
    def abort(self, peer: int, header: Header, text: bytes) -> None:
        """Tell ``peer`` that this rank failed (``header`` is an ABORT control header)."""

    @abc.abstractmethod
    def wake(self, header: Header, text: bytes) -> None:
        """End this rank's own wait, whichever thread waits, as an abort from a peer would
        (``header`` is an ABORT control header naming this rank): for ``abort`` called while
        an op is in flight. Safe to call from any thread."""

    def check_aborted(self, seq: int, op: str) -> None:  # noqa: B027 - optional hook
        """Raise ``RemoteError`` if an abort has come from a peer that does not complete
        collective ``seq`` (its abort's sequence number is ``seq`` or less); leave every
        other notice for the waits that take it. Optional: without it an op may complete
        on a rank where a peer failed it (the next op then raises)."""

    def probe(self, peer: int, expected: Header, op: str) -> None:  # noqa: B027 - optional hook
        """Tell ``peer`` which op this rank has been waiting in, and what it expects of it,
        so a peer in another op can raise ``DesyncError`` at once. Optional."""

    def closing(self) -> None:  # noqa: B027 - optional hook
        """The transport is about to close: a peer found gone from now on needs no abort to
        explain it (its group is ending too), so nothing waits for one."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the control plane holds. Called once, after the links."""
