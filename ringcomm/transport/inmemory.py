"""In-memory channels: all ranks of a group inside one process, one thread each.

Every message is copied on send, as a wire would, so a schedule that reuses a buffer too
early gives wrong results here too. Used by the tests to run every algorithm at every
world size in a fraction of a second, and by teaching tools to trace a schedule.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ..errors import CommTimeout
from .base import Transport
from .header import Header


class _Mailbox:
    def __init__(self, world_size: int) -> None:
        self.cond = threading.Condition()
        self.queues: list[deque[tuple[Header, bytes]]] = [deque() for _ in range(world_size)]
        self.aborts: deque[tuple[Header, bytes]] = deque()


class InMemoryNetwork:
    """Creates the ``world_size`` connected transports of one in-process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.mailboxes = [_Mailbox(world_size) for _ in range(world_size)]
        self._subnetworks: dict[str, InMemoryNetwork] = {}
        self._lock = threading.Lock()

    def transport(self, rank: int) -> InMemoryTransport:
        return InMemoryTransport(self, rank)

    def subnetwork(self, tag: str, size: int) -> InMemoryNetwork:
        """The network of the subgroup called ``tag``: made by the first of its members to
        ask, found by the others (each thread of a group asks for its own transport)."""
        with self._lock:
            net = self._subnetworks.get(tag)
            if net is None:
                net = self._subnetworks[tag] = InMemoryNetwork(size)
            return net


class InMemoryTransport(Transport):
    def __init__(self, network: InMemoryNetwork, rank: int) -> None:
        super().__init__(rank, network.world_size)
        self._net = network
        self._box = network.mailboxes[rank]
        self._current: list[bytes | None] = [None] * network.world_size

    def _deliver(self, peer: int, header: Header, data: bytes, *, abort: bool) -> None:
        box = self._net.mailboxes[peer]
        with box.cond:
            (box.aborts if abort else box.queues[self.rank]).append((header, data))
            box.cond.notify_all()

    def _send(self, peer: int, header: Header, payload: np.ndarray | None) -> None:
        data = b"" if payload is None else payload.reshape(-1).view(np.uint8).tobytes()
        self._deliver(peer, header, data, abort=False)

    def _send_abort(self, peer: int, header: Header, text: bytes) -> None:
        self._deliver(peer, header, text, abort=True)

    def _recv_header(self, peer: int, deadline: float, op: str) -> Header:
        box = self._box
        with box.cond:
            while True:
                if box.aborts:
                    header, text = box.aborts[0]
                    self.raise_remote(header, text, op)
                if box.queues[peer]:
                    header, data = box.queues[peer].popleft()
                    self._current[peer] = data
                    return header
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"no message from rank {peer} in time", rank=self.rank,
                                      op=op, peer=peer)
                box.cond.wait(left)

    def _peek(self, peer: int) -> bool:
        with self._box.cond:
            return bool(self._box.queues[peer])

    def _recv_payload(self, peer: int) -> Any:
        data, self._current[peer] = self._current[peer], None
        return data

    def _recv_payload_into(self, peer: int, out: np.ndarray) -> int:
        data = self._recv_payload(peer)
        out[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return len(data)

    def close(self) -> None:
        pass
