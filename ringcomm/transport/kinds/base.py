"""What a link kind is, and what every kind of one transport's set-up shares.

A *link kind* is one way of connecting a pair of ranks (pipes and shared memory, ZeroMQ
sockets, and later device links). Each is one module with one class that answers three
questions, in this order, during a group's set-up through the store:

1. ``offer``: what this rank offers to its peers in this kind (a JSON-able record: names,
   addresses, sizes), made before any rank has seen another's; None offers nothing. The
   kind may make what the offer names (bind a socket, create a pipe) here.
2. ``verdict``: given this rank's offer and a peer's, whether this kind can serve the pair,
   and why or why not, in words a person reads in ``comm.describe()``.
3. ``connect``: the link to that peer, for the pairs this kind was chosen for.

The registry (``ringcomm.transport.kinds``) orders the kinds; for each pair the first whose
verdict serves it makes the link. ``connected`` runs once every pair has a link (a kind
whose links need both ends open first, like a named pipe, waits for that there), and
``close`` runs at the transport's teardown, after its links are closed.

``SetUp`` holds what the kinds of one transport share: this rank's place in the group,
the ZeroMQ context, the files to remove at exit, the control plane, the settings.
"""

from __future__ import annotations

import abc
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from ...core.arrays import HOST_ONLY
from ...errors import CommError
from .. import shm_ring
from ..files import TransportFiles, ipc_base
from ..link import Link
from ..pipe import Flusher
from ..zmq_control import ZmqControl


class Sockets:
    """The ZeroMQ context and every socket made in it. Apart from the transport so that
    nothing it hands out (the control plane's connect) refers back to the transport: a
    reference cycle would leave the context to the garbage collector, whose ``term`` then
    waits forever for sockets it can no longer see.

    A push to an ``ipc://`` address is watched until it has connected (``wait_connected``):
    the socket file's name may go only then, and the connection outlives it."""

    def __init__(self, io_threads: int) -> None:
        self.ctx = zmq.Context(io_threads=io_threads)
        self.made: list[zmq.Socket] = []
        self._connecting: list[tuple[zmq.Socket, zmq.Socket]] = []  # (ipc push, its monitor)

    def pull(self) -> zmq.Socket:
        pull = self.ctx.socket(zmq.PULL)
        self.made.append(pull)
        pull.setsockopt(zmq.RCVHWM, 0)
        pull.setsockopt(zmq.LINGER, 0)
        return pull

    def push(self, endpoint: str) -> zmq.Socket:
        push = self.ctx.socket(zmq.PUSH)
        self.made.append(push)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 2000)
        push.copy_threshold = 0  # track every copy=False frame
        if endpoint.startswith("ipc://"):  # watched from before the connect: see the class
            self._connecting.append((push, push.get_monitor_socket(zmq.EVENT_CONNECTED)))
        push.connect(endpoint)
        return push

    def wait_connected(self, deadline: float, rank: int) -> None:
        """Return once every ``ipc://`` push made so far is connected: its peer's socket
        file may then be removed. A CommError if one is not by ``deadline`` (monotonic)."""
        while self._connecting:
            push, monitor = self._connecting[0]
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not monitor.poll(left_ms):
                raise CommError("could not connect to "
                                f"{push.getsockopt_string(zmq.LAST_ENDPOINT)} in time (has "
                                "that rank died during the set-up?)", rank=rank)
            monitor.recv_multipart()  # the one event it watches: connected
            self._connecting.pop(0)
            self._unwatch(push, monitor)

    @staticmethod
    def _unwatch(push: zmq.Socket, monitor: zmq.Socket) -> None:
        with contextlib.suppress(zmq.ZMQError):
            push.disable_monitor()
        monitor.close(linger=0)

    def close(self, *, abandon: bool) -> None:
        """Close what is still open (each with its own linger) and end the context;
        ``abandon`` drops queued messages (a set-up that failed)."""
        for push, monitor in self._connecting:  # a set-up that failed before they connected
            self._unwatch(push, monitor)
        self._connecting.clear()
        for sock in self.made:
            if not sock.closed:
                sock.close()
        if abandon:
            self.ctx.destroy(linger=0)
        else:
            self.ctx.term()


@dataclass
class SetUp:
    """One rank's set-up of a group's links: who it is, where its peers are (``hosts``: each
    rank's host identity, equal where ranks share a machine), the address other hosts reach
    it at (``host``), the forced socket kind (``mode``: auto, ipc or tcp), and what the
    kinds share. ``store`` and ``prefix`` are for kinds that meet their peers there again
    once every pair has a link."""

    rank: int
    world_size: int
    hosts: list[str]
    host: str
    mode: str
    shm: bool
    spin_s: float
    timeout: float
    store: Any
    prefix: str
    sockets: Sockets
    control: ZmqControl
    flusher: Flusher = field(default_factory=Flusher)
    files: TransportFiles = field(default_factory=TransportFiles)
    token: str = field(default_factory=shm_ring.new_token)  # names our shared memory

    def same_host(self, peer: int) -> bool:
        return self.hosts[peer] == self.hosts[self.rank]

    def by_ipc(self, peer: int) -> bool:
        """Whether ZeroMQ reaches ``peer`` over ``ipc://`` (a socket file on this host)
        rather than ``tcp://``."""
        return self.mode == "ipc" or (self.mode == "auto" and self.same_host(peer))

    @property
    def peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    @property
    def ipc_dir(self) -> str:
        """This rank's folder of ipc sockets, pipes and doorbells: made on first use."""
        if self.files.ipc_dir is None:
            base = ipc_base()
            os.makedirs(base, exist_ok=True)
            self.files.ipc_dir = tempfile.mkdtemp(prefix=f"{shm_ring.owner_tag()}-", dir=base)
        return self.files.ipc_dir

    def key(self, what: str, rank: int) -> str:
        return f"{self.prefix}links/{what}/{rank}"


@dataclass(frozen=True)
class Verdict:
    """Whether a kind serves a pair, and why (for ``describe``)."""

    serves: bool
    reason: str


class LinkKind(abc.ABC):
    """One way of connecting pairs of ranks (see the module docstring)."""

    name = "kind"  # the record's key and what ``describe`` calls it
    moves = HOST_ONLY  # the memory its links move

    def __init__(self, setup: SetUp) -> None:
        self.setup = setup

    @abc.abstractmethod
    def offer(self) -> dict[str, Any] | None:
        """What this rank offers its peers in this kind; None offers nothing."""

    @abc.abstractmethod
    def verdict(self, peer: int, mine: dict[str, Any] | None,
                theirs: dict[str, Any] | None) -> Verdict:
        """Whether this kind can serve the pair (this rank, ``peer``), given both offers."""

    @abc.abstractmethod
    def connect(self, peer: int, mine: dict[str, Any], theirs: dict[str, Any]) -> Link:
        """The link to ``peer``, a pair this kind serves."""

    def connected(self, links: dict[int, Link]) -> None:  # noqa: B027 - optional hook
        """Every pair has a link (``links``: this kind's, by peer)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the kind holds apart from its links (what it made for pairs it did
        not get, say). Called once, at teardown or after a failed set-up, once the links
        are closed."""
