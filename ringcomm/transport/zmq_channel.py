"""ZeroMQ channels: one PUSH->PULL pipe per ordered pair of ranks, ipc on a host, tcp across.

Why this shape:
- One pipe per pair keeps each peer's messages in order and lets a rank wait for exactly
  the peer its schedule names, with no demultiplexing on the hot path.
- ``ipc://`` when both ranks report the same host, ``tcp://`` otherwise; ``RINGCOMM_TRANSPORT``
  (``ipc``, ``tcp``, ``auto``) forces one.
- Large payloads leave with ``copy=False`` (no copy into ZeroMQ) and are tracked, so the
  executor knows when the buffer may change again. Small ones are copied: cheaper than
  tracking. Payloads are received straight into their destination (``recv_into``) or, when
  they are to be reduced, as a ZeroMQ frame that the reduction reads in place.
- Between ranks on one host, payloads of ``SHM_MIN_BYTES`` or more travel through a
  shared-memory ring (``shm_ring``): one copy instead of three. The headers, the small
  payloads and the ring's notices then go through a named pipe per pair (``pipe``), not the
  socket: a pipe wakes the receiver straight from the sender's write, where ZeroMQ needs
  two I/O threads in between. ``RINGCOMM_SHM=0`` turns both off; a full ring falls back to
  the pipe, a failure to create one to the socket; nothing blocks.
- A socket monitor on each receiving pipe notices a peer's connection closing, so a dead
  peer becomes a ``PeerLostError`` at once rather than a timeout; a control pipe per rank
  carries abort notices, so a failure on one rank wakes every rank that waits.
- A receive that has waited ``STALL_PROBE_S`` sends the peer it waits for a *probe* naming
  the op it is in. A peer that waits in a different collective under the same sequence
  number (say ``broadcast #1`` against ``allreduce #1``) raises ``DesyncError`` at once:
  schedules in which nobody receives a wrong header (trees, halving-doubling) would
  otherwise wait for the timeout.
- High-water marks are off: a send never blocks, which is what lets schedules queue sends
  ahead of their receives without deadlock.

Set-up goes through the store: knowing from the caller which ranks share its host (the
host identities gathered at init), every rank binds one receiving socket per peer and
publishes the addresses.

Nothing is left behind, even after a crash. A transport's files are its ipc folder
(``<tmp>/ringcomm-<uid>/<pid>-<pid namespace>-<random>``: the ipc sockets and, briefly, the
named pipes) and the names of its shared-memory rings (``shm_ring``; each reader removes
the name as soon as it has mapped the ring). ``close`` removes them; so does a finalizer
when the transport is garbage-collected or still open at interpreter exit (a program that
never calls ``close`` or ``destroy_process_group``, or ends in an exception). A process
that dies without running Python's exit hooks (SIGKILL, a SIGTERM that Python does not
handle) cannot: the next transport set up on the host (``sweep_litter``) removes the files
whose owner pid, which their names carry, has ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import struct
import tempfile
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import ArgumentError, CommError, CommTimeout, DesyncError, PeerLostError
from . import shm_ring
from .base import Transport
from .header import SIZE as HEADER_SIZE
from .header import Header, OpKind, differences
from .pipe import Flusher, PipeReader, PipeWriter

log = logging.getLogger("ringcomm")

ZERO_COPY_MIN_BYTES = 64 * 1024  # below this a copy is cheaper than tracking (pyzmq's own limit)
SHM_MIN_BYTES = 64 * 1024  # payloads this big go through shared memory between local ranks
_SHM_NOTICE = struct.Struct("<q")  # follows the header: the payload's position in the ring
# Pipe frames open with a tag: the payload follows inline, or it waits in shared memory.
_INLINE, _IN_SHM = b"I", b"S"
_PAYLOAD_GRACE_S = 30.0  # the rest of a frame whose header arrived is on its way
_POLL_SLICE_MS = 1000
_SEND_POLL_S = 0.05  # how often a wait for a send looks for a lost peer or an abort
_LOST_GRACE_S = 1.0  # a send to a peer whose connection closed may still be finishing
_ABORT_GRACE_MS = 500  # a peer that closed may have failed on an abort still on its way here
STALL_PROBE_S = 1.0  # a receive stalled this long asks its peer which op it is in
DEFAULT_SPIN_US = 50  # a receive polls this long before it sleeps; RINGCOMM_SPIN_US overrides


class _Tracked:
    """A send in flight: done once ZeroMQ no longer reads the frame. ``reads_buffer`` is False
    for a shared-memory notice: the payload was copied already, and tracking the notice only
    lets the op see a peer that is gone."""

    __slots__ = ("_tracker", "reads_buffer")

    def __init__(self, tracker: zmq.MessageTracker, reads_buffer: bool = True) -> None:
        self._tracker = tracker
        self.reads_buffer = reads_buffer

    @property
    def done(self) -> bool:
        return self._tracker.done

    def wait(self, timeout: float) -> bool:
        try:
            self._tracker.wait(timeout)
        except zmq.NotDone:
            return False
        return True


def spin_seconds() -> float:
    """How long a receive polls without sleeping before it blocks in ``poll``. Waking a
    process that sleeps costs tens of microseconds (more on a virtual machine, whose idle
    CPU halts); a message that arrives within the spin is taken at once. The spin yields the
    CPU on every turn, so ranks that share a core still run. ``RINGCOMM_SPIN_US`` sets it
    (0 turns it off)."""
    env = os.environ.get("RINGCOMM_SPIN_US")
    if env is None or env == "":
        return DEFAULT_SPIN_US / 1e6
    try:
        value = float(env)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1e6:
        raise ArgumentError(f"RINGCOMM_SPIN_US={env!r} is not a number of microseconds "
                            "from 0 to 1000000; unset it for the default "
                            f"({DEFAULT_SPIN_US})")
    return value / 1e6


def shm_ring_bytes(local_peers: int) -> int:
    """Capacity of each shared-memory ring: room for many segments, less per ring when a
    rank has many local peers. ``RINGCOMM_SHM_BYTES`` overrides it."""
    env = os.environ.get("RINGCOMM_SHM_BYTES")
    if env:
        return int(env)
    return max(8 << 20, min(32 << 20, (256 << 20) // max(1, local_peers)))


def ipc_base() -> str:
    """The folder of this user's ipc folders: ``<tmp>/ringcomm-<uid>``."""
    return os.path.join(tempfile.gettempdir(), f"ringcomm-{os.getuid()}")


