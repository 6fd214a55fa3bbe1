"""Rendezvous store: a small key-value service so that ranks can find each other.

Ranks publish their addresses under keys and block until their peers' keys appear. The
interface (``Store``) is the one torch's c10d stores have, so the same code rendezvous
through our own server (``StoreServer``/``StoreClient``, over ZeroMQ) or through the
TCPStore that torchrun's agent already serves (``TorchStore``).

Wire protocol (one ZeroMQ multipart message each way, no pickle)::

    request:  [request id (8 B)] [command] [arguments...]
    reply:    [request id (8 B)] [status: ok | timeout | error] [results...]

Every request is checked before it runs (``parse_request``), and with
``RINGCOMM_AUTH_TOKEN`` only clients holding the token reach the server at all (CURVE).

Blocking ``get`` and ``wait`` are parked on the server until their keys appear or their
deadline passes, so a timeout names exactly the keys that are missing. The client keeps its
own deadline too and watches its connection, so a server that is gone gives an error, not a
hang. Run one stand-alone with ``python -m ringcomm.bootstrap.store --port P``.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import logging
import os
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..core import config
from ..errors import ArgumentError, AuthError, StoreError, StoreTimeout
from ..transport import auth

log = logging.getLogger("ringcomm.bootstrap.store")

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20
MAX_KEYS = 1 << 16  # in one wait or check
MAX_FRAME_BYTES = MAX_VALUE_BYTES + 64  # ZeroMQ drops a connection that sends more in a frame
_MAX_TIMEOUT_DIGITS = 20  # a timeout in ms, as decimal text
_MAX_INTEGER_DIGITS = 1000  # an amount to add and the value it adds to (Python ints are big)
DEFAULT_TIMEOUT = 300.0
LOOPBACK = "127.0.0.1"

_REQUEST_ID = struct.Struct("<Q")
_MIN_REACH = 1.0  # s: the least a client waits to connect before "could not reach"


def _key_bytes(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise ArgumentError("store keys must not be empty")
    if len(raw) > MAX_KEY_BYTES:
        raise ArgumentError(f"store key is {len(raw)} bytes; keys are limited to "
                            f"{MAX_KEY_BYTES} bytes")
    return raw


def _value_bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    if isinstance(value, str):
        raw = value.encode()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    else:
        raise ArgumentError(f"store values are bytes or str, got {type(value).__name__}; "
                            "encode it first (no pickle on the wire)")
    if len(raw) > MAX_VALUE_BYTES:
        raise ArgumentError(f"store value is {len(raw)} bytes; values are limited to "
                            f"{MAX_VALUE_BYTES} bytes")
    return raw


def _key_list(keys: str | bytes | Iterable[str | bytes]) -> list[bytes]:
    if isinstance(keys, (str, bytes)):
        keys = [keys]
    return [_key_bytes(k) for k in keys]


def _names(keys: Sequence[bytes]) -> str:
    return ", ".join(repr(k.decode(errors="replace")) for k in keys)


class Store(ABC):
    """What a rendezvous needs from a key-value store. Values are bytes."""

    timeout: float = DEFAULT_TIMEOUT

    @abstractmethod
    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key``, waking everyone waiting for it."""

    @abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` s for it to be set."""

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer under ``key`` (0 if unset); return the new value."""

    @abstractmethod
    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Block until every key is set; ``StoreTimeout`` names the ones still missing."""

    @abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set, without waiting."""

    @abstractmethod
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if its value is ``expected`` (or it is unset and
        ``expected`` is empty); return the value it holds afterwards."""

    @abstractmethod
    def delete_key(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""

    @abstractmethod
    def num_keys(self) -> int:
        """How many keys the store holds."""

    def close(self) -> None:  # noqa: B027 - optional: most stores hold nothing to release
        """Release sockets and threads; the store cannot be used afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- protocol

# command -> (fewest, most arguments)
_ARITY: dict[bytes, tuple[int, int]] = {
    b"set": (2, 2), b"get": (2, 2), b"wait": (2, MAX_KEYS + 1), b"add": (2, 2),
    b"check": (1, MAX_KEYS), b"compare_set": (3, 3), b"delete": (1, 1), b"num_keys": (0, 0),
    b"ping": (0, 0)}


def _is_number(raw: bytes, *, signed: bool = False, most: int = _MAX_TIMEOUT_DIGITS) -> bool:
    digits = raw[1:] if signed and raw[:1] == b"-" else raw
    return 0 < len(digits) <= most and digits.isdigit()


def parse_request(frames: Sequence[bytes]) -> tuple[bytes, bytes, list[bytes]]:
    """A request's ``(request id, command, arguments)``, checked against the protocol: a
    known command with as many arguments as it takes, keys of 1 to ``MAX_KEY_BYTES`` bytes,
    values of at most ``MAX_VALUE_BYTES``, numbers as short decimal text. Anything else is a
    ``ValueError`` saying what was wrong (nothing is allocated from what it claims)."""
    if len(frames) < 2:
        raise ValueError(f"{len(frames)} frame(s) after the identity (a request has a "
                         "request id and a command)")
    request_id, command, args = frames[0], frames[1], list(frames[2:])
    if len(request_id) != _REQUEST_ID.size:
        raise ValueError(f"a request id of {len(request_id)} B (it is {_REQUEST_ID.size})")
    arity = _ARITY.get(command)
    if arity is None:
        raise ValueError(f"unknown command {command[:32]!r}")
    if not arity[0] <= len(args) <= arity[1]:
        raise ValueError(f"{command.decode()} takes {arity[0]}"
                         + (f" to {arity[1]}" if arity[1] != arity[0] else "")
                         + f" argument(s), got {len(args)}")
    if command in (b"get", b"wait"):
        if not _is_number(args[0]):
            raise ValueError(f"timeout {args[0][:32]!r} is not a number of milliseconds")
        keys = args[1:]
    elif command == b"check":
        keys = args
    else:
        keys = args[:1]
    for key in keys:
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a key of {len(key)} B (keys are 1 to {MAX_KEY_BYTES} B)")
    if command == b"add" and not _is_number(args[1], signed=True, most=_MAX_INTEGER_DIGITS):
        raise ValueError(f"amount {args[1][:32]!r} is not an integer")
    values = args[1:] if command in (b"set", b"compare_set") else []
    for value in values:
        if len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"a value of {len(value)} B (at most {MAX_VALUE_BYTES} B)")
    return request_id, command, args


# --------------------------------------------------------------------------- server


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


class StoreServer:
    """Serves a key-value store on ``tcp://host:port`` from a background thread.

    ``port=0`` picks a free port (read it from ``.port``). A port already in use raises
    ``StoreError`` at once. ``host`` is loopback unless given: other hosts reach the store
    only where asked to. With ``auth_token`` (default ``RINGCOMM_AUTH_TOKEN``) only clients
    holding the same token get through, encrypted (``ringcomm.transport.auth``); every
    request is checked (``parse_request``) and one that is not the protocol's is refused
    with a logged reason, so no client can crash the server or make it allocate what a
    request merely claims.
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
        self._monitor = self._sock.get_monitor_socket(auth.HANDSHAKE_FAILED)
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

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
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

    # The loop below is the only code that touches the data, so it needs no locks.

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while True:
                wait_ms = None
                if self._deadlines:
                    wait_ms = int(max(0.0, (self._deadlines[0].deadline - time.monotonic()) * 1e3))
                events = dict(poller.poll(wait_ms))
                if self._wake in events:
                    break
                if self._monitor in events:
                    event = parse_monitor_message(self._monitor.recv_multipart())
                    auth.log_refusal(f"the store on port {self.port}", event["event"],
                                     int(event["value"]), event["endpoint"].decode())
                if self._sock in events:
                    while True:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(frames)
                self._expire()
        finally:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._wake.close(linger=0)

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
            if len(request) >= 2 and len(request[0]) == _REQUEST_ID.size:
                self._reply(identity, request[0], b"error", f"bad request: {err}".encode())
            return
        try:
            self._execute(identity, request_id, command, args)
        except ValueError as err:
            self._reply(identity, request_id, b"error", f"bad {command!r} request: {err}".encode())

    def _execute(self, identity: bytes, request_id: bytes, command: bytes,
                 args: list[bytes]) -> None:
        """Run a request ``parse_request`` has checked."""
        data = self._data
        if command == b"set":
            key, value = args
            data[key] = value
            self._wake_waiters(key)
            self._reply(identity, request_id, b"ok")
        elif command in (b"get", b"wait"):
            timeout_ms = int(args[0])
            keys = args[1:]
            if all(k in data for k in keys):
                self._answer_parked(identity, request_id, command, keys)
                return
            parked = _Parked(time.monotonic() + timeout_ms / 1e3, next(self._serial),
                             identity, request_id, command, keys)
            heapq.heappush(self._deadlines, parked)
            for k in keys:
                if k not in data:
                    self._waiters.setdefault(k, []).append(parked)
        elif command == b"add":
            key, amount = args
            before = data.get(key, b"0")
            if not _is_number(before, signed=True, most=_MAX_INTEGER_DIGITS):
                raise ValueError(f"the value under {key!r} is not an integer")
            value = str(int(before) + int(amount)).encode()
            data[key] = value
            self._wake_waiters(key)
            self._reply(identity, request_id, b"ok", value)
        elif command == b"check":
            self._reply(identity, request_id, b"ok",
                        b"1" if all(k in data for k in args) else b"0")
        elif command == b"compare_set":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                data[key] = desired
                self._wake_waiters(key)
                current = desired
            self._reply(identity, request_id, b"ok", current if current is not None else expected)
        elif command == b"delete":
            (key,) = args
            existed = data.pop(key, None) is not None
            self._reply(identity, request_id, b"ok", b"1" if existed else b"0")
        elif command == b"num_keys":
            self._reply(identity, request_id, b"ok", str(len(data)).encode())
        elif command == b"ping":
            self._reply(identity, request_id, b"ok")
        else:
            raise ValueError("unknown command")

    def _answer_parked(self, identity: bytes, request_id: bytes, command: bytes,
                       keys: list[bytes]) -> None:
        if command == b"get":
            self._reply(identity, request_id, b"ok", self._data[keys[0]])
        else:
            self._reply(identity, request_id, b"ok")

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
            self._reply(parked.identity, parked.request_id, b"timeout", *missing)


# --------------------------------------------------------------------------- client


class StoreClient(Store):
    """Talks to a ``StoreServer`` at ``"host:port"``. Safe to share between threads.

    Each thread gets its own socket, so a thread blocked in ``get`` never delays another
    thread's ``set``. ``timeout`` (seconds) is the default for blocking calls and also how
    long to wait for a server that does not answer.
    """

    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT,
                 auth_token: str | None = None) -> None:
        if timeout <= 0:
            raise ArgumentError(f"store timeout must be positive, got {timeout}")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ArgumentError(f"store address {address!r} is not of the form 'host:port'")
        self.address = address
        self.timeout = float(timeout)
        self._endpoint = f"tcp://{host.strip('[]')}:{port}"
        self._keys = auth.keys_for(config.value("auth_token") if auth_token is None
                                   else auth_token)
        self._ctx = zmq.Context(1)
        self._local = threading.local()
        self._sockets: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]] = []
        self._sockets_lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self._closed = False

    # -- plumbing

    def _socket(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        if self._closed:
            raise StoreError(f"store client for {self.address} is closed")
        pair = getattr(self._local, "pair", None)
        if pair is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            if self._keys is not None:
                self._keys.dial(sock)
            # connected means handshake done: a server that refuses this client's token
            # (or lack of one) shows as a failed handshake within a round trip
            monitor = sock.get_monitor_socket(auth.HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED)
            sock.connect(self._endpoint)
            pair = (sock, monitor)
            self._local.pair = pair
            self._local.connected = False
            with self._sockets_lock:
                self._sockets.append(pair)
        return pair

    def _request(self, command: bytes, args: Sequence[bytes], what: str,
                 timeout: float | None = None, server_wait: float | None = None) -> list[bytes]:
        """Send one request and return the reply's status and results.

        ``server_wait`` is how long the server may park the request; we allow a little
        more before deciding the server itself is gone.
        """
        sock, monitor = self._socket()
        request_id = _REQUEST_ID.pack(next(self._request_ids))
        limit = timeout if timeout is not None else self.timeout
        if server_wait is not None:
            limit = server_wait + max(2.0, 0.1 * server_wait)
        start = time.monotonic()
        deadline = start + limit
        # A fresh socket needs a moment to connect: a short (even zero) server_wait must
        # still get the server's answer, not "could not reach".
        reach_deadline = start + (max(server_wait, _MIN_REACH) if server_wait is not None
                                  else limit)
        sock.send_multipart([request_id, command, *args], copy=len(args) == 0 or
                            sum(len(a) for a in args) < 65536)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if not self._local.connected and now >= reach_deadline:
                raise StoreTimeout(
                    f"could not reach the store at {self.address} within "
                    f"{reach_deadline - start:.1f} s ({what}); check the address and that "
                    "rank 0 (or `python -m ringcomm.bootstrap.store`) is serving it")
            if remaining <= 0:
                if not self._local.connected:
                    raise StoreTimeout(
                        f"could not reach the store at {self.address} within {limit:.1f} s "
                        f"({what}); check the address and that rank 0 (or "
                        "`python -m ringcomm.bootstrap.store`) is serving it")
                raise StoreTimeout(
                    f"the store at {self.address} did not answer within {limit:.1f} s ({what})")
            if not self._local.connected:
                remaining = min(remaining, reach_deadline - now)
            events = dict(poller.poll(int(max(remaining, 0) * 1e3)))
            if monitor in events:
                message = parse_monitor_message(monitor.recv_multipart())
                event = message["event"]
                refused = auth.handshake_failure(event, int(message["value"]))
                if refused is not None:
                    self._forget_socket()
                    mine = "holds a token" if self._keys is not None else "holds no token"
                    raise AuthError(
                        f"the store at {self.address} refused this client during {what}: "
                        f"{refused}. Give every rank and the store the same "
                        f"RINGCOMM_AUTH_TOKEN (or init(auth_token=)); this client {mine}")
                if event == auth.HANDSHAKE_SUCCEEDED:
                    self._local.connected = True
                elif event == zmq.EVENT_DISCONNECTED:
                    self._local.connected = False
                    self._forget_socket()
                    raise StoreError(
                        f"lost the connection to the store at {self.address} during {what}; "
                        "the process serving it (rank 0 by default) has probably exited")
            if sock in events:
                reply = sock.recv_multipart()
                if len(reply) < 2 or reply[0] != request_id:
                    continue  # a late answer to a request that already timed out here
                return reply[1:]

    def _forget_socket(self) -> None:
        pair = self._local.pair
        self._local.pair = None
        with self._sockets_lock:
            if pair in self._sockets:
                self._sockets.remove(pair)
        pair[0].disable_monitor()
        for s in pair:
            s.close(linger=0)

    def _ok(self, reply: list[bytes], what: str) -> list[bytes]:
        status, results = reply[0], reply[1:]
        if status == b"ok":
            return results
        if status == b"timeout":
            raise StoreTimeout(f"timed out waiting for key(s) {_names(results)} in the store at "
                               f"{self.address} ({what}); a rank that should set them has not "
                               "arrived or has failed")
        raise StoreError(f"the store at {self.address} refused {what}: "
                         f"{b' '.join(results).decode(errors='replace')}")

    def _blocking(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else float(timeout)
        if t < 0:
            raise ArgumentError(f"timeout must not be negative, got {t}")
        return t

    # -- the Store interface

    def set(self, key: str, value: str | bytes) -> None:
        k, v = _key_bytes(key), _value_bytes(value)
        self._ok(self._request(b"set", [k, v], f"set {key!r}"), f"set {key!r}")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        k, t = _key_bytes(key), self._blocking(timeout)
        what = f"get {key!r}"
        reply = self._request(b"get", [str(int(t * 1e3)).encode(), k], what, server_wait=t)
        return self._ok(reply, what)[0]

    def add(self, key: str, amount: int) -> int:
        if not isinstance(amount, int):
            raise ArgumentError(f"add takes an int amount, got {type(amount).__name__}")
        what = f"add {key!r}"
        return int(self._ok(self._request(b"add", [_key_bytes(key), str(amount).encode()], what),
                            what)[0])

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        ks, t = _key_list(keys), self._blocking(timeout)
        if not ks:
            return
        what = f"wait for {len(ks)} key(s)"  # the timeout names the missing ones
        self._ok(self._request(b"wait", [str(int(t * 1e3)).encode(), *ks], what, server_wait=t),
                 what)

    def check(self, keys: Sequence[str]) -> bool:
        ks = _key_list(keys)
        return self._ok(self._request(b"check", ks, "check"), "check")[0] == b"1"

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        what = f"compare_set {key!r}"
        args = [_key_bytes(key), _value_bytes(expected), _value_bytes(desired)]
        return self._ok(self._request(b"compare_set", args, what), what)[0]

    def delete_key(self, key: str) -> bool:
        what = f"delete_key {key!r}"
        return self._ok(self._request(b"delete", [_key_bytes(key)], what), what)[0] == b"1"

    def num_keys(self) -> int:
        return int(self._ok(self._request(b"num_keys", [], "num_keys"), "num_keys")[0])

    def ping(self, timeout: float | None = None) -> None:
        """Raise ``StoreTimeout`` unless the server answers within ``timeout`` s."""
        self._ok(self._request(b"ping", [], "ping", timeout=timeout), "ping")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._sockets_lock:
            for pair in self._sockets:
                pair[0].disable_monitor()
                for s in pair:
                    s.close(linger=0)
            self._sockets.clear()
        self._ctx.term()

    def __repr__(self) -> str:
        return f"StoreClient({self.address!r})"


# --------------------------------------------------------------------------- adapters


class PrefixStore(Store):
    """Keys of ``store`` under ``prefix/``, so that several users share one store."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix.rstrip("/") + "/"
        self.store = store
        self.timeout = store.timeout

    def _k(self, key: str) -> str:
        return self.prefix + (key.decode() if isinstance(key, bytes) else key)

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self._k(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._k(key), amount)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        self.store.wait([self._k(k) for k in keys], timeout)

    def check(self, keys: Sequence[str]) -> bool:
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        return self.store.check([self._k(k) for k in keys])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.store.compare_set(self._k(key), expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self._k(key))

    def num_keys(self) -> int:
        return self.store.num_keys()

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.store!r})"


class TorchStore(Store):
    """A torch c10d store (``TCPStore``, ``FileStore``, ``PrefixStore``...) behind our
    interface, with its timeouts turned into ``StoreTimeout`` naming the keys."""

    def __init__(self, store: Any, timeout: float | None = None) -> None:
        self.store = store
        if timeout is None:
            timeout = store.timeout.total_seconds() if hasattr(store, "timeout") else None
        self.timeout = float(timeout or DEFAULT_TIMEOUT)

    def _call(self, what: str, keys: Sequence[str], fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as err:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError
            text = str(err)
            if "timeout" in text.lower() or "timed out" in text.lower():
                raise StoreTimeout(f"timed out waiting for key(s) "
                                   f"{', '.join(map(repr, keys))} in torch's store ({what}): "
                                   f"{text.splitlines()[0] if text else ''}") from err
            raise StoreError(f"torch's store failed during {what}: {text}") from err

    def _with_timeout(self, timeout: float | None, what: str, keys: Sequence[str], fn: Any,
                      *args: Any) -> Any:
        previous = self.store.timeout
        self.store.set_timeout(timedelta(seconds=self.timeout if timeout is None else timeout))
        try:
            return self._call(what, keys, fn, *args)
        finally:
            self.store.set_timeout(previous)

    def set(self, key: str, value: str | bytes) -> None:
        self._call(f"set {key!r}", [key], self.store.set, key, _value_bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return bytes(self._with_timeout(timeout, f"get {key!r}", [key], self.store.get, key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(f"add {key!r}", [key], self.store.add, key, amount))

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        keys = list(keys)
        t = timedelta(seconds=self.timeout if timeout is None else timeout)
        self._call("wait", keys, self.store.wait, keys, t)

    def check(self, keys: Sequence[str]) -> bool:
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        return bool(self._call("check", list(keys), self.store.check, list(keys)))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return bytes(self._call(f"compare_set {key!r}", [key], self.store.compare_set, key,
                                _value_bytes(expected), _value_bytes(desired)))

    def delete_key(self, key: str) -> bool:
        return bool(self._call(f"delete_key {key!r}", [key], self.store.delete_key, key))

    def num_keys(self) -> int:
        return int(self._call("num_keys", [], self.store.num_keys))

    def __repr__(self) -> str:
        return f"TorchStore({self.store!r})"


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m ringcomm.bootstrap.store --port P``: serve a store until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m ringcomm.bootstrap.store",
                                     description=main.__doc__)
    parser.add_argument("--host", default=LOOPBACK,
                        help="address to listen on (default: loopback, for ranks of this "
                        "host only; 0.0.0.0 for every interface, then set "
                        "RINGCOMM_AUTH_TOKEN too)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("MASTER_PORT", 29500)))
    args = parser.parse_args(argv)
    try:
        server = StoreServer(args.host, args.port)
    except (StoreError, ArgumentError) as err:
        raise SystemExit(f"error: {err}") from None
    locked = "clients must hold RINGCOMM_AUTH_TOKEN" if config.value("auth_token") else \
        "no RINGCOMM_AUTH_TOKEN: any client that reaches it is served"
    print(f"ringcomm store serving on {args.host}:{server.port} ({locked})", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


if __name__ == "__main__":
    main()
