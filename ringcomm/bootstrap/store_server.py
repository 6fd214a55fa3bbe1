"""The store's server: a key-value service on ``tcp://host:port``, and how long it lives.

Blocking ``get`` and ``wait`` are parked on the server until their keys appear or their
deadline passes, so a timeout names exactly the keys that are missing. Every request is
checked before it runs (``store_wire.parse_request``), and with ``RINGCOMM_AUTH_TOKEN``
only clients holding the token reach the server at all (CURVE).

**Lifetime.** A stand-alone store (``ringcomm store``, ``python -m ringcomm.bootstrap.store``)
serves until it is stopped. The store that rank 0 serves for its group (``ringcomm.init`` on
an address) is *held* by that group (``hold``, ``own``; a later group of the same rank 0 on
the same address while the first lives holds it too), and its life has to cover every
rank's last use of it, while a rank that has closed may already be back at the same
address for its next group, whose store rank 0 has not served yet. So it goes away in
three steps:

1. *serving*: everyone is served. Each client that sends a request is *known* from then
   on, every socket of it (each thread of a client has its own), by the client id its
   sockets carry (``store_wire.client_of``).
2. *leaving*, once every group holding it has begun to leave (its first rank's ``leave``:
   each rank's close says it after its last use of the store): known clients are still
   served, so ranks still closing finish their work; a client never seen before (a rank's
   next init) gets the status ``leaving``, which its ``StoreClient`` answers by asking
   again on a new connection until its own deadline, by when the next group's store
   answers there. (A new ``hold`` ends this: the store stays for the new group.)
3. *closed*, by the last holding group's rank 0 (``retire``): once every rank of its
   groups has said ``leave``, or no known client holds a connection any more (they closed,
   or their processes died: the kernel closes a dead process's sockets), or a few seconds
   have passed, whichever comes first.

Which connection carries which client's requests is read from each message (the connection
it came in on) and forgotten when that connection closes.

**Bounds.** Whatever a client sends, the store holds a bounded amount for it (docs/security.md,
"The store's bounds"): without a token the store reads ZeroMQ's wire itself
(``store_zmtp``), so a whole message is bounded (``MAX_MESSAGE_BYTES`` in ``MAX_FRAMES``
frames), not a frame; each client parks at most ``MAX_PARKED`` requests and
``MAX_PARKED_KEY_BYTES`` of keys in them, and a connection's parked requests go when it
closes; replies a client leaves unread are bounded per connection (``MAX_UNREAD_BYTES``,
``MAX_UNREAD_PIECES``); the data the store holds is bounded as a whole
(``MAX_STORED_BYTES``). ``held`` says what it holds. Refusals are logged at a bounded rate
(``RateLimitedLog``).
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..core import config, waits
from ..core.rate_limit import RateLimitedLog
from ..errors import ArgumentError, StoreError
from ..transport import auth
from .store_wire import (
    ERROR,
    LEAVING,
    MAX_FRAME_BYTES,
    MAX_FRAMES,
    MAX_INTEGER_DIGITS,
    MAX_MESSAGE_BYTES,
    OK,
    REQUEST_ID,
    TIMEOUT,
    client_of,
    is_number,
    parse_request,
)
from .store_zmtp import ProtocolError, Reader, encode, greeting, ready

log = logging.getLogger("ringcomm.bootstrap.store")

LOOPBACK = "127.0.0.1"

# What one client may make the store hold (docs/security.md, "The store's bounds").
MAX_PARKED = 256  # parked gets and waits, per client
MAX_PARKED_KEY_BYTES = 8 << 20  # the keys they wait on, per client, each counted as below
KEY_COST = 320  # B: what the store holds for a parked key besides its bytes (its indexes)
# replies queued for one connection and not yet written to it (its client does not read):
MAX_UNREAD_BYTES = MAX_MESSAGE_BYTES  # their bytes, each piece counted as below
PIECE_COST = 1024  # B: what a queued piece of a reply holds besides its bytes
MAX_UNREAD_PIECES = 4096  # and how many pieces (a reply is one to three)
# A piece of at most COPIED_BYTES is copied and sent untracked (a tracker starts pyzmq's
# garbage collector: a context and two threads for the rest of the process's life); what is
# unread of them is known from the next tracked piece (a connection writes in order), and
# one is tracked at least this often, in pieces and in bytes:
COPIED_BYTES = 1 << 16
TRACK_EVERY_PIECES = 256
TRACK_EVERY_BYTES = 1 << 20
MAX_STORED_BYTES = 512 << 20  # the data, all clients together, each key counted as below
ENTRY_COST = 128  # B: what the store holds for a key besides its key's and value's bytes
RECEIVE_QUEUE = 256  # pieces of 8 KiB libzmq reads ahead for one connection (2 MiB)
_TURN = 4096  # pieces of connections' bytes read in one turn of the loop (32 MiB at most)
_FORGOTTEN = 1024  # connections this end closed, remembered so a late notice is not new


@dataclass(order=True)
class _Parked:
    """A ``get`` or ``wait`` waiting on the server for keys to appear."""

    deadline: float
    serial: int
    conn: Hashable = field(compare=False)  # the connection it came on (its answer goes there)
    identity: bytes = field(compare=False)
    request_id: bytes = field(compare=False)
    command: bytes = field(compare=False)
    keys: list[bytes] = field(compare=False)
    cost: int = field(default=0, compare=False)  # its keys, as MAX_PARKED_KEY_BYTES counts
    done: bool = field(default=False, compare=False)


@dataclass
class _Hold:
    """A group that holds a store (``StoreServer.hold``): its name and size once known, the
    ranks that have said ``leave``, and whether its rank 0 is done with the store."""

    group: bytes | None = None
    world: int = 0
    left: set[int] = field(default_factory=set)
    retired: bool = False


class _Request(NamedTuple):
    """A whole message from a client: the connection it came on (what the door names it),
    the client's routing id, its frames, and the peer's address (for the log)."""

    conn: Hashable
    identity: bytes
    frames: list[bytes]
    peer: str


# What a door's ``receive`` reports, in the order the server is to see it.
_Event = tuple[str, "_Request | Hashable"]  # ("request", _Request) or ("closed", conn)


class _CurveDoor:
    """The store's socket with a token: a ZeroMQ ``ROUTER`` with CURVE (``auth``), whose
    gatekeeper lets through only clients holding the token. A connection is named by its
    file descriptor (``SRCFD``); the socket's monitor reports when one closes."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int, keys: auth.Keys,
                 what: str, refusals: RateLimitedLog) -> None:
        self.what = what
        self.refusals = refusals
        self.gatekeeper: auth.Gatekeeper | None = auth.Gatekeeper(ctx, keys,
                                                                  f"the store on {host}")
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        keys.serve(self.sock)
        self.monitor = self.sock.get_monitor_socket(auth.HANDSHAKE_FAILED |
                                                    zmq.EVENT_DISCONNECTED)
        self.sockets = [self.sock, self.monitor]
        self.message_bytes = self.most_message_bytes = 0  # libzmq's to bound, by frame
        self.connections = 0
        self.endpoint = _bind(self, host, port)

    def receive(self, events: dict[zmq.Socket[bytes], int]) -> list[_Event]:
        """Closed connections first, then the requests that arrived: a connection's close
        is reported before its descriptor's number can be reused, so a request never lands
        on a closed one's entry."""
        arrived = []
        if self.sock in events:
            while True:
                try:
                    arrived.append(self.sock.recv_multipart(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
        found: list[_Event] = []
        while True:
            try:
                raw = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(raw)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                found.append(("closed", int(event["value"])))
            else:
                auth.log_refusal(self.what, event["event"], int(event["value"]),
                                 event["endpoint"].decode(), self.refusals)
        for frames in arrived:
            try:
                fd: Hashable = int(frames[0].get(zmq.SRCFD))
            except zmq.ZMQError:
                fd = None
            try:
                peer = str(frames[0].get("Peer-Address"))
            except zmq.ZMQError:
                peer = "?"
            found.append(("request", _Request(fd, frames[0].bytes,
                                              [f.bytes for f in frames[1:]], peer)))
        return found

    def send(self, conn: Hashable, identity: bytes, frames: list[bytes]) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the client went away; nothing to tell it
            self.sock.send_multipart([identity, *frames], zmq.NOBLOCK)

    def drop(self, conn: Hashable, why: str) -> None:
        """(A ROUTER cannot close one connection; only token holders reach it.)"""

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if self.gatekeeper is not None:
            self.gatekeeper.close()
            self.gatekeeper = None


class _PlainDoor:
    """The store's socket without a token: a ZeroMQ ``STREAM`` socket, which hands over each
    connection's bytes as they come, and ZeroMQ's wire read here (``store_zmtp.Reader``), so
    that a whole message is bounded: one that passes ``MAX_MESSAGE_BYTES`` or
    ``MAX_FRAMES`` closes its connection before more of it is read. Clients are ZeroMQ
    DEALER sockets, which see a ROUTER. A connection is named by the STREAM socket's id for
    it (never reused); a client that picks no routing id goes by that id too."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int, what: str,
                 refusals: RateLimitedLog) -> None:
        self.what = what
        self.refusals = refusals
        self.gatekeeper = None
        self.sock = ctx.socket(zmq.STREAM)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 2 * MAX_UNREAD_PIECES)  # (ours comes first)
        self.sock.copy_threshold = 0  # a piece sent uncopied is tracked until written
        self.sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        self.sockets = [self.sock]
        self._readers: dict[bytes, Reader] = {}
        self._peers: dict[bytes, str] = {}
        # per connection: its pieces not known to be written, each with its tracker (None
        # for an untracked one) and cost; and the count and cost of its untracked ones since
        # its last tracked one
        self._unread: dict[bytes, collections.deque[tuple[zmq.MessageTracker | None, int]]] = {}
        self._untracked: dict[bytes, tuple[int, int]] = {}
        self._forgotten: collections.deque[bytes] = collections.deque(maxlen=_FORGOTTEN)
        self._dropped: list[bytes] = []  # closed by this end since the last receive
        self._hello = greeting() + ready()
        self.message_bytes = 0  # bytes of messages in progress, every connection's
        self.most_message_bytes = 0  # the most that ever was
        self.endpoint = _bind(self, host, port)

    @property
    def connections(self) -> int:
        return len(self._readers)

    def receive(self, events: dict[zmq.Socket[bytes], int]) -> list[_Event]:
        """In the order things happened: connections closed by this end (a refusal, a reply
        that could not be queued) first, then each piece of bytes that arrived."""
        found = self._take_dropped()
        if self.sock not in events:
            return found
        for _ in range(_TURN):
            try:
                conn_frame, data = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            conn = conn_frame.bytes
            reader = self._readers.get(conn)
            if len(data) == 0:  # a connection opens or closes
                if reader is not None:
                    self._forget(conn)
                    found.append(("closed", conn))
                elif conn not in self._forgotten:
                    self._open(conn, data)
                continue
            if reader is None:
                continue  # the rest of what a connection closed here had sent
            before = reader.held
            refused: str | None = None
            try:
                messages = reader.feed(data.bytes)
            except ProtocolError as err:
                messages, refused = [], str(err)
            self.message_bytes += reader.held - before
            self.most_message_bytes = max(self.most_message_bytes, self.message_bytes)
            identity = reader.identity or conn
            found.extend(("request", _Request(conn, identity, m, self._peers[conn]))
                         for m in messages)
            if refused is not None:
                self.drop(conn, refused)
        return found + self._take_dropped()

    def _take_dropped(self) -> list[_Event]:
        dropped, self._dropped = self._dropped, []
        return [("closed", conn) for conn in dropped]

    def _open(self, conn: bytes, notice: zmq.Frame) -> None:
        try:
            peer = str(notice.get("Peer-Address"))
        except zmq.ZMQError:
            peer = "?"
        self._readers[conn] = Reader(MAX_MESSAGE_BYTES, MAX_FRAMES)
        self._peers[conn] = peer
        self._send(conn, [self._hello])

    def _forget(self, conn: bytes) -> None:
        reader = self._readers.pop(conn, None)
        if reader is not None:
            self.message_bytes -= reader.held
        self._peers.pop(conn, None)
        self._unread.pop(conn, None)
        self._untracked.pop(conn, None)
        self._forgotten.append(conn)

    def send(self, conn: Hashable, identity: bytes, frames: list[bytes]) -> None:
        if not isinstance(conn, bytes) or conn not in self._readers:
            return  # the client went away; nothing to tell it
        self._send(conn, encode(frames))

    def _send(self, conn: bytes, pieces: list[bytes]) -> None:
        """Queue ``pieces`` for ``conn`` unless the replies it has left unread would pass
        ``MAX_UNREAD_BYTES`` or ``MAX_UNREAD_PIECES`` (then it is closed). A piece over
        ``COPIED_BYTES`` is sent as it is and tracked until libzmq has written it (the
        kernel holds it then, or the peer); smaller ones are copied, and one is tracked every
        ``TRACK_EVERY_PIECES`` or ``TRACK_EVERY_BYTES``: a connection writes its pieces in
        order, so every piece before a written one is written too."""
        unread = self._unread.setdefault(conn, collections.deque())
        written = -1
        for i, (sent, _) in enumerate(unread):
            if sent is not None and sent.done:
                written = i
        for _ in range(written + 1):
            unread.popleft()
        cost = sum(n for _, n in unread)
        adding = sum(len(p) + PIECE_COST for p in pieces)
        if cost + adding > MAX_UNREAD_BYTES or len(unread) + len(pieces) > MAX_UNREAD_PIECES:
            self.drop(conn, f"it leaves its replies unread ({len(unread)} pieces, "
                      f"{cost} B, queued for it and not written; at most "
                      f"{MAX_UNREAD_PIECES} pieces and {MAX_UNREAD_BYTES} B)")
            return
        count, nbytes = self._untracked.get(conn, (0, 0))
        for piece in pieces:
            piece_cost = len(piece) + PIECE_COST
            tracker: zmq.MessageTracker | None = None
            try:
                if len(piece) > COPIED_BYTES or count + 1 >= TRACK_EVERY_PIECES or \
                        nbytes + piece_cost >= TRACK_EVERY_BYTES:
                    tracker = self.sock.send_multipart([conn, piece], zmq.NOBLOCK,
                                                       copy=False, track=True)
                else:
                    self.sock.send_multipart([conn, piece], zmq.NOBLOCK)
            except zmq.Again:  # (libzmq's own bound, above ours)
                self.drop(conn, "it leaves its replies unread (its queue is full)")
                return
            except zmq.ZMQError:
                return  # gone meanwhile
            unread.append((tracker, piece_cost))
            count, nbytes = (0, 0) if tracker is not None else (count + 1, nbytes + piece_cost)
        self._untracked[conn] = (count, nbytes)

    def drop(self, conn: Hashable, why: str) -> None:
        """Close connection ``conn`` for ``why`` (logged at a bounded rate); the server
        hears of it as closed at the next ``receive``."""
        if not isinstance(conn, bytes) or conn not in self._readers:
            return
        self.refusals.warning("refused", "%s closed a connection from %s: %s", self.what,
                              self._peers.get(conn, "?"), why)
        self._forget(conn)
        self._dropped.append(conn)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([conn, b""], zmq.NOBLOCK)  # closes it

    def close(self) -> None:
        self.sock.close(linger=0)


def _bind(door: _CurveDoor | _PlainDoor, host: str, port: int) -> str:
    try:
        door.sock.bind(f"tcp://{host}:{port or '*'}")
    except zmq.ZMQError as err:
        door.close()
        if err.errno == zmq.EADDRINUSE:
            raise StoreError(
                f"cannot serve the store on {host}:{port}: the port is in use; pick "
                "another MASTER_PORT or stop the process that holds it") from None
        raise StoreError(f"cannot serve the store on {host}:{port}: {err}") from None
    endpoint: str = door.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint


def _entry_cost(key: bytes, value: bytes | None) -> int:
    return 0 if value is None else len(key) + len(value) + ENTRY_COST


class StoreServer:
    """Serves a key-value store on ``tcp://host:port`` from a background thread.

    ``port=0`` picks a free port (read it from ``.port``). A port already in use raises
    ``StoreError`` at once. ``host`` is loopback unless given: other hosts reach the store
    only where asked to. With ``auth_token`` (default ``RINGCOMM_AUTH_TOKEN``) only clients
    holding the same token get through, encrypted (``ringcomm.transport.auth``); every
    request is checked (``parse_request``) and one that is not the protocol's is refused
    with a logged reason (at a bounded rate), so no client can crash the server or make it
    allocate what a request merely claims, and what one client can make it hold is bounded
    (the module docstring). It serves until ``close``, or, once groups hold it (``hold``),
    until they have left (``retire``; see the module docstring).
    """

    def __init__(self, host: str = LOOPBACK, port: int = 0,
                 auth_token: str | None = None) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            # ZeroMQ would bind 99999 as 34463 and -1 as 65535 without a word
            raise ArgumentError(f"store port {port!r} is not a TCP port: use 1 to 65535, or 0 "
                                "for a free one")
        keys = auth.keys_for(config.value("auth_token") if auth_token is None else auth_token)
        self._ctx = zmq.Context(1)
        what = f"the store on {host}:{port or '*'}"
        self._refusals = RateLimitedLog(log, per_second=1.0, burst=10)
        try:
            self._door: _CurveDoor | _PlainDoor = (
                _CurveDoor(self._ctx, host, port, keys, what, self._refusals) if keys is not None
                else _PlainDoor(self._ctx, host, port, what, self._refusals))
        except BaseException:
            self._ctx.term()
            raise
        endpoint = self._door.endpoint
        self.host = host
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._door.what = f"the store on port {self.port}"
        self._data: dict[bytes, bytes] = {}
        self._stored = 0  # bytes of data, as MAX_STORED_BYTES counts them
        self._waiters: dict[bytes, dict[int, _Parked]] = {}  # key -> parked, by serial
        self._deadlines: list[_Parked] = []
        self._dead_deadlines = 0  # entries of _deadlines already done
        self._by_conn: dict[Hashable, dict[int, _Parked]] = {}
        self._by_client: dict[bytes, list[int]] = {}  # client -> [parked, their key cost]
        self._parked = 0
        self._serial = itertools.count()
        # its lifetime (the module docstring): shared with the holders' threads, under _life
        self._life = threading.Condition()
        self._holds: dict[int, _Hold] = {}
        self._hold_numbers = itertools.count(1)
        self._leaving = False
        self._known: dict[bytes, set[Hashable]] = {}  # client -> its open connections
        self._carrier: dict[Hashable, bytes] = {}  # connection -> the client it carries
        self._wake_addr = f"inproc://store-wake-{id(self)}"
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.bind(self._wake_addr)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"ringcomm-store:{self.port}",
                                        daemon=True)
        self._thread.start()
        log.debug("store serving on %s:%d", host, self.port)

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "*", "") else self.host
        return f"{host}:{self.port}"

    def held(self) -> dict[str, int]:
        """What the store holds now, by the counts its bounds are kept by: ``parked``
        requests, the ``parked_keys`` cost of their keys, ``waited_keys`` (distinct keys
        waited on), ``parking_clients``, ``connections`` open, ``message_bytes`` of
        messages in progress (and ``most_message_bytes`` ever; without a token), ``keys``
        and ``stored_bytes`` of data. Read from another thread: each number is one the
        serving thread wrote."""
        door = self._door
        return {"parked": self._parked,
                "parked_keys": sum(cost for _, cost in list(self._by_client.values())),
                "waited_keys": len(self._waiters), "parking_clients": len(self._by_client),
                "connections": door.connections, "message_bytes": door.message_bytes,
                "most_message_bytes": door.most_message_bytes, "keys": len(self._data),
                "stored_bytes": self._stored}

    # -- lifetime

    def hold(self) -> int | None:
        """A group is about to meet on this store (``ringcomm.init``'s rank 0 holds the
        store it serves for every group it makes there): the store neither turns newcomers
        away nor closes until that group has left. Returns the hold's number for ``own`` and
        ``retire``; None where the store is closing already (serve a new one once it has
        gone)."""
        with self._life:
            if self._stopping:
                return None
            number = next(self._hold_numbers)
            self._holds[number] = _Hold()
            self._update_leaving()
            return number

    def own(self, hold: int, group: str, world: int) -> None:
        """The group of ``hold`` is ``group`` (the name its ranks ``leave`` with), of
        ``world`` ranks."""
        if world < 1:
            raise ArgumentError(f"a group has at least one rank, got world={world}")
        with self._life:
            self._holds[hold].group, self._holds[hold].world = group.encode(), world

    @property
    def leaving(self) -> bool:
        """Whether every group holding the store has begun to leave it: new clients are
        turned away."""
        with self._life:
            return self._leaving

    @property
    def closed(self) -> bool:
        """Whether the store has closed (or is closing)."""
        with self._life:
            return self._stopping

    def retire(self, hold: int, timeout: float) -> bool:
        """The group of ``hold`` is done with the store (its rank 0 closes). Where another
        group still holds the store, it stays for that one and this returns True at once.
        Where none does, the store closes once every rank of its groups has said ``leave``,
        or no known client holds a connection, or ``timeout`` s have passed: True if the
        groups were done, False if the wait ran out (a rank still closing that uses the
        store afterwards gets a ``StoreError``)."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._life:
            self._holds[hold].retired = True
            self._update_leaving()
            while True:
                if self._stopping or any(not h.retired for h in self._holds.values()):
                    return True  # closed by someone else, or held by another group
                done = self._groups_gone()
                left = deadline - time.monotonic()
                if done or left <= 0:
                    break
                self._life.wait(left)
            self._stopping = True
            if not done:
                missing = [f"rank {r} of {h.group.decode(errors='replace')}"
                           for h in self._holds.values() if h.group is not None
                           for r in range(h.world) if r not in h.left]
                log.warning("the store on port %d closes although %s may still use it: they "
                            "did not leave within %g s", self.port,
                            ", ".join(missing) or "some client", timeout)
        self._shut_down()
        return done

    def _update_leaving(self) -> None:
        """(Under ``_life``.) Leaving: every hold's group is retired or has begun to leave."""
        holds = self._holds.values()
        self._leaving = bool(holds) and all(h.retired or h.left for h in holds)

    def _groups_gone(self) -> bool:
        """(Under ``_life``.) Whether every rank of the holding groups has left, or no known
        client holds a connection any more."""
        if all(h.group is None or len(h.left) >= h.world for h in self._holds.values()):
            return True
        return not any(self._known.values())

    def close(self) -> None:
        with self._life:
            if self._stopping:
                return
            self._stopping = True
        self._shut_down()

    def _shut_down(self) -> None:
        with self._life:
            self._life.notify_all()
        poke = self._ctx.socket(zmq.PAIR)
        poke.connect(self._wake_addr)
        poke.send(b"stop")
        self._thread.join(timeout=10)
        poke.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # The loop below is the only code that touches the data, so it needs no locks (the
    # lifetime's few fields are shared with ``retire``, under ``_life``).

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in self._door.sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        try:
            while True:
                wait_ms = None
                if self._deadlines:  # (a far deadline is waited for in turns)
                    wait_ms = waits.poll_ms(self._deadlines[0].deadline - time.monotonic())
                if self._refusals.suppressed:  # say how many were held back, in a while
                    wait_ms = min(wait_ms if wait_ms is not None else 1000, 1000)
                events = dict(poller.poll(wait_ms))
                if self._wake in events:
                    break
                for kind, what in self._door.receive(events):
                    if kind == "closed":
                        self._forget_connection(what)
                    else:
                        assert isinstance(what, _Request)
                        self._handle(what)
                self._expire()
                self._refusals.flush()
        finally:
            self._door.close()
            self._wake.close(linger=0)

    def _forget_connection(self, conn: Hashable) -> None:
        """Connection ``conn`` has closed: its parked requests go (nobody is there to hear
        their answers), and its client, once it holds no connection, is no longer known."""
        for parked in list(self._by_conn.get(conn, {}).values()):
            self._unpark(parked)
        with self._life:
            client = self._carrier.pop(conn, None)
            if client is None:
                return
            conns = self._known.get(client)
            if conns is not None:
                conns.discard(conn)
                if not conns and not self._leaving:  # gone; while leaving, it stays known
                    del self._known[client]
            self._life.notify_all()

    def _admit(self, identity: bytes, conn: Hashable) -> bool:
        """Whether the requests of the connection ``identity`` may be served: always while
        serving; while leaving, only a known client's. Notes the connection it came on."""
        client = client_of(identity)
        with self._life:
            if self._leaving and client not in self._known:
                return False
            conns = self._known.setdefault(client, set())
            if conn is not None and conn not in conns:
                before = self._carrier.get(conn)
                if before is not None and before in self._known:  # (a reused fd number)
                    self._known[before].discard(conn)
                self._carrier[conn] = client
                conns.add(conn)
            return True

    def _reply(self, to: _Request | _Parked, request_id: bytes, status: bytes,
               *results: bytes) -> None:
        self._door.send(to.conn, to.identity, [request_id, status, *results])

    def _handle(self, request: _Request) -> None:
        """One message from a client: answered, or refused with a logged reason."""
        frames = request.frames
        try:
            request_id, command, args = parse_request(frames)
        except ValueError as err:
            self._refusals.warning("bad request", "the store on port %d refused a request "
                                   "from %s: %s", self.port, request.peer, err)
            if len(frames) >= 2 and len(frames[0]) == REQUEST_ID.size:
                self._reply(request, frames[0], ERROR, f"bad request: {err}".encode())
            return
        if not self._admit(request.identity, request.conn):
            log.debug("the store on port %d is leaving: a new client's %r is turned away",
                      self.port, command)
            self._reply(request, request_id, LEAVING, b"this store is going away with the "
                        b"group that serves it; ask the next one at this address")
            return
        try:
            self._execute(request, request_id, command, args)
        except ValueError as err:
            self._refusals.warning("refused request", "the store on port %d refused a %r "
                                   "request from %s: %s", self.port, command, request.peer,
                                   err)
            self._reply(request, request_id, ERROR, f"bad {command!r} request: {err}".encode())

    def _store(self, key: bytes, value: bytes) -> None:
        """Hold ``value`` under ``key``, within ``MAX_STORED_BYTES``, and wake its waiters."""
        grows = _entry_cost(key, value) - _entry_cost(key, self._data.get(key))
        if grows > 0 and self._stored + grows > MAX_STORED_BYTES:
            raise ValueError(f"the store holds {self._stored} B of data, and this would add "
                             f"{grows} B; it holds at most {MAX_STORED_BYTES} B")
        self._data[key] = value
        self._stored += grows
        self._wake_waiters(key)

    def _execute(self, request: _Request, request_id: bytes, command: bytes,
                 args: list[bytes]) -> None:
        """Run a request ``parse_request`` has checked."""
        data = self._data
        if command == b"set":
            key, value = args
            self._store(key, value)
            self._reply(request, request_id, OK)
        elif command in (b"get", b"wait"):
            timeout = waits.clamp(int(args[0]) / 1e3)  # up to 20 digits of ms: kept to a week
            keys = args[1:]
            if all(k in data for k in keys):
                self._answer(request, request_id, command, keys)
                return
            self._park(request, request_id, command, keys, timeout)
        elif command == b"add":
            key, amount = args
            before = data.get(key, b"0")
            if not is_number(before, signed=True, most=MAX_INTEGER_DIGITS):
                raise ValueError(f"the value under {key!r} is not an integer")
            value = str(int(before) + int(amount)).encode()
            self._store(key, value)
            self._reply(request, request_id, OK, value)
        elif command == b"check":
            self._reply(request, request_id, OK, b"1" if all(k in data for k in args) else b"0")
        elif command == b"compare_set":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._store(key, desired)
                current = desired
            self._reply(request, request_id, OK, current if current is not None else expected)
        elif command == b"delete":
            (key,) = args
            existed = data.pop(key, None)
            self._stored -= _entry_cost(key, existed)
            self._reply(request, request_id, OK, b"1" if existed is not None else b"0")
        elif command == b"num_keys":
            self._reply(request, request_id, OK, str(len(data)).encode())
        elif command == b"ping":
            self._reply(request, request_id, OK)
        elif command == b"leave":
            self._leave(args[0], int(args[1]))
            self._reply(request, request_id, OK)
        else:
            raise ValueError("unknown command")

    def _leave(self, group: bytes, rank: int) -> None:
        """Rank ``rank`` of ``group`` is done with the store. Only the ranks of a group that
        holds it count; another group's (or any, on a store nobody holds) change nothing."""
        with self._life:
            for held in self._holds.values():
                if held.group == group and rank < held.world:
                    held.left.add(rank)
                    self._update_leaving()
                    self._life.notify_all()

    # -- parked requests: each is in _deadlines, in _by_conn under its connection, under each
    # key it still waits for in _waiters, and counted for its client in _by_client, until
    # _unpark takes it out of all of them (answered, expired, or its connection closed)

    def _park(self, request: _Request, request_id: bytes, command: bytes, keys: list[bytes],
              timeout: float) -> None:
        client = client_of(request.identity)
        count, cost = self._by_client.get(client, (0, 0))
        mine = sum(len(k) for k in keys) + KEY_COST * len(keys)
        if count >= MAX_PARKED:
            raise ValueError(f"this client has {count} requests parked already (at most "
                             f"{MAX_PARKED})")
        if cost + mine > MAX_PARKED_KEY_BYTES:
            raise ValueError(f"this client's parked requests would wait on {cost + mine} B of "
                             f"keys (at most {MAX_PARKED_KEY_BYTES} B, each key counted at its "
                             f"length plus {KEY_COST} B)")
        parked = _Parked(time.monotonic() + timeout, next(self._serial), request.conn,
                         request.identity, request_id, command, keys, mine)
        heapq.heappush(self._deadlines, parked)
        self._by_conn.setdefault(request.conn, {})[parked.serial] = parked
        self._by_client[client] = [count + 1, cost + mine]
        self._parked += 1
        for k in keys:
            if k not in self._data:
                self._waiters.setdefault(k, {})[parked.serial] = parked

    def _unpark(self, parked: _Parked) -> None:
        """Take ``parked`` out of every index (it is answered, or nobody waits for it)."""
        if parked.done:
            return
        parked.done = True
        self._parked -= 1
        self._dead_deadlines += 1
        for k in parked.keys:
            waiting = self._waiters.get(k)
            if waiting is not None and waiting.pop(parked.serial, None) is not None \
                    and not waiting:
                del self._waiters[k]
        mine = self._by_conn.get(parked.conn)
        if mine is not None:
            mine.pop(parked.serial, None)
            if not mine:
                del self._by_conn[parked.conn]
        client = client_of(parked.identity)
        counts = self._by_client.get(client)
        if counts is not None:
            counts[0] -= 1
            counts[1] -= parked.cost
            if counts[0] <= 0:
                del self._by_client[client]
        if self._dead_deadlines > 64 and self._dead_deadlines * 2 > len(self._deadlines):
            # (what is done leaves the heap now, not at a deadline a week away)
            self._deadlines = [p for p in self._deadlines if not p.done]
            heapq.heapify(self._deadlines)
            self._dead_deadlines = 0

    def _answer(self, to: _Request | _Parked, request_id: bytes, command: bytes,
                keys: list[bytes]) -> None:
        if command == b"get":
            self._reply(to, request_id, OK, self._data[keys[0]])
        else:
            self._reply(to, request_id, OK)

    def _wake_waiters(self, key: bytes) -> None:
        waiting = self._waiters.pop(key, None)
        if not waiting:
            return
        for parked in list(waiting.values()):
            missing = [k for k in parked.keys if k not in self._data]
            if not missing:
                self._unpark(parked)
                self._answer(parked, parked.request_id, parked.command, parked.keys)
                continue
            for k in missing:  # a key it saw set may have been deleted since: watch it again
                self._waiters.setdefault(k, {})[parked.serial] = parked

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and (self._deadlines[0].deadline <= now or self._deadlines[0].done):
            parked = heapq.heappop(self._deadlines)
            if parked.done:
                self._dead_deadlines -= 1
                continue
            missing = [k for k in parked.keys if k not in self._data]
            self._unpark(parked)
            self._dead_deadlines -= 1
            self._reply(parked, parked.request_id, TIMEOUT, *missing)