# an ipc folder: tempfile.mkdtemp(prefix=f"{shm_ring.owner_tag()}-") in ipc_base()
_IPC_DIR_NAME = re.compile(r"(\d+)-([0-9a-f]+)-[a-z0-9_]+")


def _sweep_ipc_dirs(base: str) -> list[str]:
    """Remove the ipc folders in ``base`` whose owner has ended (``shm_ring.owner_gone``):
    only folders named like ours, in a ``base`` that is this user's own folder."""
    removed: list[str] = []
    try:
        info = os.lstat(base)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return removed
        entries = os.scandir(base)
    except OSError:
        return removed
    with entries:
        for entry in entries:
            m = _IPC_DIR_NAME.fullmatch(entry.name)
            try:
                if m is None or not entry.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            if shm_ring.owner_gone(int(m[1]), m[2]):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def sweep_litter() -> list[str]:
    """Remove what transports of processes that have ended left on this host: ipc folders
    in ``ipc_base()`` and shared-memory rings in /dev/shm, each named with its owner's pid.
    Only names of ringcomm's own patterns are touched, and only where the owner has ended;
    a pid that an unrelated live process has taken over since just delays the sweep until
    that process ends too (see ``shm_ring.owner_gone``). Never raises; returns the paths
    removed. Every transport runs it as it starts."""
    try:
        removed = [os.path.join(shm_ring.SHM_DIR, name) for name in shm_ring.sweep()]
        removed += _sweep_ipc_dirs(ipc_base())
    except Exception as err:  # noqa: BLE001 - a clean-up must never stop a set-up
        log.debug("sweeping files of ended processes failed: %s", err)
        return []
    if removed:
        log.info("removed %d files that ended ringcomm processes left behind: %s",
                 len(removed), ", ".join(removed))
    return removed


