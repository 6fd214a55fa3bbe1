"""Rendezvous store: a small key-value service so that ranks can find each other.

Ranks publish their addresses under keys and block until their peers' keys appear. The
interface (``Store``) is the one torch's c10d stores have, so the same code rendezvous
through our own server (``StoreServer``, in ``store_server``, with ``StoreClient`` here,
over ZeroMQ; the wire protocol is ``store_wire``'s) or through the TCPStore that torchrun's
agent already serves (``TorchStore``).

The client keeps its own deadline and watches its connection, so a server that is gone
gives an error, not a hang. A server that is going away with the group that served it (the
store rank 0 serves, in the moments its group closes) tells a client it has never served
so (``leaving``), and the client asks again on a new connection until its deadline: a
rank's next ``init`` on the same address reaches the next group's store, never the closing
one. A client that loses its connection before any server has answered it does the same
(the closing store went away under its first request). Run a store stand-alone with
``python -m ringcomm.bootstrap.store --port P``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..core import config, waits
from ..errors import ArgumentError, AuthError, StoreError, StoreTimeout
from ..transport import auth
from .store_server import LOOPBACK, StoreServer
from .store_wire import (
    LEAVING,
    MAX_FRAME_BYTES,
    MAX_KEY_BYTES,
    MAX_KEYS,
    MAX_VALUE_BYTES,
    OK,
    REQUEST_ID,
    TIMEOUT,
    new_client_id,
    parse_request,
    socket_identity,
)

__all__ = ["DEFAULT_TIMEOUT", "LOOPBACK", "MAX_KEYS", "MAX_KEY_BYTES", "MAX_VALUE_BYTES",
           "PrefixStore", "Store", "StoreClient", "StoreServer", "TorchStore", "main",
           "parse_request"]

log = logging.getLogger("ringcomm.bootstrap.store")

DEFAULT_TIMEOUT = 300.0

_MIN_REACH = 1.0  # s: the least a client waits to connect before "could not reach"
_RETRY_PAUSE = 0.05  # s: between asking a store that is going away and asking again
_LOST, _CUT = "lost", "cut"  # why a try of a request ended without an answer (``_attempt``)


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
    found = [_key_bytes(k) for k in keys]
    if len(found) > MAX_KEYS:
        raise ArgumentError(f"{len(found)} keys in one wait or check; the store takes at most "
                            f"{MAX_KEYS}")
    return found


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


# --------------------------------------------------------------------------- client


class StoreClient(Store):
    """Talks to a ``StoreServer`` at ``"host:port"``. Safe to share between threads.

    Each thread gets its own socket, so a thread blocked in ``get`` never delays another
    thread's ``set``; every socket carries this client's id (``store_wire.socket_identity``),
    so a store that is going away still serves all of them. ``timeout`` (seconds) is the
    default for blocking calls and also how long to wait for a server that does not answer;
    this one, and a blocking call's, may be any size: longer than a week (``inf`` included)
    is a week (``ringcomm.core.waits.MAX_TIMEOUT``).
    """

    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT,
                 auth_token: str | None = None) -> None:
        if not timeout > 0:
            raise ArgumentError(f"store timeout must be positive, got {timeout}")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ArgumentError(f"store address {address!r} is not of the form 'host:port'")
        self.address = address
        self.timeout = waits.clamp(timeout)
        self._endpoint = f"tcp://{host.strip('[]')}:{port}"
        self._keys = auth.keys_for(config.value("auth_token") if auth_token is None
                                   else auth_token)
        self._ctx = zmq.Context(1)
        self._local = threading.local()
        self._sockets: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]] = []
        self._sockets_lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self._client_id = new_client_id()
        self._socket_numbers = itertools.count()
        self._answered = False  # whether any store has answered this client yet
        self.turned_away = False  # whether a store going away has turned it away (once)
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
            sock.setsockopt(zmq.ROUTING_ID,
                            socket_identity(self._client_id, next(self._socket_numbers)))
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

        ``server_wait`` is how long the server may park the request (it goes first among
        the arguments, in ms, written here); we allow a little more before deciding the
        server itself is gone. A store that is going away (``leaving``), or a connection
        lost before any store has answered this client, is asked again on a new connection
        after a pause, until the deadline: the next store at the address answers then.
        """
        limit = timeout if timeout is not None else self.timeout
        if server_wait is not None:
            limit = server_wait + max(2.0, 0.1 * server_wait)
        start = time.monotonic()
        deadline = start + limit
        # A fresh socket needs a moment to connect: a short (even zero) server_wait must
        # still get the server's answer, not "could not reach".
        reach_deadline = start + (max(server_wait, _MIN_REACH) if server_wait is not None
                                  else limit)
        turned_away = cut = False
        while True:
            sent = list(args)
            if server_wait is not None:  # what is left of it, when asked again
                left = max(0.0, server_wait - (time.monotonic() - start))
                sent.insert(0, str(int(left * 1e3)).encode())
            reply = self._attempt(command, sent, what, start, deadline, reach_deadline,
                                  turned_away, may_be_cut=not cut)
            if isinstance(reply, list) and reply[0] != LEAVING:
                self._answered = True
                return reply
            cut = reply == _CUT
            if isinstance(reply, list):  # a store going away; the next one on a new socket
                turned_away = self.turned_away = True
                self._forget_socket()
            if time.monotonic() + _RETRY_PAUSE >= min(deadline, reach_deadline):
                raise StoreTimeout(
                    f"the store at {self.address} is going away (the group that served it "
                    f"is closing) and no other store answered there within "
                    f"{time.monotonic() - start:.1f} s ({what})" if turned_away else
                    f"lost the connection to the store at {self.address} before it answered, "
                    f"and no store answered there within {time.monotonic() - start:.1f} s "
                    f"({what})")
            time.sleep(_RETRY_PAUSE)

    def _attempt(self, command: bytes, args: Sequence[bytes], what: str, start: float,
                 deadline: float, reach_deadline: float, turned_away: bool,
                 may_be_cut: bool) -> list[bytes] | str:
        """One try of ``_request`` on this thread's socket: the reply, or, before any store
        has answered this client, ``_LOST`` where its connection was lost and ``_CUT`` where
        the store closed it in the handshake (``may_be_cut``: once in a row is a store that
        was going away as it came, twice is a store that refuses this client's token)."""
        sock, monitor = self._socket()
        request_id = REQUEST_ID.pack(next(self._request_ids))
        sock.send_multipart([request_id, command, *args], copy=len(args) == 0 or
                            sum(len(a) for a in args) < 65536)
        unreachable = (f"could not reach the store at {self.address} within {{:.1f}} s "
                       f"({what}); check the address and that rank 0 (or `python -m "
                       "ringcomm.bootstrap.store`) is serving it"
                       + (" (a store there was going away with its group)" if turned_away
                          else ""))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if not self._local.connected and now >= reach_deadline:
                raise StoreTimeout(unreachable.format(reach_deadline - start))
            if remaining <= 0:
                if not self._local.connected:
                    raise StoreTimeout(unreachable.format(deadline - start))
                raise StoreTimeout(f"the store at {self.address} did not answer within "
                                   f"{deadline - start:.1f} s ({what})")
            if not self._local.connected:
                remaining = min(remaining, reach_deadline - now)
            events = dict(poller.poll(waits.poll_ms(remaining)))
            if monitor in events:
                message = parse_monitor_message(monitor.recv_multipart())
                event = message["event"]
                refused = auth.handshake_failure(event, int(message["value"]))
                if refused is not None:
                    self._forget_socket()
                    if may_be_cut and not self._answered and \
                            event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                        return _CUT
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
                    if not self._answered:  # the store it reached went away: ask again
                        return _LOST
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
        if status == OK:
            return results
        if status == TIMEOUT:
            raise StoreTimeout(f"timed out waiting for key(s) {_names(results)} in the store at "
                               f"{self.address} ({what}); a rank that should set them has not "
                               "arrived or has failed")
        raise StoreError(f"the store at {self.address} refused {what}: "
                         f"{b' '.join(results).decode(errors='replace')}")

    def _blocking(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else float(timeout)
        if not t >= 0:
            raise ArgumentError(f"timeout must not be negative, got {t}")
        return waits.clamp(t)

    # -- the Store interface

    def set(self, key: str, value: str | bytes) -> None:
        k, v = _key_bytes(key), _value_bytes(value)
        self._ok(self._request(b"set", [k, v], f"set {key!r}"), f"set {key!r}")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        k, t = _key_bytes(key), self._blocking(timeout)
        what = f"get {key!r}"
        reply = self._request(b"get", [k], what, server_wait=t)
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
        self._ok(self._request(b"wait", ks, what, server_wait=t), what)

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

    def leave(self, group: str, rank: int, timeout: float | None = None) -> None:
        """Say that rank ``rank`` of ``group`` is done with the store: this client sends
        nothing more for that group. The store the group's rank 0 serves goes away once
        its ranks have all left (``StoreServer.own``); a store nobody owns notes nothing.
        ``timeout`` bounds the wait for the answer (default: the client's)."""
        what = f"leave {group!r} (rank {rank})"
        self._ok(self._request(b"leave", [_key_bytes(group), str(int(rank)).encode()], what,
                               timeout=timeout), what)

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


def serve(host: str, port: int) -> None:
    """Serve a store on ``host:port`` until interrupted (``ringcomm store``). A port that is
    not one is an ``ArgumentError``; one that cannot be bound a ``StoreError``."""
    server = StoreServer(host, port)
    locked = "clients must hold RINGCOMM_AUTH_TOKEN" if config.value("auth_token") else \
        "no RINGCOMM_AUTH_TOKEN: any client that reaches it is served"
    print(f"ringcomm store serving on {host}:{server.port} ({locked})", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


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
        serve(args.host, args.port)
    except ArgumentError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except StoreError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
