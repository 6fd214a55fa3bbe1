"""In-memory links: all ranks of a group inside one process, one thread each.

Every message is copied on send, as a wire would, so a schedule that reuses a buffer too
early gives wrong results here too. Used by the tests to run every algorithm at every
world size in a fraction of a second, and by teaching tools to trace a schedule. A network
made with ``board=True`` also gives its ranks a shared board (in a bytearray), as ranks of
one host get in shared memory.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, NoReturn

import numpy as np

from ..errors import CommTimeout, PeerLostError, RankKilled
from .base import Transport
from .board import Board, size
from .board_channel import BoardChannel, Screening, board_wait
from .header import Header
from .link import ControlPlane, Link, Wait, remote_error


class _Mailbox:
    """What one rank receives: a queue per sender, and the aborts of any rank."""

    def __init__(self, world_size: int) -> None:
        self.cond = threading.Condition()
        self.queues: list[deque[tuple[Header, bytes]]] = [deque() for _ in range(world_size)]
        self.aborts: deque[tuple[Header, bytes]] = deque()

    def deliver(self, sender: int, header: Header, data: bytes, *, abort: bool) -> None:
        with self.cond:
            (self.aborts if abort else self.queues[sender]).append((header, data))
            self.cond.notify_all()


class InMemoryNetwork:
    """Creates the ``world_size`` connected transports of one in-process group."""

    def __init__(self, world_size: int, *, board: bool = False) -> None:
        self.world_size = world_size
        self.mailboxes = [_Mailbox(world_size) for _ in range(world_size)]
        self._subnetworks: dict[str, InMemoryNetwork] = {}
        self._lock = threading.Lock()
        self.board_memory = bytearray(size(world_size)) if board and world_size > 1 else None
        self.board_posted = threading.Condition()  # notified on every post
        self.gone: set[int] = set()  # ranks killed by an injected fault (``die``)

    def transport(self, rank: int) -> InMemoryTransport:
        return InMemoryTransport(self, rank)

    def leave(self, rank: int) -> None:
        """Rank ``rank`` is gone (its thread ended as a killed process would): every rank
        waiting for it hears so, after the messages it sent before."""
        self.gone.add(rank)
        for box in self.mailboxes:
            with box.cond:
                box.cond.notify_all()
        with self.board_posted:
            self.board_posted.notify_all()

    def subnetwork(self, tag: str, size: int) -> InMemoryNetwork:
        """The network of the subgroup called ``tag``: made by the first of its members to
        ask, found by the others (each thread of a group asks for its own transport)."""
        with self._lock:
            net = self._subnetworks.get(tag)
            if net is None:
                net = self._subnetworks[tag] = InMemoryNetwork(
                    size, board=self.board_memory is not None)
            return net


class InMemoryLink(Link):
    kind = "in-memory"

    def __init__(self, network: InMemoryNetwork, rank: int, peer: int) -> None:
        super().__init__(rank, peer)
        self._theirs = network.mailboxes[peer]
        self._mine = network.mailboxes[rank]
        self._gone = network.gone
        self._current: bytes | None = None

    def send(self, header: Header, payload: np.ndarray | None, op: str) -> None:
        data = b"" if payload is None else payload.reshape(-1).view(np.uint8).tobytes()
        self._theirs.deliver(self.rank, header, data, abort=False)

    def send_notice(self, header: Header, text: bytes) -> None:
        # in the data too, as a pipe carries it: a peer that only reads what is waiting
        # (``Transport.screen``, while it watches device work) sees the abort there
        self._theirs.deliver(self.rank, header, bytes(text), abort=False)

    def recv_header(self, wait: Wait) -> Header:
        box = self._mine
        with box.cond:
            while True:
                if box.aborts:
                    header, text = box.aborts[0]
                    raise remote_error(header, text, self.rank, wait.op)
                if box.queues[self.peer]:
                    header, self._current = box.queues[self.peer].popleft()
                    return header
                if self.peer in self._gone:
                    raise PeerLostError(f"rank {self.peer} is gone (its thread was killed)",
                                        rank=self.rank, op=wait.op, peer=self.peer)
                left = wait.deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"no message from rank {self.peer} in time",
                                      rank=self.rank, op=wait.op, peer=self.peer)
                box.cond.wait(left)

    def peek(self) -> bool:
        with self._mine.cond:
            return bool(self._mine.queues[self.peer])

    def recv_payload(self, op: str) -> Any:
        data, self._current = self._current, None
        return data

    def recv_payload_into(self, out: np.ndarray, op: str) -> int:
        data = self.recv_payload(op)
        out[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return len(data)


class _InMemoryControl(ControlPlane):
    def __init__(self, network: InMemoryNetwork) -> None:
        self._net = network

    def abort(self, peer: int, header: Header, text: bytes) -> None:
        self._net.mailboxes[peer].deliver(header.sender, header, text, abort=True)

    def wake(self, header: Header, text: bytes) -> None:
        self.abort(header.sender, header, text)


class InMemoryTransport(Transport):
    """Rank ``rank``'s links in ``network``, and its view of the network's board if it has
    one (``board``)."""

    def __init__(self, network: InMemoryNetwork, rank: int) -> None:
        links = [None if peer == rank else InMemoryLink(network, rank, peer)
                 for peer in range(network.world_size)]
        super().__init__(rank, network.world_size, links, _InMemoryControl(network))
        if network.board_memory is not None:
            self.board = InMemoryBoardChannel(
                Board(network.board_memory, rank, network.world_size), self, network)
        self._network = network

    def die(self) -> NoReturn:
        """This rank's thread ends at once (``RankKilled``), and its peers see it gone, as
        they would see a killed process's pipes close."""
        self._network.leave(self.rank)
        raise RankKilled(f"rank {self.rank} was killed by an injected fault")


class InMemoryBoardChannel(BoardChannel):
    """The board of ranks that are threads of one process: a wait sleeps on the network's
    condition, which every post notifies, and looks at the aborts meanwhile."""

    _fused = True

    def __init__(self, board: Board, transport: Screening, network: InMemoryNetwork) -> None:
        super().__init__(board, transport)
        self._network = network

    def _wait(self, peer: int, number: int, op: str, deadline: float, header: bytes) -> None:
        wait = board_wait(op, deadline, header, peer)
        board, posted = self.board, self._network.board_posted
        aborts = self._network.mailboxes[self.rank].aborts
        with posted:
            while board.posted(peer) < number:
                if aborts:
                    notice, text = aborts[0]
                    raise remote_error(notice, text, self.rank, wait.op)
                if peer in self._network.gone:
                    raise PeerLostError(f"rank {peer} is gone (its thread was killed) before "
                                        "it posted its part of this op", rank=self.rank,
                                        op=wait.op, peer=peer)
                left = wait.deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"rank {peer} did not post its part of this op in time",
                                      rank=self.rank, op=wait.op, peer=peer)
                posted.wait(min(left, 0.01))  # aborts come through the mailbox: look often

    def _posted(self) -> None:
        with self._network.board_posted:
            self._network.board_posted.notify_all()
