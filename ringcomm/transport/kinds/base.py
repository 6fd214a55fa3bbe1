"""What a link kind is, and what every kind of one transport's set-up shares.

A *link kind* is one way of connecting a pair of ranks (pipes and shared memory, ZeroMQ
sockets, and later device links). Each is one module with one class that answers three
questions, in this order, during a group's set-up through the store:

1. ``offer``: what this rank offers to its peers in this kind (a JSON-able record: names,
   addresses, sizes), made before any rank has seen another's; None offers nothing. The
   kind may make what the offer names (bind a socket, create a pipe) here. A peer's offer
   comes through the store, where a stranger may have written it: ``check_offer`` checks
   its form as soon as it is read (``ringcomm.transport.peer_names``), and ``connect``
   checks what it names on disk before opening it.
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
import errno
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ...core.arrays import HOST_ONLY
from ...errors import ArgumentError, AuthError, CommTimeout
from .. import auth, shm_ring
from ..files import TransportFiles, ipc_base, private_folder
from ..link import Link
from ..peer_names import Check
from ..pipe import Flusher
from ..zmq_control import ZmqControl

_ASK_EVERY_S = 0.1


class Sockets:
    """The ZeroMQ context and every socket made in it. Apart from the transport so that
    nothing it hands out (the control plane's connect) refers back to the transport: a
    reference cycle would leave the context to the garbage collector, whose ``term`` then
    waits forever for sockets it can no longer see.

    With ``keys`` (``RINGCOMM_AUTH_TOKEN``), a socket made ``secure`` speaks CURVE: a pull
    socket is a server that only the token's clients may reach (the context's ``Gatekeeper``
    checks them), a push socket a client holding the token's keys. A push socket made for a
    ``peer`` (its link, or its control socket) reports its handshake, so that
    ``check_handshakes`` can tell at set-up that the peer refused this rank, and that an
    ``ipc://`` socket file's name may go (the connection outlives it)."""

    def __init__(self, io_threads: int, keys: auth.Keys | None = None, rank: int = 0) -> None:
        self.ctx = zmq.Context(io_threads=io_threads)
        self.keys = keys
        self.rank = rank
        self.made: list[zmq.Socket] = []
        self.watched: list[tuple[zmq.Socket, zmq.Socket, int]] = []  # push, monitor, peer
        self._gatekeeper: auth.Gatekeeper | None = None

    def pull(self, secure: bool = False) -> zmq.Socket:
        pull = self.ctx.socket(zmq.PULL)
        self.made.append(pull)
        pull.setsockopt(zmq.RCVHWM, 0)
        pull.setsockopt(zmq.LINGER, 0)
        if secure and self.keys is not None:
            if self._gatekeeper is None:
                self._gatekeeper = auth.Gatekeeper(self.ctx, self.keys, f"rank {self.rank}")
            self.keys.serve(pull)
        return pull

    def push(self, endpoint: str, secure: bool = False, peer: int | None = None) -> zmq.Socket:
        push = self.ctx.socket(zmq.PUSH)
        self.made.append(push)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 2000)
        push.copy_threshold = 0  # track every copy=False frame
        if secure and self.keys is not None:
            self.keys.dial(push)
        if peer is not None:  # watched: a link or control push to ``peer``
            self.watched.append((push, push.get_monitor_socket(auth.HANDSHAKE_EVENTS), peer))
        push.connect(endpoint)
        return push

    def listening(self) -> list[str]:
        """The endpoints the pull sockets listen on."""
        return [sock.getsockopt_string(zmq.LAST_ENDPOINT) for sock in self.made
                if not sock.closed and sock.type == zmq.PULL]

    def check_handshakes(self, deadline: float,
                         ask: Callable[[list[int]], None] | None = None) -> None:
        """Wait until every watched push socket has finished its handshake. A refused one is
        an ``AuthError`` naming whom it was to reach and why, within a round trip; one still
        unfinished at ``deadline`` is a ``CommTimeout``. While some are unfinished, ``ask``
        is called every ``_ASK_EVERY_S`` with their peers (a peer that refused this rank's
        token and left at once never finishes its handshake: ``ask`` may find out why
        elsewhere, and raise). The monitors go once done."""
        pending = {monitor: peer for _, monitor, peer in self.watched}
        poller = zmq.Poller()
        for monitor in pending:
            poller.register(monitor, zmq.POLLIN)
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    peers = ", ".join(map(str, pending.values()))
                    raise CommTimeout(f"no handshake with rank(s) {peers} within the timeout "
                                      "(alive and reachable?)", rank=self.rank)
                ready = dict(poller.poll(int(min(left, _ASK_EVERY_S) * 1000) + 1))
                if not ready and ask is not None:
                    ask(list(pending.values()))
                for monitor in ready:
                    event = parse_monitor_message(monitor.recv_multipart())
                    why = auth.handshake_failure(event["event"], event["value"])
                    peer = pending[monitor]
                    if why is not None:
                        mine = "holds a token" if self.keys is not None else "holds no token"
                        raise AuthError(
                            f"rank {peer} refused this rank's connection: {why}. Every rank "
                            "must hold the same RINGCOMM_AUTH_TOKEN (or init(auth_token=)); "
                            f"this rank {mine}", rank=self.rank, peer=peer)
                    if event["event"] == auth.HANDSHAKE_SUCCEEDED:
                        poller.unregister(monitor)
                        del pending[monitor]
        finally:
            self._unwatch()

    def _unwatch(self) -> None:
        for push, monitor, _ in self.watched:
            with contextlib.suppress(zmq.ZMQError):
                push.disable_monitor()
            monitor.close(linger=0)
        self.watched.clear()

    def close(self, *, abandon: bool) -> None:
        """Close what is still open (each with its own linger) and end the context;
        ``abandon`` drops queued messages (a set-up that failed)."""
        self._unwatch()
        for sock in self.made:
            if not sock.closed:
                sock.close()
        if self._gatekeeper is not None:
            self._gatekeeper.close()
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
    segment_bytes: int = 0  # agreed at init; a socket admits frames of a segment at most
    port_range: tuple[int, int] | None = None  # RINGCOMM_PORT_RANGE: where tcp sockets listen

    def same_host(self, peer: int) -> bool:
        return self.hosts[peer] == self.hosts[self.rank]

    def by_ipc(self, peer: int, rank: int | None = None) -> bool:
        """Whether ZeroMQ reaches ``peer`` over ``ipc://`` (a socket file on this host)
        rather than ``tcp://`` from this rank (or from ``rank``)."""
        rank = self.rank if rank is None else rank
        return self.mode == "ipc" or (self.mode == "auto" and
                                      self.hosts[peer] == self.hosts[rank])

    def tcp_ports(self, rank: int | None = None) -> int:
        """How many tcp ports this rank (or ``rank``) listens on: one receiving socket per
        peer it reaches over tcp, and its control socket where it has such a peer."""
        rank = self.rank if rank is None else rank
        links = sum(not self.by_ipc(p, rank) for p in range(self.world_size) if p != rank)
        return links + 1 if links else 0

    def bind_tcp(self, sock: zmq.Socket) -> str:
        """Bind ``sock`` to a tcp port of this rank's address, and say where: a port the
        system picks, or one of ``port_range`` (``RINGCOMM_PORT_RANGE``), each tried once at
        most, from a random one on (ranks of one host that share the range then rarely try
        the same port first). No port of the range free is an ``ArgumentError`` naming the
        range and how many ports the ranks need."""
        if self.port_range is None:
            port = sock.bind_to_random_port(f"tcp://{self.host}")
            return f"tcp://{self.host}:{port}"
        low, high = self.port_range
        span = high - low + 1
        first = random.randrange(span)
        for i in range(span):
            endpoint = f"tcp://{self.host}:{low + (first + i) % span}"
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as err:
                if err.errno in (zmq.EADDRINUSE, errno.EACCES):  # taken, or privileged
                    continue
                raise
            return endpoint
        raise ArgumentError(self._ports_short(), rank=self.rank)

    def _ports_short(self) -> str:
        low, high = self.port_range or (0, 0)
        need = self.tcp_ports()
        links = need - 1
        text = (f"no free tcp port left in RINGCOMM_PORT_RANGE={low}-{high} "
                f"({high - low + 1} port{'s' if high > low else ''}) on {self.host}: rank "
                f"{self.rank} of this group listens on {need} ({links} link"
                f"{'s' if links != 1 else ''} to the peers it reaches over tcp, world size - 1 "
                "under RINGCOMM_TRANSPORT=tcp, and 1 control socket)")
        local = [r for r in range(self.world_size) if self.hosts[r] == self.hosts[self.rank]]
        if len(local) > 1:
            text += (f", and the {len(local)} ranks of this host listen on "
                     f"{sum(self.tcp_ports(r) for r in local)} in all where they share the "
                     "range")
        return (text + ", besides the ports of any other group it is in (comm.split makes one "
                "of its own). Widen the range (ports that other programs hold, and ports below "
                "1024 without the privilege, are not free), or unset it")

    @property
    def peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    @property
    def ipc_dir(self) -> str:
        """This rank's folder of ipc sockets, pipes and doorbells: made on first use."""
        if self.files.ipc_dir is None:
            base = private_folder(ipc_base())
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
    def check_offer(self, check: Check, offer: dict[str, Any]) -> None:
        """Check a peer's offer, as read from the store, against the forms this kind makes
        (its fields are ``kinds.<name>.<field>``); raise ``check.refuse(...)`` otherwise."""

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