class _Files:
    """What a transport has on the file system: its ipc folder and the names of the rings
    to and from its local peers. ``remove`` runs from ``close``, or from a
    ``weakref.finalize`` when the transport is garbage-collected or still open at interpreter
    exit (the finalizer's ``atexit``), whichever comes first, and only once. It holds no
    reference to the transport, so the finalizer does not keep the transport alive; it only
    unlinks and removes names (no socket, no thread), so it cannot hold up an exit."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.ipc_dir: str | None = None
        self.shm_paths: list[str] = []

    def remove(self) -> None:
        if os.getpid() != self.pid:  # a forked child exiting: the files are its parent's
            return
        for path in self.shm_paths:  # the rings' memory lives on while mapped
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


class _PeerState:
    __slots__ = ("pull", "push", "monitor", "poller", "connected", "lost", "shm_out",
                 "shm_in", "shm_name_out", "shm_name_in", "shm_capacity_in", "incoming",
                 "held", "reserved", "pipe_in", "pipe_out", "inline")

    def __init__(self) -> None:
        self.pull: zmq.Socket | None = None
        self.push: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.poller: zmq.Poller | None = None
        self.connected = False
        self.lost = False
        # shared-memory payloads: our ring to the peer, the peer's ring to us
        self.shm_out: shm_ring.RingWriter | None = None
        self.shm_in: shm_ring.RingReader | None = None
        self.shm_name_out: str | None = None  # None: this peer gets no shared memory
        self.shm_name_in: str | None = None
        self.shm_capacity_in = 0
        self.incoming: tuple[int, int] | None = None  # (ring position, bytes) of the header read
        self.held: tuple[int, int] | None = None  # a ring payload handed out, not yet released
        self.reserved: int | None = None  # ring position of a slot handed out to fill
        # local peers: a FIFO each way carries headers, small payloads and ring notices
        self.pipe_in: PipeReader | None = None
        self.pipe_out: PipeWriter | None = None
        self.inline: int | None = None  # bytes of the pipe payload after the header read


class ZmqTransport(Transport):
    """Channels from ``rank`` to every other rank, set up through ``store``.

    ``store`` needs ``set``, ``get`` and ``wait`` (any ``ringcomm.bootstrap.store.Store``); keys are
    written under ``prefix``. ``hosts`` holds every rank's host identity (equal where
    ranks share ipc and shared memory); ``host`` is the address other hosts reach this one
    at.
    """

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
        super().__init__(rank, world_size)
        if len(hosts) != world_size:
            raise ArgumentError(f"{len(hosts)} host identities for a world of {world_size}")
        self._hosts = list(hosts)
        mode = (mode or os.environ.get("RINGCOMM_TRANSPORT", "auto")).lower()
        if mode not in ("auto", "ipc", "tcp"):
            raise ArgumentError(f"transport {mode!r} is unknown; use auto, ipc or tcp")
        self.mode = mode
        if shm is None:
            shm = os.environ.get("RINGCOMM_SHM", "1").lower() not in ("0", "false", "no", "off")
        self.shm = shm and shm_ring.available()
        self.spin_s = spin_seconds()
        self._shm_capacity = 0
        self._token = shm_ring.new_token()  # names this transport's rings; carries our pid
        # payloads sent, by path: what a user checks to see shared memory at work
        self.counters = {"shm": 0, "pipe": 0, "socket": 0, "shm_full": 0}
        self._flusher = Flusher()
        self._ctx = zmq.Context(io_threads=io_threads)
        self._peers = [_PeerState() for _ in range(world_size)]
        self._ipc_dir: str | None = None
        self._control_endpoints: dict[int, str] = {}
        self._control_push: dict[int, zmq.Socket] = {}
        self._closed = False
        self._abandon = False  # set-up failed: close without waiting for any socket
        self._files = _Files()
        self._remove_files = weakref.finalize(self, self._files.remove)
        sweep_litter()
        try:
            self._connect(store, prefix, host, timeout)
        except BaseException:
            # a socket half set up (one that failed to bind) is in no list that close()
            # walks, and would keep the context's term() waiting forever: destroy it
            self._abandon = True
            self.close()
            raise

    # ------------------------------------------------------------------ set-up
    def _key(self, prefix: str, what: str, rank: int) -> str:
        return f"{prefix}zmq/{what}/{rank}"

    def _connect(self, store: Any, prefix: str, host: str, timeout: float) -> None:
        n, me, hosts = self.world_size, self.rank, self._hosts
        if n == 1:
            return
        use_ipc = [
            self.mode == "ipc" or (self.mode == "auto" and hosts[r] == hosts[me])
            for r in range(n)
        ]
        if any(use_ipc[r] for r in range(n) if r != me):
            base = ipc_base()
            os.makedirs(base, exist_ok=True)
            self._ipc_dir = self._files.ipc_dir = tempfile.mkdtemp(
                prefix=f"{shm_ring.owner_tag()}-", dir=base)

        # One receiving socket per peer (plus the control socket, at index `me`).
        endpoints: list[str] = []
        for peer in range(n):
            pull = self._ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.RCVHWM, 0)
            pull.setsockopt(zmq.LINGER, 0)
            if (peer != me and use_ipc[peer]) or (peer == me and self._ipc_dir):
                endpoint = f"ipc://{self._ipc_dir}/{peer}"
                pull.bind(endpoint)
            else:
                port = pull.bind_to_random_port(f"tcp://{host}")
                endpoint = f"tcp://{host}:{port}"
            state = self._peers[peer]
            state.pull = pull
            if peer != me:
                state.monitor = pull.get_monitor_socket(
                    zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                )
            endpoints.append(endpoint)
        # A control socket bound to ipc is useless to peers on other hosts: bind tcp too.
        if self._ipc_dir and not all(use_ipc):
            port = self._peers[me].pull.bind_to_random_port(f"tcp://{host}")
            endpoints[me] += f" tcp://{host}:{port}"
        # Shared memory with peers on this host that use ipc: offered by both sides or not used.
        local = [r for r in range(n) if r != me and use_ipc[r] and hosts[r] == hosts[me]]
        self._shm_capacity = shm_ring_bytes(len(local)) if self.shm and local else 0
        if self._shm_capacity:  # a pipe from each local peer, used if it offers shm too
            for r in local:
                self._peers[r].pipe_in = PipeReader(f"{self._ipc_dir}/pipe-from-{r}")
        endpoints.append(f"shm {self._token if self._shm_capacity else '-'} "
                         f"{self._shm_capacity}")
        store.set(self._key(prefix, "ep", me), "\n".join(endpoints).encode())

        ep_keys = [self._key(prefix, "ep", r) for r in range(n)]
        store.wait(ep_keys, timeout)
        for peer in range(n):
            if peer == me:
                continue
            theirs = store.get(ep_keys[peer]).decode().split("\n")
            state = self._peers[peer]
            state.push = self._push_socket(theirs[me])
            _, token, capacity = theirs[n].split(" ")
            if token != "-" and not shm_ring.valid_token(token):
                raise CommError(f"rank {peer} offers shared memory under a malformed name "
                                f"({token!r}); is it running another ringcomm version?",
                                rank=me, peer=peer)
            if peer in local and self._shm_capacity and token != "-":
                state.shm_name_out = shm_ring.ring_name(self._token, me, peer)
                state.shm_name_in = shm_ring.ring_name(token, peer, me)
                state.shm_capacity_in = int(capacity)
                # ours until the reader maps it; theirs is not needed once we stop reading
                self._files.shm_paths += [os.path.join(shm_ring.SHM_DIR, name) for name in
                                          (state.shm_name_out, state.shm_name_in)]
            control = theirs[peer].split(" ")
            # our messages to `peer` go to the socket it bound for us; aborts to its control
            self._control_endpoints[peer] = next(
                (e for e in control if e.startswith("ipc") == use_ipc[peer]), control[-1]
            )
            if state.pipe_in is not None and state.shm_name_in is None:
                state.pipe_in.close()  # the peer has no shared memory: sockets only
                state.pipe_in = None
            elif state.pipe_in is not None:
                their_dir = theirs[me][len("ipc://"):].rsplit("/", 1)[0]
                state.pipe_out = PipeWriter(f"{their_dir}/pipe-from-{me}", self._flusher)
        piped = [r for r in range(n) if self._peers[r].pipe_out is not None]
        if piped:  # a pipe's reader sees end-of-file until its writer has opened it
            store.set(self._key(prefix, "pipes", me), b"open")
            store.wait([self._key(prefix, "pipes", r) for r in piped], timeout)
        for peer in range(n):
            if peer == me:
                continue
            state = self._peers[peer]
            state.poller = zmq.Poller()
            if state.pipe_in is not None:
                state.pipe_in.unlink()
                state.poller.register(state.pipe_in.fd, zmq.POLLIN)
            else:
                state.poller.register(state.pull, zmq.POLLIN)
                state.poller.register(state.monitor, zmq.POLLIN)
            state.poller.register(self._peers[me].pull, zmq.POLLIN)

    def _push_socket(self, endpoint: str) -> zmq.Socket:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 2000)
        push.copy_threshold = 0  # track every copy=False frame, small shm notices included
        push.connect(endpoint)
        return push

    # ------------------------------------------------------------------ sending
    def _send(self, peer: int, header: Header, payload: np.ndarray | None) -> Any:
        state = self._peers[peer]
        push = state.push
        raw = header.pack()
        if payload is None or header.nbytes == 0:
            if state.pipe_out is not None:
                self._pipe_write(peer, state, _INLINE + raw)
            else:
                push.send_multipart((raw, b""))
            return None
        data = payload.view(np.uint8)
        dst = self.reserve(peer, header.nbytes)
        if dst is not None:
            np.copyto(dst, data.reshape(-1))
            return self.send_reserved(peer, header)
        if state.pipe_out is not None:
            self.counters["pipe"] += 1
            self._pipe_write(peer, state, b"".join((_INLINE, raw, data.reshape(-1))))
            return None
        self.counters["socket"] += 1
        if header.nbytes < ZERO_COPY_MIN_BYTES:
            push.send_multipart((raw, data))
            return None
        push.send(raw, zmq.SNDMORE)
        return _Tracked(push.send(data, copy=False, track=True))

    def describe(self) -> str:
        """One line per peer: how this rank's messages reach it."""
        lines = []
        for peer, state in enumerate(self._peers):
            if peer == self.rank or state.push is None:
                continue
            how = state.push.getsockopt_string(zmq.LAST_ENDPOINT)
            if state.pipe_out is not None:
                how = "pipe"
            if state.shm_name_out is not None:
                how += f" + shared memory ({self._shm_capacity >> 20} MiB ring)"
            lines.append(f"rank {self.rank} -> rank {peer}: {how}")
        return "\n".join(lines) or f"rank {self.rank}: no peers"

    def _peek(self, peer: int) -> bool:
        state = self._peers[peer]
        if state.pipe_in is not None:
            return state.pipe_in.has(1 + HEADER_SIZE)
        return state.pull is not None and bool(state.pull.poll(0))

    def reserve(self, peer: int, nbytes: int) -> np.ndarray | None:
        """A slot of the shared-memory ring to ``peer`` (payloads of 64 KiB and more)."""
        state = self._peers[peer]
        if nbytes < SHM_MIN_BYTES or state.shm_name_out is None:
            return None
        slot = self._reserve_shm(peer, nbytes)
        if slot is None:
            self.counters["shm_full"] += 1
            return None
        state.reserved = slot[0]
        return slot[1]

    def send_reserved(self, peer: int, header: Header) -> Any:
        state = self._peers[peer]
        start, state.reserved = state.reserved, None
        if start is None:
            raise CommError(f"send_reserved to rank {peer} without a reserved slot",
                            rank=self.rank, peer=peer)
        self.counters["shm"] += 1
        if state.pipe_out is not None:
            self._pipe_write(peer, state, _IN_SHM + header.pack() + _SHM_NOTICE.pack(start))
            return None
        notice = state.push.send(header.pack() + _SHM_NOTICE.pack(start), copy=False,
                                 track=True)
        return _Tracked(notice, reads_buffer=False)

    def _pipe_write(self, peer: int, state: _PeerState, frame: bytes) -> None:
        try:
            state.pipe_out.write(frame)
        except BrokenPipeError:
            self._peer_lost(peer, self.waiting_op, f"rank {peer} closed its pipe while this "
                            "rank still had data to send to it")

    def _reserve_shm(self, peer: int, nbytes: int) -> tuple[int, np.ndarray] | None:
        state = self._peers[peer]
        if state.shm_out is None:
            try:
                state.shm_out = shm_ring.RingWriter(state.shm_name_out, self._shm_capacity)
            except OSError as err:  # /dev/shm full or unusable: the socket still works
                log.warning("rank %d: no shared memory for rank %d (%s); using the socket",
                            self.rank, peer, err)
                state.shm_name_out = None
                return None
        return state.shm_out.reserve(nbytes)

    def _send_abort(self, peer: int, header: Header, text: bytes) -> None:
        # Also down the data pipe: there it arrives before this rank's connection closes, so
        # a peer that sees the close has read the abort first and reports its real cause.
        state = self._peers[peer]
        if state.pipe_out is not None:
            sized = header._replace(nbytes=len(text))
            with contextlib.suppress(OSError, CommError):
                self._pipe_write(peer, state, _INLINE + sized.pack() + text)
        elif state.push is not None:
            state.push.send_multipart((header.pack(), text))
        self._control(peer).send_multipart((header.pack(), text))

    def _control(self, peer: int) -> zmq.Socket:
        sock = self._control_push.get(peer)
        if sock is None:
            sock = self._control_push[peer] = self._push_socket(self._control_endpoints[peer])
        return sock

    def _send_probe(self, peer: int, waiting: Header, op: str) -> None:
        """Tell ``peer`` which op this rank waits in: the header it expects (the op's whole
        descriptor) and the op's name."""
        probe = Header.control(OpKind.PROBE, waiting.seq, self.rank)
        self._control(peer).send_multipart((probe.pack(), waiting.pack() + op.encode()))

    def _on_control(self, control: zmq.Socket, op: str) -> None:
        """An abort raises RemoteError; a probe from a rank that waits in the same op as
        this one (same sequence number) but sees it differently raises DesyncError; other
        probes are fine and dropped."""
        header = Header.unpack(control.recv())
        payload = control.recv()
        if header.kind != OpKind.PROBE:
            self.raise_remote(header, payload, op)
        mine = self.waiting_for
        theirs = Header.unpack(payload[:HEADER_SIZE])
        if mine is None or mine.is_p2p or theirs.is_p2p or theirs.seq != mine.seq:
            return
        # what they expect from this rank, as sent by them; an all-to-all's counts belong
        # to pairs and cannot be compared across them
        theirs = theirs._replace(
            sender=header.sender,
            count=mine.count if mine.kind == OpKind.ALLTOALL else theirs.count)
        diffs = differences(mine, theirs, rank=self.rank)
        if diffs:
            their_op = payload[HEADER_SIZE:].decode(errors="replace")
            raise DesyncError(
                f"rank {header.sender} waits in {their_op} while this rank waits in {op}, "
                f"and the ranks disagree about it: {'; '.join(diffs)}. Every rank must call "
                "the same collectives in the same order with the same dtype, element count, "
                "reduce op and root.",
                rank=self.rank, op=op, peer=header.sender,
            )

    # ------------------------------------------------------------------ receiving
    def _recv_header(self, peer: int, deadline: float, op: str) -> Header:
        state = self._peers[peer]
        if state.held is not None:  # the previous payload has been used by now
            state.shm_in.release(*state.held)
            state.held = None
        if state.pipe_in is not None:
            return self._pipe_header(peer, state, deadline, op)
        try:
            raw = state.pull.recv(zmq.NOBLOCK)
        except zmq.Again:
            self._wait_readable(peer, state, deadline, op)
            raw = state.pull.recv(zmq.NOBLOCK)
        if len(raw) == HEADER_SIZE + _SHM_NOTICE.size and state.shm_name_in is not None:
            header = Header.unpack(raw[:HEADER_SIZE])
            state.incoming = (_SHM_NOTICE.unpack_from(raw, HEADER_SIZE)[0], header.nbytes)
            return header
        if len(raw) != HEADER_SIZE or not state.pull.getsockopt(zmq.RCVMORE):
            raise CommError(f"malformed message from rank {peer}", rank=self.rank, op=op,
                            peer=peer)
        return Header.unpack(raw)

    def _pipe_header(self, peer: int, state: _PeerState, deadline: float, op: str) -> Header:
        frame = self._pipe_take(peer, state, 1 + HEADER_SIZE, deadline, op)
        header = Header.unpack(frame[1:])
        if frame[:1] == _IN_SHM:
            notice = self._pipe_take(peer, state, _SHM_NOTICE.size, deadline, op, rest=True)
            state.incoming = (_SHM_NOTICE.unpack(notice)[0], header.nbytes)
        elif frame[:1] == _INLINE:
            state.inline = header.nbytes
        else:
            raise CommError(f"malformed message from rank {peer}", rank=self.rank, op=op,
                            peer=peer)
        return header

    def _pipe_take(self, peer: int, state: _PeerState, nbytes: int, deadline: float,
                   op: str, *, rest: bool = False) -> bytes:
        """``nbytes`` from the pipe of ``peer``; ``rest`` for the remainder of a frame whose
        header was read, which is given more time than the caller's deadline (a short one,
        when point-to-point polls) since its writer is writing it."""
        if rest:
            deadline = max(deadline, time.monotonic() + _PAYLOAD_GRACE_S)
        while True:
            try:
                data = state.pipe_in.take(nbytes)
            except EOFError:
                self._peer_lost(peer, op)
            if data is not None:
                return data
            self._wait_readable(peer, state, deadline, op)

    def _peer_lost(self, peer: int, op: str, what: str = "") -> None:
        """Raise PeerLostError, unless an abort from some rank explains it better: a peer
        may close because another rank failed and aborted it."""
        control = self._peers[self.rank].pull
        grace_end = time.monotonic() + _ABORT_GRACE_MS / 1000
        while control.poll(max(0, int((grace_end - time.monotonic()) * 1000))):
            self._on_control(control, op)
        what = what or (f"the connection from rank {peer} closed while this rank waited for "
                        "its data")
        raise PeerLostError(f"{what}: rank {peer} died or left the group early",
                            rank=self.rank, op=op, peer=peer)

    def _wait_readable(self, peer: int, state: _PeerState, deadline: float, op: str) -> None:
        """Wait until ``peer``'s socket or pipe has data, handling aborts, probes, a lost
        connection and the deadline meanwhile."""
        control = self._peers[self.rank].pull
        started = time.monotonic()
        probe_at, spin_until = started + STALL_PROBE_S, started + self.spin_s
        while True:
            # checked every time: the event may have been read by an earlier wait. A pipe
            # reports its writer's end itself (end-of-file after the last data).
            if state.lost and state.pipe_in is None:
                if state.pull.poll(0):
                    return
                self._peer_lost(peer, op)
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise CommTimeout(
                    f"no message from rank {peer} within the timeout", rank=self.rank,
                    op=op, peer=peer,
                )
            if probe_at is not None and now >= probe_at:
                probe_at = None
                if self.waiting_for is not None and not self.waiting_for.is_p2p:
                    self._send_probe(peer, self.waiting_for, op)
            wake = left if probe_at is None else min(left, probe_at - now)
            if now < spin_until:
                events = dict(state.poller.poll(0))
                if not events:
                    os.sched_yield()
                    continue
            else:
                events = dict(state.poller.poll(min(_POLL_SLICE_MS, max(1, int(wake * 1000)))))
            # data first: a peer's message sent before another rank's abort may arrive with
            # it, and the op it belongs to can still finish (the abort stays queued for the
            # next wait, so the op after it raises)
            if state.pull in events or (state.pipe_in is not None
                                        and state.pipe_in.fd in events):
                return
            if control in events:
                self._on_control(control, op)
            if state.monitor in events:
                self._monitor_event(peer, state)

    def wait_sent(self, peer: int, handle: Any, deadline: float, op: str) -> None:
        """Wait for a zero-copy send to ``peer`` to leave, but not for a dead peer: its data
        would stay queued here until the deadline. Aborts from other ranks end it too."""
        state = self._peers[peer]
        control = self._peers[self.rank].pull
        poller = zmq.Poller()
        poller.register(state.monitor, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        lost_since = None
        while True:
            now = time.monotonic()
            if handle.wait(max(0.0, min(_SEND_POLL_S, deadline - now))):
                return
            now = time.monotonic()
            if now >= deadline:
                raise CommTimeout(
                    f"a send to rank {peer} did not leave this process in time (is it alive?)",
                    rank=self.rank, op=op, peer=peer,
                )
            events = dict(poller.poll(0))
            if control in events:
                self._on_control(control, op)
            if state.monitor in events:
                self._monitor_event(peer, state)
            if state.lost:
                lost_since = lost_since if lost_since is not None else now
                if now - lost_since >= _LOST_GRACE_S:
                    raise PeerLostError(
                        f"the connection to rank {peer} closed while this rank still had data "
                        f"to send to it: rank {peer} died or left the group early",
                        rank=self.rank, op=op, peer=peer,
                    )

    def _monitor_event(self, peer: int, state: _PeerState) -> None:
        while True:
            try:
                msg = state.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(msg)["event"]
            if event == zmq.EVENT_ACCEPTED:
                state.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                state.lost = True

    def _shm_payload(self, peer: int, state: _PeerState) -> tuple[np.ndarray, tuple[int, int]]:
        start, nbytes = state.incoming
        state.incoming = None
        if state.shm_in is None:
            try:
                state.shm_in = shm_ring.RingReader(state.shm_name_in, state.shm_capacity_in)
            except FileNotFoundError:
                # The sender removes its ring when it closes: it failed (its abort may be on
                # the way, and explains more) or left the group.
                op = self.waiting_op
                control = self._peers[self.rank].pull
                grace_end = time.monotonic() + _ABORT_GRACE_MS / 1000
                while control.poll(max(0, int((grace_end - time.monotonic()) * 1000))):
                    self._on_control(control, op)
                raise PeerLostError(
                    f"rank {peer} closed its shared memory before this rank read its data: "
                    f"rank {peer} failed or left the group early",
                    rank=self.rank, op=op, peer=peer,
                ) from None
            except OSError as err:
                raise CommError(
                    f"cannot map the shared memory of rank {peer} ({err}); if /dev/shm is "
                    "cleaned while jobs run, set RINGCOMM_SHM=0", rank=self.rank, peer=peer,
                ) from None
        return state.shm_in.view(start, nbytes), (start, nbytes)

    def _recv_payload(self, peer: int) -> Any:
        state = self._peers[peer]
        if state.incoming is not None:
            view, state.held = self._shm_payload(peer, state)
            return view
        if state.inline is not None:
            nbytes, state.inline = state.inline, None
            return self._pipe_take(peer, state, nbytes, 0.0, self.waiting_op, rest=True)
        return state.pull.recv(copy=False).buffer

    def _discard_payload(self, peer: int) -> None:
        # A ring payload is left alone: the sender may have failed and unmapped it already.
        state = self._peers[peer]
        if state.incoming is not None:
            state.incoming = None
        else:
            self._recv_payload(peer)

    def _recv_payload_into(self, peer: int, out: np.ndarray) -> int:
        state = self._peers[peer]
        if state.incoming is not None:
            view, slot = self._shm_payload(peer, state)
            np.copyto(out, view)
            state.shm_in.release(*slot)
            return out.nbytes
        if state.inline is not None:
            data = self._recv_payload(peer)
            if len(data) != out.nbytes:
                raise CommError(f"payload of {len(data)} B from rank {peer}, expected "
                                f"{out.nbytes} B", rank=self.rank, peer=peer)
            out[:] = np.frombuffer(data, dtype=np.uint8)
            return out.nbytes
        n = state.pull.recv_into(out)
        if n != out.nbytes:
            raise CommError(f"payload of {n} B from rank {peer}, expected {out.nbytes} B",
                            rank=self.rank, peer=peer)
        return n

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._close_channels()
        finally:
            self._remove_files()  # also if closing failed part-way; runs once

    def _close_channels(self) -> None:
        for state in self._peers:  # queued frames first: live peers may still read them
            if state.pipe_out is not None:
                state.pipe_out.close()
        self._flusher.stop()
        for state in self._peers:
            if state.pipe_in is not None:
                state.pipe_in.close()
            if state.monitor is not None and state.pull is not None:
                with contextlib.suppress(zmq.ZMQError):
                    state.pull.disable_monitor()
                state.monitor.close(linger=0)
            if state.push is not None:
                state.push.close()
            if state.pull is not None:
                state.pull.close(linger=0)
            if state.shm_out is not None:
                state.shm_out.close()
            if state.shm_in is not None:
                state.shm_in.close()
        for sock in self._control_push.values():
            sock.close(linger=500)
        if self._abandon:
            self._ctx.destroy(linger=0)
        else:
            self._ctx.term()
