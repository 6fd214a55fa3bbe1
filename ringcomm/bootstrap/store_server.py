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

Which connection carries which client's requests is read from each message (the socket
it came in on) and forgotten when the socket's monitor reports that connection closed.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..core import config, waits
from ..errors import ArgumentError, StoreError
from ..transport import auth
from .store_wire import (
    ERROR,
    LEAVING,
    MAX_FRAME_BYTES,
    MAX_INTEGER_DIGITS,
    OK,
    REQUEST_ID,
    TIMEOUT,
    client_of,
    is_number,
    parse_request,
)

log = logging.getLogger("ringcomm.bootstrap.store")

LOOPBACK = "127.0.0.1"


@dataclass(order=True)
class _Parked:
    """A ``get`` or ``wait`` waiting on the server for keys to appear."""

    deadline: float
    serial: int
    identity: bytes = field(compare=False)
    request_id: bytes = field(compare=False)
    command: bytes = field(compare=False)
    keys: list[bytes] = field(compare=False)
    done: bool = field(default=False, compare=False)


@dataclass
class _Hold:
    """A group that holds a store (``StoreServer.hold``): its name and size once known, the
    ranks that have said ``leave``, and whether its rank 0 is done with the store."""

    group: bytes | None = None
    world: int = 0
    left: set[int] = field(default_factory=set)
    retired: bool = False


