"""The transport of a real group: set-up through the store, one link per peer, teardown.

Why this shape:
- One ordered link per pair keeps each peer's messages in order and lets a rank wait for
  exactly the peer its schedule names, with no demultiplexing on the hot path.
- Which kind of link a pair gets is the registry's choice (``ringcomm.transport.kinds``):
  every rank publishes one record through the store, a versioned JSON object holding its
  control plane's addresses, each kind's offer and its board offer; then, for each peer,
  the first kind whose verdict serves the pair connects it. The reasons are kept:
  ``describe()`` says which kind each pair uses and why the kinds before it did not.
- One control socket per rank carries aborts and probes (``zmq_control``), so a failure
  on one rank wakes every rank that waits; it listens on ``ipc://`` for peers of its host
  and ``tcp://`` for others.
- A locked door: with a token every ZeroMQ tcp connection is CURVE (``auth``), and a peer
  that refuses this rank's token is an ``AuthError`` at set-up; ipc sockets and pipes are
  files of this user alone (``files``); where the ranks learn at rendezvous that they all
  share one host, tcp sockets listen on loopback only. What a peer's record names is
  checked before it is used (``peer_names``): only ringcomm's own forms, folders and FIFOs
  of this user's, or a ``RecordError`` naming the field.
- Where every rank of the group shares this host and offers shared memory, the group also
  gets a shared board (``board_setup``), a channel of its own beside the links (``board``).
- A rank that cannot make what its record would name (no free port in
  ``RINGCOMM_PORT_RANGE``, where every tcp socket it listens on binds; a folder or pipe it
  cannot make) publishes a record saying why instead, so that its peers raise at once
  rather than wait out the timeout for a record that never comes.

Nothing is left behind, even after a crash (``files``): once every pair is connected, the
names that set-up needed (pipes, doorbells, ipc sockets) are removed (``_settle``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from ..core import config
from ..errors import ArgumentError, AuthError, CommError
from . import auth
from .base import Transport
from .board_setup import BoardSetUp
from .files import bind_private, sweep_litter
from .kinds import KINDS, LinkKind, SetUp, Sockets
from .link import Link
from .local_link import LocalLink
from .peer_names import Check
from .socket_link import payload_bound
from .zmq_control import MAX_NOTICE_BYTES, ZmqControl

log = logging.getLogger("ringcomm")

LOOPBACK = "127.0.0.1"
RECORD_VERSION = 1  # of the record each rank publishes; bumped when its shape changes
_SHOWN_FAILURE = 600  # characters of a peer's failure shown (its record may be anyone's)


def spin_seconds() -> float:
    """How long a receive polls without sleeping before it blocks in ``poll``. Waking a
    process that sleeps costs tens of microseconds (more on a virtual machine, whose idle
    CPU halts); a message that arrives within the spin is taken at once. The spin yields the
    CPU on every turn, so ranks that share a core still run (``RINGCOMM_SPIN_US``)."""
    return float(config.value("spin_us")) / 1e6


@dataclass(frozen=True)
class PairChoice:
    """Which kind links this rank to a peer, why, and why each kind asked before it did not."""

    kind: str
    reason: str
    declined: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        text = f"{self.kind}: {self.reason}"
        if self.declined:
            text += " (" + "; ".join(f"not {k}: {why}" for k, why in self.declined) + ")"
        return text


class GroupTransport(Transport):
    """Links from ``rank`` to every other rank, set up through ``store``.

    ``store`` needs ``set``, ``get`` and ``wait`` (any ``ringcomm.bootstrap.store.Store``);
    keys are written under ``prefix``. ``hosts`` holds every rank's host identity (equal
    where ranks share pipes and shared memory); ``host`` is the address other hosts reach
    this one at; ``mode`` forces sockets of one kind (``RINGCOMM_TRANSPORT``), ``shm=False``
    offers no shared memory (``RINGCOMM_SHM``). ``auth_token`` (default
    ``RINGCOMM_AUTH_TOKEN``) makes every tcp link and the control plane authenticate and
    encrypt (``auth``); where every rank is on this host, sockets listen on loopback only.
    """

    control: ZmqControl  # its links watch this control socket while they wait

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        *,
        hosts: Sequence[str],
        prefix: str = "",
        host: str = "127.0.0.1",
        mode: str | None = None,
        timeout: float = 300.0,
        io_threads: int = 1,
        shm: bool | None = None,
        auth_token: str | None = None,
        segment_bytes: int = 0,
    ) -> None:
        if len(hosts) != world_size:
            raise ArgumentError(f"{len(hosts)} host identities for a world of {world_size}")
        mode = config.transport_mode(mode)
        self.mode = mode
        shm = bool(config.value("shm")) if shm is None else shm
        spin_s = spin_seconds()  # settings first: a bad one must not strand a ZeroMQ context
        port_range = config.value("port_range")
        if auth_token is None:
            auth_token = config.value("auth_token")
        keys = auth.keys_for(auth_token)
        if len(set(hosts)) == 1:  # every rank on this host: nobody elsewhere need reach us
            host = LOOPBACK
        self._sockets = Sockets(io_threads, keys, rank)
        control_socket = self._sockets.pull(secure=True)
        control_socket.setsockopt(zmq.MAXMSGSIZE, MAX_NOTICE_BYTES + auth.FRAME_OVERHEAD)
        control = ZmqControl(rank, control_socket, {},
                             functools.partial(self._sockets.push, secure=True))
        super().__init__(rank, world_size, [None] * world_size, control)
        self.setup = SetUp(rank, world_size, list(hosts), host, mode, shm, spin_s, timeout,
                           store, prefix, self._sockets, control, segment_bytes=segment_bytes,
                           port_range=port_range)
        # the largest segment its links admit (a communicator's may not grow past it)
        self.max_segment_bytes = payload_bound(segment_bytes)
        self.spin_s = self.setup.spin_s
        self._remove_files = weakref.finalize(self, self.setup.files.remove)
        self._abandon = False  # set-up failed: close without waiting for any socket
        self.kinds: list[LinkKind] = []
        self.choices: dict[int, PairChoice] = {}  # peer -> how it is linked, and why
        self._board_setup = BoardSetUp(self.setup)
        sweep_litter()
        try:
            self._connect()
        except BaseException:
            # a socket half set up (one that failed to bind) is in no list that close()
            # walks, and would keep the context's term() waiting forever: destroy it
            self._abandon = True
            self.close()
            raise

    @property
    def ipc_dir(self) -> str | None:
        """This transport's folder of ipc sockets and pipes (None without local peers)."""
        return self.setup.files.ipc_dir

    # ------------------------------------------------------------------ set-up
    def _connect(self) -> None:
        setup, n, me = self.setup, self.world_size, self.rank
        if n == 1:
            return
        self.kinds = [kind(setup) for kind in KINDS]
        try:
            offers = {kind.name: kind.offer() for kind in self.kinds}
            record: dict[str, Any] = {
                "record": RECORD_VERSION, "control": self._bind_control(), "kinds": offers,
                "board": self._board_setup.offer(offers.get("local"))}
        except Exception as err:
            # the peers wait for this rank's record: a record saying why there is none
            # lets them raise at once (``_read``) instead of waiting out the timeout
            failed = {"record": RECORD_VERSION, "failed": str(getattr(err, "detail", err)),
                      "error": type(err).__name__}
            with contextlib.suppress(Exception):
                setup.store.set(setup.key("record", me), json.dumps(failed).encode())
            raise
        setup.store.set(setup.key("record", me), json.dumps(record).encode())
        keys = [setup.key("record", r) for r in range(n)]
        setup.store.wait(keys, setup.timeout)
        records: list[dict[str, Any]] = [
            record if r == me else self._read(r, setup.store.get(keys[r])) for r in range(n)]

        links: list[Link | None] = [None] * n
        by_kind: dict[str, dict[int, Link]] = {kind.name: {} for kind in self.kinds}
        for peer in setup.peers:
            theirs = records[peer]
            control = theirs["control"]  # ipc for peers on its host, tcp for others
            endpoint = next(
                (e for e in control if e.startswith("ipc") == setup.by_ipc(peer)), control[-1])
            Check(me, peer).endpoint_on_disk("control", endpoint)  # connected when needed
            self.control.endpoints[peer] = endpoint
            declined: list[tuple[str, str]] = []
            for kind in self.kinds:
                mine, their_offer = offers[kind.name], theirs["kinds"].get(kind.name)
                verdict = kind.verdict(peer, mine, their_offer)
                if verdict.serves:
                    assert mine is not None and their_offer is not None
                    links[peer] = by_kind[kind.name][peer] = kind.connect(
                        peer, mine, their_offer)
                    self.choices[peer] = PairChoice(kind.name, verdict.reason, tuple(declined))
                    break
                declined.append((kind.name, verdict.reason))
            else:
                raise CommError("no kind of link can connect this pair: " + "; ".join(
                    f"{k}: {why}" for k, why in declined), rank=me, peer=peer)
        self.links = links
        # a peer that refuses this rank's token (or lack of one) says so within a round trip
        try:
            self._sockets.check_handshakes(time.monotonic() + setup.timeout,
                                           self._refused_by)
        except AuthError as err:  # tell the peers that may never get to shake hands
            with contextlib.suppress(Exception):
                setup.store.set(setup.key("refused", me), err.detail.encode())
            raise
        for kind in self.kinds:
            kind.connected(by_kind[kind.name])
        local = [link for link in by_kind.get("local", {}).values()
                 if isinstance(link, LocalLink)]
        self.board = self._board_setup.connect(records, self, local)
        # the peers' control sockets over tcp too, now: an abort sent at once on a
        # connection already made arrives before a peer that enters the failed op later
        # completes it (``Transport.check_aborted``)
        self.control.connect([p for p in setup.peers
                              if not self.control.endpoints[p].startswith("ipc")])
        self._settle()

    def _settle(self) -> None:
        """Remove this rank's folder once every peer of its host has opened what is in it
        (pipes, doorbells, ipc sockets: a pipe's or a doorbell's open ends, like a connected
        ipc socket, work on without their names), so that a rank that dies from here on,
        even by SIGKILL or ``os._exit``, leaves nothing behind. Peers that reach this rank
        by ipc (every one on its host but with ``RINGCOMM_TRANSPORT=tcp``) are exactly those
        that open its files; each says in the store when its connections are made."""
        setup = self.setup
        users = [peer for peer in setup.peers if setup.by_ipc(peer)]
        if not users:
            return
        self.control.connect([p for p in users if self.control.endpoints[p].startswith("ipc")])
        self._sockets.check_handshakes(time.monotonic() + setup.timeout, self._refused_by)
        setup.store.set(setup.key("settled", setup.rank), b"1")
        setup.store.wait([setup.key("settled", peer) for peer in users], setup.timeout)
        setup.files.settled()

    def _refused_by(self, peers: list[int]) -> None:
        """Raise ``AuthError`` if one of ``peers`` gave up on this group's handshakes (its
        token differs): it may have left before this rank's handshake with it could fail."""
        setup = self.setup
        for peer in peers:
            key = setup.key("refused", peer)
            if setup.store.check([key]):
                why = setup.store.get(key).decode(errors="replace")
                raise AuthError(f"rank {peer} left the set-up after a failed handshake (its "
                                f"error: {why})", rank=self.rank, peer=peer)

    def _bind_control(self) -> list[str]:
        """Bind the control socket where peers can reach it: ``ipc://`` where some peer
        shares this host by ipc, ``tcp://`` where some peer does not."""
        setup, sock = self.setup, self.control.socket
        endpoints = []
        if any(setup.by_ipc(p) for p in setup.peers):
            endpoints.append(f"ipc://{setup.ipc_dir}/{setup.rank}")
            bind_private(sock, endpoints[-1])
        if not endpoints or not all(setup.by_ipc(p) for p in setup.peers):
            endpoints.append(setup.bind_tcp(sock))  # in RINGCOMM_PORT_RANGE where it is set
        return endpoints

    def _read(self, peer: int, raw: bytes) -> dict[str, Any]:
        """``peer``'s record, checked for a shape this rank can read, then for names of the
        forms ringcomm makes only (``peer_names``: a ``RecordError`` otherwise, before any
        of them is opened)."""
        try:
            record: dict[str, Any] = json.loads(raw)
            version = record["record"]
        except (ValueError, KeyError, TypeError):
            version = None
        if version != RECORD_VERSION:
            raise CommError(f"rank {peer} published a link record this rank cannot read "
                            f"(version {version}, this rank's {RECORD_VERSION}); is every "
                            "rank running the same ringcomm version?", rank=self.rank,
                            peer=peer)
        failed = record.get("failed")
        if failed is not None:  # it could not make what its record would name
            why = "".join(c if c.isprintable() else "?" for c in str(failed)[:_SHOWN_FAILURE])
            error = ArgumentError if record.get("error") == "ArgumentError" else CommError
            raise error(f"rank {peer} could not set up its links: {why}", rank=self.rank,
                        peer=peer)
        check = Check(self.rank, peer)
        check.endpoints("control", record.get("control"))
        offers = check.mapping("kinds", record.get("kinds"))
        for kind in self.kinds:
            offer = offers.get(kind.name)
            if offer is not None:
                kind.check_offer(check, check.mapping(f"kinds.{kind.name}", offer))
        board = record.get("board")
        if board is not None:
            self._board_setup.check_offer(check, check.mapping("board", board),
                                          offers.get("local"))
        return record

    # ------------------------------------------------------------------ for people
    def listening(self) -> list[str]:
        """The addresses this rank's sockets listen on (its receiving links and its control
        socket): what anyone who can reach this host could try to connect to."""
        return self._sockets.listening()

    def describe(self) -> str:
        """One line per peer: the kind of link, how it reaches the peer, and why."""
        lines = []
        for peer, link in enumerate(self.links):
            if link is None:
                continue
            choice = self.choices.get(peer)
            why = f" [{choice.describe()}]" if choice is not None else ""
            lines.append(f"rank {self.rank} -> rank {peer}: {link.describe()}{why}")
        return "\n".join(lines) or f"rank {self.rank}: no peers"

    # ------------------------------------------------------------------ teardown
    def _close(self) -> None:
        setup = self.setup
        try:
            if self.board is not None:
                self.board.close()
            links = [link for link in self.links if link is not None]
            for link in links:  # queued frames first: live peers may still read them
                link.finish_sending()
            setup.flusher.stop()
            for link in links:
                link.close()
            for kind in self.kinds:
                kind.close()
            self._board_setup.close()
            self.control.close()  # its push sockets linger a little: aborts must get out
            self._sockets.close(abandon=self._abandon)
        finally:
            self._remove_files()  # also if closing failed part-way; runs once
