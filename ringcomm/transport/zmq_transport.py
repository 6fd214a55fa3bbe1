"""The transport of a real group: set-up through the store, one link per peer, teardown.

Why this shape:
- One ordered link per pair keeps each peer's messages in order and lets a rank wait for
  exactly the peer its schedule names, with no demultiplexing on the hot path.
- Ranks that report the same host get a ``LocalLink`` (named pipes + a shared-memory ring);
  others a ``SocketLink`` (ZeroMQ over ``tcp://``). ``RINGCOMM_TRANSPORT`` (``ipc``,
  ``tcp``, ``auto``) forces sockets of one kind; ``RINGCOMM_SHM=0`` turns pipes and shared
  memory off (then local pairs use ``ipc://`` sockets). Shared memory is used only where
  both ranks offer it.
- One control socket per rank carries aborts and probes (``zmq_control``), so a failure
  on one rank wakes every rank that waits.
- Where every rank of the group shares this host and offers shared memory, the group also
  gets a shared ``board`` for small collectives (``RINGCOMM_BOARD=0`` declines it): made by
  rank 0, mapped by the others, used only if every rank has it. Each rank then also has a
  doorbell (a FIFO) that a rank posting on the board rings if it sleeps.

Set-up goes through the store: knowing from the caller which ranks share its host (the
host identities gathered at init), every rank binds one receiving socket per peer and a
control socket, and publishes the addresses (and its shared-memory offer). Nothing is left
behind, even after a crash (``files``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import weakref
from collections.abc import Sequence
from typing import Any

import zmq

from ..core import config
from ..errors import ArgumentError, CommError, CommTimeout, PeerLostError
from . import board, mailbox, shm_ring
from .base import Transport, board_wait
from .files import TransportFiles, ipc_base, sweep_litter
from .link import Link, Wait
from .local_link import LocalLink
from .pipe import Doorbell, Flusher, PipeReader, open_doorbell, ring
from .socket_link import SocketLink
from .zmq_control import STALL_PROBE_S, ZmqControl

log = logging.getLogger("ringcomm")

_WATCH_EVERY = 16  # a board wait that spins looks at the links and control plane this often
_DOZE_MS = 20  # the longest a board wait sleeps between looks at the board


def spin_seconds() -> float:
    """How long a receive polls without sleeping before it blocks in ``poll``. Waking a
    process that sleeps costs tens of microseconds (more on a virtual machine, whose idle
    CPU halts); a message that arrives within the spin is taken at once. The spin yields the
    CPU on every turn, so ranks that share a core still run (``RINGCOMM_SPIN_US``)."""
    return float(config.value("spin_us")) / 1e6


def shm_ring_bytes(local_peers: int) -> int:
    """Capacity of each shared-memory ring: room for many segments, less per ring when a
    rank has many local peers (``RINGCOMM_SHM_BYTES`` sets it)."""
    forced: int | None = config.value("shm_bytes")
    if forced:
        return forced
    return max(8 << 20, min(32 << 20, (256 << 20) // max(1, local_peers)))


class _Sockets:
    """The ZeroMQ context and every socket made in it. Apart from the transport so that
    nothing it hands out (the control plane's connect) refers back to the transport: a
    reference cycle would leave the context to the garbage collector, whose ``term`` then
    waits forever for sockets it can no longer see."""

    def __init__(self, io_threads: int) -> None:
        self.ctx = zmq.Context(io_threads=io_threads)
        self.made: list[zmq.Socket] = []

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
        push.connect(endpoint)
        return push

    def close(self, *, abandon: bool) -> None:
        """Close what is still open (each with its own linger) and end the context;
        ``abandon`` drops queued messages (a set-up that failed)."""
        for sock in self.made:
            if not sock.closed:
                sock.close()
        if abandon:
            self.ctx.destroy(linger=0)
        else:
            self.ctx.term()


class ZmqTransport(Transport):
    """Links from ``rank`` to every other rank, set up through ``store``.

    ``store`` needs ``set``, ``get`` and ``wait`` (any ``ringcomm.bootstrap.store.Store``);
    keys are written under ``prefix``. ``hosts`` holds every rank's host identity (equal
    where ranks share pipes and shared memory); ``host`` is the address other hosts reach
    this one at.
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
    ) -> None:
        if len(hosts) != world_size:
            raise ArgumentError(f"{len(hosts)} host identities for a world of {world_size}")
        mode = (mode or config.value("transport")).lower()
        if mode not in ("auto", "ipc", "tcp"):
            raise ArgumentError(f"transport {mode!r} is unknown; use auto, ipc or tcp")
        self.mode = mode
        if shm is None:
            shm = bool(config.value("shm"))
        self.shm = shm and shm_ring.available()
        self.spin_s = spin_seconds()
        self._sockets = _Sockets(io_threads)
        self._flusher = Flusher()
        self._files = TransportFiles()
        self._remove_files = weakref.finalize(self, self._files.remove)
        self._abandon = False  # set-up failed: close without waiting for any socket
        self._monitors: list[tuple[zmq.Socket, zmq.Socket]] = []  # (socket, its monitor)
        self._unused_pipes: dict[int, PipeReader] = {}  # made for peers, no link yet
        self._board_poller = zmq.Poller()  # what a board wait watches (``_watch_poller``)
        self._pipe_peer: dict[int, int] = {}  # a pipe's file descriptor -> the peer at its end
        self._bell: Doorbell | None = None  # ours, rung by a peer that posts while we sleep
        self._bells: dict[int, int] = {}  # peer -> its doorbell, open for writing
        control = ZmqControl(rank, self._sockets.pull(), {}, self._sockets.push)
        super().__init__(rank, world_size, [None] * world_size, control)
        sweep_litter()
        try:
            self._connect(store, prefix, host, timeout, list(hosts))
        except BaseException:
            # a socket half set up (one that failed to bind) is in no list that close()
            # walks, and would keep the context's term() waiting forever: destroy it
            self._abandon = True
            self.close()
            raise

    @property
    def ipc_dir(self) -> str | None:
        """This transport's folder of ipc sockets and pipes (None without local peers)."""
        return self._files.ipc_dir

    # ------------------------------------------------------------------ set-up
    def _key(self, prefix: str, what: str, rank: int) -> str:
        return f"{prefix}zmq/{what}/{rank}"

    def _connect(self, store: Any, prefix: str, host: str, timeout: float,
                 hosts: list[str]) -> None:
        n, me = self.world_size, self.rank
        if n == 1:
            return
        use_ipc = [self.mode == "ipc" or (self.mode == "auto" and hosts[r] == hosts[me])
                   for r in range(n)]
        ipc_dir = None
        if any(use_ipc[r] for r in range(n) if r != me):
            base = ipc_base()
            os.makedirs(base, exist_ok=True)
            ipc_dir = self._files.ipc_dir = tempfile.mkdtemp(
                prefix=f"{shm_ring.owner_tag()}-", dir=base)

        # One receiving socket per peer, and the control socket at index `me`.
        pulls: list[zmq.Socket] = []
        monitors: dict[int, zmq.Socket] = {}
        endpoints: list[str] = []
        for peer in range(n):
            pull = self.control.socket if peer == me else self._sockets.pull()
            if (peer != me and use_ipc[peer]) or (peer == me and ipc_dir):
                endpoint = f"ipc://{ipc_dir}/{peer}"
                pull.bind(endpoint)
            else:
                port = pull.bind_to_random_port(f"tcp://{host}")
                endpoint = f"tcp://{host}:{port}"
            if peer != me:
                monitors[peer] = pull.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self._monitors.append((pull, monitors[peer]))
            pulls.append(pull)
            endpoints.append(endpoint)
        # A control socket bound to ipc is useless to peers on other hosts: bind tcp too.
        if ipc_dir and not all(use_ipc):
            port = self.control.socket.bind_to_random_port(f"tcp://{host}")
            endpoints[me] += f" tcp://{host}:{port}"
        # Shared memory with peers on this host that use ipc: offered by both sides or not used.
        local = [r for r in range(n) if r != me and use_ipc[r] and hosts[r] == hosts[me]]
        capacity = shm_ring_bytes(len(local)) if self.shm and local else 0
        token = shm_ring.new_token()  # names this transport's rings; carries our pid
        pipes_in = self._unused_pipes
        if capacity:  # a pipe from each local peer, used if it offers shared memory too
            pipes_in.update({r: PipeReader(f"{ipc_dir}/pipe-from-{r}") for r in local})
        endpoints.append(f"shm {token if capacity else '-'} {capacity}")
        # The board: offered where every peer is local with shared memory; rank 0 makes it
        # and publishes its name, and it is used if every rank offers and maps it.
        offer = bool(capacity) and len(local) == n - 1 and board.wanted()
        if offer:
            assert ipc_dir is not None  # there are local peers
            self._bell = Doorbell(f"{ipc_dir}/board-bell")
        board_name, board_memory = "-", None
        if offer and me == 0:
            board_name = f"ringcomm-{token}-board"
            path = os.path.join(shm_ring.SHM_DIR, board_name)
            try:
                board_memory = shm_ring.map_shared(path, board.size(n), create=True)
                self._files.shm_paths.append(path)
            except OSError as err:
                log.warning("rank 0: no shared board (%s); collectives use the links",
                            err)
                board_name = "-"
        endpoints.append(f"board {board_name if me == 0 else ('yes' if offer else '-')}")
        store.set(self._key(prefix, "ep", me), "\n".join(endpoints).encode())

        ep_keys = [self._key(prefix, "ep", r) for r in range(n)]
        store.wait(ep_keys, timeout)
        links: list[Link | None] = [None] * n
        offers = [offer] * n
        peer_dirs: dict[int, str] = {}
        for peer in range(n):
            if peer == me:
                continue
            theirs = store.get(ep_keys[peer]).decode().split("\n")
            offers[peer] = theirs[n + 1] != "board -"
            if peer == 0 and offers[0]:
                board_name = theirs[n + 1].split(" ", 1)[1]
            control = theirs[peer].split(" ")
            # our messages to `peer` go to the socket it bound for us; aborts to its control
            self.control.endpoints[peer] = next(
                (e for e in control if e.startswith("ipc") == use_ipc[peer]), control[-1])
            _, their_token, their_capacity = theirs[n].split(" ")
            if their_token != "-" and not shm_ring.valid_token(their_token):
                raise CommError(f"rank {peer} offers shared memory under a malformed name "
                                f"({their_token!r}); is it running another ringcomm version?",
                                rank=me, peer=peer)
            if peer in pipes_in and their_token != "-":
                ring_out = shm_ring.ring_name(token, me, peer)
                ring_in = shm_ring.ring_name(their_token, peer, me)
                # an end that wants them makes its incoming mailbox (RINGCOMM_MAILBOX); the
                # sender maps it, where there is one, and removes its name
                mailbox_in = mailbox.mailbox_name(shm_ring.ring_name(token, peer, me))
                mailbox_out = mailbox.mailbox_name(shm_ring.ring_name(their_token, me, peer))
                # ours until the reader maps it; theirs is not needed once we stop reading
                self._files.shm_paths += [os.path.join(shm_ring.SHM_DIR, name)
                                          for name in (ring_out, ring_in, mailbox_in)]
                their_dir = peer_dirs[peer] = theirs[me][len("ipc://"):].rsplit("/", 1)[0]
                links[peer] = LocalLink(
                    me, peer, self.control, self.spin_s, pipe_in=pipes_in.pop(peer),
                    pipe_out_path=f"{their_dir}/pipe-from-{me}", flusher=self._flusher,
                    ring_out=ring_out, ring_in=ring_in, capacity=capacity,
                    capacity_in=int(their_capacity),
                    mailbox_in=mailbox_in if mailbox.wanted() else None,
                    mailbox_out=mailbox_out if mailbox.supported() else None)
            else:
                if peer in pipes_in:  # the peer has no shared memory: sockets only
                    pipes_in.pop(peer).close()
                links[peer] = SocketLink(me, peer, self.control, self.spin_s,
                                         push=self._sockets.push(theirs[me]), pull=pulls[peer],
                                         monitor=monitors[peer])
        self.links = links
        if all(offers) and me != 0:
            try:
                board_memory = shm_ring.map_shared(
                    os.path.join(shm_ring.SHM_DIR, board_name), board.size(n), create=False)
            except (OSError, ValueError) as err:
                log.warning("rank %d: cannot map the shared board (%s); collectives use "
                            "the links", me, err)
        local_links = [link for link in links if isinstance(link, LocalLink)]
        if local_links:  # a pipe's reader sees end-of-file until its writer has opened it
            mapped = b"open board" if board_memory is not None else b"open"
            store.set(self._key(prefix, "pipes", me), mapped)
            pipe_keys = [self._key(prefix, "pipes", link.peer) for link in local_links]
            store.wait(pipe_keys, timeout)
            for link in local_links:
                link.opened()
            if board_memory is not None:
                if all(store.get(key) == b"open board" for key in pipe_keys):
                    self._bells = {peer: open_doorbell(f"{where}/board-bell")
                                   for peer, where in peer_dirs.items()}
                    self.board = board.Board(board_memory, me, n)
                    self._board_poller = self._watch_poller(local_links)
                if me == 0:  # every rank has mapped it, or will not: the name goes
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(shm_ring.SHM_DIR, board_name))
            if self.board is None and self._bell is not None:
                self._bell.close()
                self._bell = None

    # ------------------------------------------------------------------ the board
    def _watch_poller(self, links: list[LocalLink]) -> zmq.Poller:
        """What a board wait watches: the control plane and every peer's pipe (whose data,
        or end-of-file, the wait then looks at)."""
        poller = zmq.Poller()
        poller.register(self.control.socket, zmq.POLLIN)
        assert self._bell is not None  # a rank with a board has a doorbell
        poller.register(self._bell.fd, zmq.POLLIN)
        for link in links:
            poller.register(link.pipe_in.fd, zmq.POLLIN)
            self._pipe_peer[link.pipe_in.fd] = link.peer
        return poller

    def _board_wait(self, peer: int, number: int, op: str, deadline: float,
                    header: bytes) -> None:
        """Spin (yielding the CPU on every turn) for ``spin_s``, then sleep in ``poll`` until
        a poster rings this rank's doorbell; look at the links and the control plane every
        few turns meanwhile, and ask the peer which op it is in after ``STALL_PROBE_S``."""
        posted, control = self.board.posted, self.control  # type: ignore[union-attr]
        for _ in range(_WATCH_EVERY if self.spin_s else 0):  # the commonest wait: a moment
            os.sched_yield()
            if posted(peer) >= number:
                return
        wait = board_wait(op, deadline, header, peer)
        started = time.monotonic()
        spin_until, probe_at = started + self.spin_s, started + STALL_PROBE_S
        turn = 0
        while posted(peer) < number:
            turn += 1
            now = time.monotonic()
            if turn % _WATCH_EVERY == 0 or now >= spin_until:
                if now >= wait.deadline:
                    raise CommTimeout(f"rank {peer} did not post its part of this op on the "
                                      "shared board within the timeout (is it running this "
                                      "op?)", rank=self.rank, op=wait.op, peer=peer)
                if probe_at and now >= probe_at:
                    probe_at = 0.0
                    assert wait.expected is not None  # a board wait knows the op's header
                    control.probe(peer, wait.expected._replace(sender=self.rank), wait.op)
            if now < spin_until:
                if turn % _WATCH_EVERY == 0:
                    events = self._board_poller.poll(0)
                    if events and self._watch(events, wait, peer, number):
                        return
                os.sched_yield()
                continue
            self.board.doze(True)  # type: ignore[union-attr]
            try:
                if posted(peer) >= number:
                    return
                sleep_s = min(wait.deadline, probe_at or wait.deadline) - now
                events = self._board_poller.poll(min(_DOZE_MS, max(1, int(sleep_s * 1000))))
            finally:
                self.board.doze(False)  # type: ignore[union-attr]
            if self._watch(events, wait, peer, number):
                return

    def _watch(self, events: list[tuple[Any, int]], wait: Wait, peer: int,
               number: int) -> bool:
        """Handle what ``poll`` reported during a wait for ``peer``'s post ``number``:
        notices on the control plane, and whatever a peer's pipe holds (``_screen``).
        Returns True if the post has come meanwhile (then nothing else matters: a peer that
        has posted and gone on may have closed its pipes already)."""
        board_, bell = self.board, self._bell
        assert board_ is not None and bell is not None
        control = self.control.socket
        for what, _ in events:
            if board_.posted(peer) >= number:
                return True
            if what is control:
                self.control.handle(wait)
                continue
            if what == bell.fd:
                if not bell.drain():  # every peer has closed: the pipes say why
                    self._board_poller.unregister(bell.fd)
                continue
            try:
                self._screen(self._pipe_peer[what], wait)
            except PeerLostError:
                if board_.posted(peer) >= number:
                    return True
                raise
        return board_.posted(peer) >= number

    def _posted(self) -> None:
        board_ = self.board
        assert board_ is not None
        shm_ring.fence()  # the count is stored before any flag is read
        for peer, bell in self._bells.items():
            if board_.sleeping(peer):
                ring(bell)

    # ------------------------------------------------------------------ teardown
    def _close(self) -> None:
        try:
            if self.board is not None:
                self.board.close()
            links = [link for link in self.links if link is not None]
            for link in links:  # queued frames first: live peers may still read them
                link.finish_sending()
            self._flusher.stop()
            for link in links:
                link.close()
            for pipe in self._unused_pipes.values():
                pipe.close()
            for fd in self._bells.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            if self._bell is not None:
                self._bell.close()
            for pull, monitor in self._monitors:
                with contextlib.suppress(zmq.ZMQError):
                    pull.disable_monitor()
                monitor.close(linger=0)
            self.control.close()  # its push sockets linger a little: aborts must get out
            self._sockets.close(abandon=self._abandon)
        finally:
            self._remove_files()  # also if closing failed part-way; runs once