class StoreServer:
    """Serves a key-value store on ``tcp://host:port`` from a background thread.

    ``port=0`` picks a free port (read it from ``.port``). A port already in use raises
    ``StoreError`` at once. ``host`` is loopback unless given: other hosts reach the store
    only where asked to. With ``auth_token`` (default ``RINGCOMM_AUTH_TOKEN``) only clients
    holding the same token get through, encrypted (``ringcomm.transport.auth``); every
    request is checked (``parse_request``) and one that is not the protocol's is refused
    with a logged reason, so no client can crash the server or make it allocate what a
    request merely claims. It serves until ``close``, or, once groups hold it (``hold``),
    until they have left (``retire``; see the module docstring).
    """

    def __init__(self, host: str = LOOPBACK, port: int = 0,
                 auth_token: str | None = None) -> None:
        keys = auth.keys_for(config.value("auth_token") if auth_token is None else auth_token)
        self._ctx = zmq.Context(1)
        self._gatekeeper = (auth.Gatekeeper(self._ctx, keys, f"the store on {host}")
                            if keys is not None else None)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if keys is not None:
            keys.serve(self._sock)
        self._monitor = self._sock.get_monitor_socket(auth.HANDSHAKE_FAILED |
                                                      zmq.EVENT_DISCONNECTED)
        try:
            self._sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as err:
            self._sock.disable_monitor()
            self._monitor.close()
            self._sock.close()
            if self._gatekeeper is not None:
                self._gatekeeper.close()
            self._ctx.term()
            if err.errno == zmq.EADDRINUSE:
                raise StoreError(
                    f"cannot serve the store on {host}:{port}: the port is in use; pick "
                    "another MASTER_PORT or stop the process that holds it") from None
            raise StoreError(f"cannot serve the store on {host}:{port}: {err}") from None
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.host = host
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, list[_Parked]] = {}
        self._deadlines: list[_Parked] = []
        self._serial = itertools.count()
        # its lifetime (the module docstring): shared with the holders' threads, under _life
        self._life = threading.Condition()
        self._holds: dict[int, _Hold] = {}
        self._hold_numbers = itertools.count(1)
        self._leaving = False
        self._known: dict[bytes, set[int]] = {}  # client -> its open connections (fds)
        self._carrier: dict[int, bytes] = {}  # connection (fd) -> the client it carries
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
        if self._gatekeeper is not None:
            self._gatekeeper.close()
        self._ctx.term()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # The loop below is the only code that touches the data, so it needs no locks (the
    # lifetime's few fields are shared with ``retire``, under ``_life``).

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while True:
                wait_ms = None
                if self._deadlines:  # (a far deadline is waited for in turns)
                    wait_ms = waits.poll_ms(self._deadlines[0].deadline - time.monotonic())
                events = dict(poller.poll(wait_ms))
                if self._wake in events:
                    break
                arrived = []
                if self._sock in events:
                    while True:
                        try:
                            arrived.append(self._sock.recv_multipart(zmq.NOBLOCK, copy=False))
                        except zmq.Again:
                            break
                # Connections closed so far, before the requests that arrived are put down
                # to their connections: a connection's close is reported before its socket
                # number can be reused, so a request never lands on a closed one's entry.
                self._read_monitor()
                for frames in arrived:
                    self._handle(frames)
                self._expire()
        finally:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._wake.close(linger=0)

    def _read_monitor(self) -> None:
        """Every event the socket's monitor holds: failed handshakes are logged, closed
        connections forgotten."""
        while True:
            try:
                raw = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(raw)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._forget_connection(int(event["value"]))
            else:
                auth.log_refusal(f"the store on port {self.port}", event["event"],
                                 int(event["value"]), event["endpoint"].decode())

    def _forget_connection(self, fd: int) -> None:
        with self._life:
            client = self._carrier.pop(fd, None)
            if client is None:
                return
            fds = self._known.get(client)
            if fds is not None:
                fds.discard(fd)
                if not fds and not self._leaving:  # gone; while leaving, it stays known
                    del self._known[client]
            self._life.notify_all()

    def _admit(self, identity: bytes, frame: zmq.Frame) -> bool:
        """Whether the requests of the connection ``identity`` may be served: always while
        serving; while leaving, only a known client's. Notes the connection it came on."""
        client = client_of(identity)
        with self._life:
            if self._leaving and client not in self._known:
                return False
            try:
                fd = int(frame.get(zmq.SRCFD))  # the connection it came in on
            except zmq.ZMQError:
                fd = -1
            fds = self._known.setdefault(client, set())
            if fd >= 0 and fd not in fds:
                before = self._carrier.get(fd)
                if before is not None and before in self._known:  # (a reused fd number)
                    self._known[before].discard(fd)
                self._carrier[fd] = client
                fds.add(fd)
            return True

    def _reply(self, identity: bytes, request_id: bytes, status: bytes, *results: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the client went away; nothing to tell it
            self._sock.send_multipart([identity, request_id, status, *results], zmq.NOBLOCK)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        """One message from a client: answered, or refused with a logged reason."""
        identity = frames[0].bytes
        request = [f.bytes for f in frames[1:]]
        try:
            request_id, command, args = parse_request(request)
        except ValueError as err:
            try:
                peer = frames[0].get("Peer-Address")
            except zmq.ZMQError:
                peer = "?"
            log.warning("the store on port %d refused a request from %s: %s", self.port,
                        peer, err)
            if len(request) >= 2 and len(request[0]) == REQUEST_ID.size:
                self._reply(identity, request[0], ERROR, f"bad request: {err}".encode())
            return
        if not self._admit(identity, frames[0]):
            log.debug("the store on port %d is leaving: a new client's %r is turned away",
                      self.port, command)
            self._reply(identity, request_id, LEAVING, b"this store is going away with the "
                        b"group that serves it; ask the next one at this address")
            return
        try:
            self._execute(identity, request_id, command, args)
        except ValueError as err:
            self._reply(identity, request_id, ERROR, f"bad {command!r} request: {err}".encode())

    def _execute(self, identity: bytes, request_id: bytes, command: bytes,
                 args: list[bytes]) -> None:
        """Run a request ``parse_request`` has checked."""
        data = self._data
        if command == b"set":
            key, value = args
            data[key] = value
            self._wake_waiters(key)
            self._reply(identity, request_id, OK)
        elif command in (b"get", b"wait"):
            timeout = waits.clamp(int(args[0]) / 1e3)  # up to 20 digits of ms: kept to a week
            keys = args[1:]
            if all(k in data for k in keys):
                self._answer_parked(identity, request_id, command, keys)
                return
            parked = _Parked(time.monotonic() + timeout, next(self._serial),
                             identity, request_id, command, keys)
            heapq.heappush(self._deadlines, parked)
            for k in keys:
                if k not in data:
                    self._waiters.setdefault(k, []).append(parked)
        elif command == b"add":
            key, amount = args
            before = data.get(key, b"0")
            if not is_number(before, signed=True, most=MAX_INTEGER_DIGITS):
                raise ValueError(f"the value under {key!r} is not an integer")
            value = str(int(before) + int(amount)).encode()
            data[key] = value
            self._wake_waiters(key)
            self._reply(identity, request_id, OK, value)
        elif command == b"check":
            self._reply(identity, request_id, OK, b"1" if all(k in data for k in args) else b"0")
        elif command == b"compare_set":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                data[key] = desired
                self._wake_waiters(key)
                current = desired
            self._reply(identity, request_id, OK, current if current is not None else expected)
        elif command == b"delete":
            (key,) = args
            existed = data.pop(key, None) is not None
            self._reply(identity, request_id, OK, b"1" if existed else b"0")
        elif command == b"num_keys":
            self._reply(identity, request_id, OK, str(len(data)).encode())
        elif command == b"ping":
            self._reply(identity, request_id, OK)
        elif command == b"leave":
            self._leave(args[0], int(args[1]))
            self._reply(identity, request_id, OK)
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

    def _answer_parked(self, identity: bytes, request_id: bytes, command: bytes,
                       keys: list[bytes]) -> None:
        if command == b"get":
            self._reply(identity, request_id, OK, self._data[keys[0]])
        else:
            self._reply(identity, request_id, OK)

    def _wake_waiters(self, key: bytes) -> None:
        for parked in self._waiters.pop(key, ()):
            if parked.done:
                continue
            missing = [k for k in parked.keys if k not in self._data]
            if not missing:
                parked.done = True
                self._answer_parked(parked.identity, parked.request_id, parked.command,
                                    parked.keys)
                continue
            for k in missing:  # a key it saw set may have been deleted since: watch it again
                waiting = self._waiters.setdefault(k, [])
                if parked not in waiting:
                    waiting.append(parked)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and (self._deadlines[0].deadline <= now or self._deadlines[0].done):
            parked = heapq.heappop(self._deadlines)
            if parked.done:
                continue
            parked.done = True
            missing = [k for k in parked.keys if k not in self._data]
            for k in missing:
                waiting = self._waiters.get(k)
                if waiting and parked in waiting:
                    waiting.remove(parked)
                    if not waiting:
                        del self._waiters[k]
            self._reply(parked.identity, parked.request_id, TIMEOUT, *missing)
