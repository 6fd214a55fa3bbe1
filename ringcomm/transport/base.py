"""A transport: one rank's links to every other rank, and what all links share.

``send`` never blocks (the message is queued; a zero-copy send returns a handle that says
when the buffer may be reused); ``recv``/``recv_into`` block until the next message from that
peer arrives, the op's deadline passes, the peer is lost, or another rank reports a failure
(``abort``). Each call says which op it belongs to, so errors raised below it name the op.

Collectives and point-to-point messages are two streams on one link: a message of the
other stream that arrives first is set aside, so a ``send`` issued before a collective
does not break the collective on the receiver. Within a stream, the header of every
message is compared with what the receiver expects (``header.check``): above the links, so
every kind of link gets the same checks. Credits (a device channel's receiver saying which
of the sender's slots are free again) are a third stream, set aside the same way and taken
with ``recv_credit``; they belong to no op, so they prove nothing at close.

The shared board of ranks on one host is a channel of its own (``board_channel``) beside the
transport; while a rank waits there it asks the transport to ``screen`` its links.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from .board_channel import BoardChannel
from .header import Header, OpKind, check
from .link import ControlPlane, Link, SendHandle, Wait, remote_error

# the streams of messages on one link, each in its own order: collective (0, every kind not
# named here), point-to-point, credits
_COLLECTIVE, _P2P, _CREDIT = 0, 1, 2
_STREAM_OF: dict[int, int] = {OpKind.P2P: _P2P, OpKind.CREDIT: _CREDIT}
_Stash = deque[tuple[Header, bytes]]


class Transport:
    """Links from ``rank`` to every other rank of a group (``links[rank]`` is None), and the
    control plane that carries aborts and probes."""

    def __init__(self, rank: int, world_size: int, links: Sequence[Link | None],
                 control: ControlPlane) -> None:
        self.rank = rank
        self.world_size = world_size
        self.links = list(links)
        self.control = control
        # stash[peer][stream]: messages of another stream that arrived first
        self._stash: list[tuple[_Stash, _Stash, _Stash]] = [
            (deque(), deque(), deque()) for _ in range(world_size)]
        self._closed = False
        self._checks_delivery: bool | None = None
        # the shared board beside the links, where the set-up made one (closed with them)
        self.board: BoardChannel | None = None
        # the largest segment the links admit (set at their set-up), where they bound it
        self.max_segment_bytes: int | None = None

    def _link(self, peer: int) -> Link:
        """The link to ``peer``, another rank (this rank has no link to itself)."""
        link = self.links[peer]
        assert link is not None, f"rank {self.rank} has no link to itself"
        return link

    # ---------------------------------------------------------------- sending
    def send(self, peer: int, header: Header, payload: np.ndarray | None,
             op: str) -> SendHandle | None:
        return self._link(peer).send(header, payload, op)

    def reserve(self, peer: int, nbytes: int) -> np.ndarray | None:
        """A writable ``nbytes`` buffer that the next ``send_reserved`` to ``peer`` delivers
        without another copy, or None (see ``Link.reserve``)."""
        return self._link(peer).reserve(nbytes)

    def send_reserved(self, peer: int, header: Header, op: str) -> SendHandle | None:
        return self._link(peer).send_reserved(header, op)

    def host_memory(self, peer: int) -> tuple[tuple[int, int], ...]:
        """The shared host memory of the link to ``peer`` (see ``Link.host_memory``)."""
        return self._link(peer).host_memory()

    def wait_sent(self, peer: int, handle: SendHandle, deadline: float, op: str) -> None:
        """Wait until a zero-copy send to ``peer`` no longer reads its buffer."""
        self._link(peer).wait_sent(handle, Wait(op, deadline))

    @property
    def checks_delivery(self) -> bool:
        """Whether any link needs ``check_delivered`` after an op's sends (links are fixed
        once the transport is set up, so this is asked once)."""
        if self._checks_delivery is None:
            self._checks_delivery = any(link is not None and link.checks_delivery
                                        for link in self.links)
        return self._checks_delivery

    def check_delivered(self, peer: int, op: str) -> None:
        """Once ``op`` has sent its last message to ``peer``: raise PeerLostError if ``peer``
        is gone before it took them (see ``Link.check_delivered``)."""
        link = self._link(peer)
        if link.checks_delivery:
            link.check_delivered(op)

    # ---------------------------------------------------------------- receiving
    def recv(self, peer: int, expected: Header, deadline: float, op: str) -> Any:
        """Receive the next message of ``expected``'s stream from ``peer`` and return its
        payload (a buffer of ``expected.nbytes`` bytes)."""
        stashed = self._match(peer, expected, Wait(op, deadline, expected))
        return stashed if stashed is not None else self._link(peer).recv_payload(op)

    def release(self, peer: int) -> None:
        """The payload the last ``recv`` from ``peer`` returned has been used."""
        self._link(peer).release_payload()

    def recv_into(self, peer: int, expected: Header, out: np.ndarray, deadline: float,
                  op: str) -> None:
        """Like ``recv``, but the payload lands in ``out`` (no intermediate buffer)."""
        stashed = self._match(peer, expected, Wait(op, deadline, expected))
        target = out.reshape(-1).view(np.uint8)
        if stashed is not None:
            target[:] = np.frombuffer(stashed, dtype=np.uint8)
        elif expected.nbytes:
            self._link(peer).recv_payload_into(target, op)
        else:
            self._link(peer).recv_payload(op)

    def ready(self, peer: int) -> bool:
        """Whether a collective's receive from ``peer`` would find a message waiting: a hint
        for taking independent receives in arrival order, never a promise (the message may
        be point-to-point, or an abort that the receive then raises)."""
        return bool(self._stash[peer][0]) or self._link(peer).peek()

    def _match(self, peer: int, expected: Header, wait: Wait) -> Any | None:
        """Read headers from ``peer`` until one of ``expected``'s stream arrives; check it.

        Returns the payload if it had been set aside earlier, else None (the payload is
        still to be read by the caller)."""
        op, link = wait.op, self._link(peer)
        want = _P2P if expected.is_p2p else _COLLECTIVE
        mine = self._stash[peer][want]
        if mine:
            header, payload = mine.popleft()
            check(expected, header, rank=self.rank, op=op)
            return payload
        while True:
            header = link.recv_header(wait)
            if header.kind == OpKind.ABORT:
                raise remote_error(header, link.recv_payload(op), self.rank, op)
            stream = _STREAM_OF.get(header.kind, _COLLECTIVE)
            if stream != want:
                self._stash[peer][stream].append((header, bytes(link.recv_payload(op))))
                continue
            if header != expected:
                link.discard_payload(op)
                check(expected, header, rank=self.rank, op=op)
            return None

    # ---------------------------------------------------------------- credits
    def send_credit(self, peer: int, count: int, op: str) -> None:
        """Tell ``peer`` that this rank has used ``count`` of its messages in all (a device
        channel's slots: see ``ringcomm.engines.cuda_ipc``)."""
        self._link(peer).send(Header.credit(self.rank, count), None, op)

    def recv_credit(self, peer: int, deadline: float, op: str) -> int:
        """The count the next credit from ``peer`` carries, in the order they were sent.
        Messages of the other streams that arrive first are set aside for their receives;
        the wait ends as a receive's does (deadline, lost peer, abort)."""
        credit = None
        while credit is None:
            credit = self._next_credit(peer, Wait(op, deadline))
        return credit

    def poll_credit(self, peer: int, op: str) -> int | None:
        """Like ``recv_credit``, but None at once where no credit has arrived yet."""
        link = self._link(peer)
        while True:
            if not self._stash[peer][_CREDIT] and not link.peek():
                return None
            credit = self._next_credit(peer, Wait(op, time.monotonic() + 1.0))
            if credit is not None:
                return credit

    def _next_credit(self, peer: int, wait: Wait) -> int | None:
        """A stashed credit, or read one message from ``peer``: its count if it is a
        credit, None once another stream's message has been set aside."""
        mine = self._stash[peer][_CREDIT]
        if mine:
            return mine.popleft()[0].count
        link, op = self._link(peer), wait.op
        header = link.recv_header(wait)
        if header.kind == OpKind.ABORT:
            raise remote_error(header, link.recv_payload(op), self.rank, op)
        stream = _STREAM_OF.get(header.kind, _COLLECTIVE)
        payload = bytes(link.recv_payload(op))
        if stream == _CREDIT:
            return header.count
        self._stash[peer][stream].append((header, payload))
        return None

    # ---------------------------------------------------------------- screening
    def screen(self, peer: int, wait: Wait) -> None:
        """While this rank waits on the board (no message belongs to its op): read what
        ``peer`` has sent. An abort raises; a point-to-point message, or one of a later op
        (the peer has run ahead), is set aside for the receive that takes it; a collective
        message of this op or an earlier one proves that the ranks disagree about the op
        (one runs it on the board, the other over links): ``DesyncError``."""
        link = self._link(peer)
        expected = wait.expected
        assert expected is not None, "a board wait knows the op's header"
        while link.peek():
            header = link.recv_header(Wait(wait.op, wait.deadline))
            if header.kind == OpKind.ABORT:
                raise remote_error(header, link.recv_payload(wait.op), self.rank, wait.op)
            stream = _STREAM_OF.get(header.kind, _COLLECTIVE)
            if stream != _COLLECTIVE or header.seq > expected.seq:
                self._stash[peer][stream].append((header, bytes(link.recv_payload(wait.op))))
                continue
            link.discard_payload(wait.op)
            check(expected._replace(sender=peer), header, rank=self.rank, op=wait.op)

    # ---------------------------------------------------------------- failures
    def abort(self, seq: int, text: str) -> None:
        """Tell every peer that this rank failed, so that none of them waits for it: ``seq``
        is the first collective this rank does not complete (``check_aborted``)."""
        header = Header.control(OpKind.ABORT, seq, self.rank)
        body = text.encode()[:4096]
        for peer, link in enumerate(self.links):
            if link is None:
                continue
            # best effort: the peer may be gone already
            with contextlib.suppress(Exception):
                link.send_notice(header._replace(nbytes=len(body)), body)
            with contextlib.suppress(Exception):
                self.control.abort(peer, header, body)

    def check_aborted(self, seq: int, op: str) -> None:
        """Before collective ``seq`` returns: raise ``RemoteError`` if a peer's abort says
        that the peer does not complete it (its messages of the op may have been all this
        rank needed: it must not report success for an op that another rank failed)."""
        self.control.check_aborted(seq, op)

    def die(self) -> NoReturn:
        """End this rank at once, as SIGKILL would: nothing closed, no peer told (what an
        injected kill does, ``ringcomm.faults``). Ranks that are threads of one process
        end their own way (``InMemoryTransport``)."""
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("SIGKILL returned")  # never reached

    def wake(self, text: str) -> None:
        """End the op this rank has in flight, whichever thread runs it, with
        ``CommAborted(text)``, as a peer's abort would end it (``OpRunner.abort``)."""
        body = text.encode()[:4096]
        self.control.wake(Header.control(OpKind.ABORT, 0, self.rank)._replace(nbytes=len(body)),
                          body)

    def leftover(self) -> Header | None:
        """The header of a collective message that has arrived and that no op of this rank
        took, if there is one: at close, proof that the ranks disagreed about an op (a rank
        whose part of an op only sends cannot tell during it). Reads what is waiting, so it
        is only for a transport about to close."""
        self.control.closing()  # a peer that has closed already is no news to wait on
        for peer, link in enumerate(self.links):
            if link is None:
                continue
            if self._stash[peer][0]:
                return self._stash[peer][0][0][0]
            if not link.peek():
                continue
            try:
                header = link.recv_header(Wait("close", time.monotonic()))
            except Exception:  # noqa: BLE001 - a peer gone or failed: nothing to prove here
                continue
            if header.kind not in (OpKind.ABORT, OpKind.PROBE, OpKind.P2P, OpKind.CREDIT):
                return header
        return None

    # ---------------------------------------------------------------- the rest
    @property
    def counters(self) -> Counter[str]:
        """Payloads sent, by path (``shm``, ``pipe``, ``socket``...), over all links; a path
        no link of this transport has reads 0."""
        total: Counter[str] = Counter()
        for link in self.links:
            if link is not None:
                total.update(link.counters)
        return total

    def describe(self) -> str:
        """One line per peer: how this rank's messages reach it."""
        lines = [f"rank {self.rank} -> rank {peer}: {link.describe()}"
                 for peer, link in enumerate(self.links) if link is not None]
        return "\n".join(lines) or f"rank {self.rank}: no peers"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close()

    def _close(self) -> None:
        if self.board is not None:
            self.board.close()
        links = [link for link in self.links if link is not None]
        for link in links:
            link.finish_sending()
        for link in links:
            link.close()
        self.control.close()
