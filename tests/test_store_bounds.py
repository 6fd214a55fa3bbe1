"""What a stranger and a careless caller can do to the store, bounded (issue 35, findings 2-4):
timeouts of any size, whole messages, parked requests and waited keys per client, a client's
state dropped when it leaves, and refusals logged at a bounded rate.

Everything runs for real on 127.0.0.1: a store on a free port, strangers as raw ZeroMQ
sockets and plain TCP, ranks as threads calling ``ringcomm.init``. What the store holds is
read from its own counters (``StoreServer.held``), not from the process's memory.
"""

from __future__ import annotations

import logging
import math
import re
import socket
import struct
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import zmq

import ringcomm
from ringcomm import ArgumentError, StoreError
from ringcomm.bootstrap.store import MAX_KEYS, MAX_VALUE_BYTES, StoreClient, StoreServer
from ringcomm.bootstrap.store_server import MAX_PARKED, MAX_PARKED_KEY_BYTES, MAX_STORED_BYTES
from ringcomm.bootstrap.store_wire import MAX_MESSAGE_BYTES
from ringcomm.core import waits

HOST = "127.0.0.1"
JOIN = 20.0  # s: the most a helper thread may take; one still running is a hang


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    srv = StoreServer(HOST, 0, auth_token="")
    try:
        yield srv
    finally:
        srv.close()


class Stranger:
    """A plain ZeroMQ DEALER at the store: sends what it likes, reads what comes back."""

    def __init__(self, address: str, identity: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(f"tcp://{address}")

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def reply(self, timeout: float = 10.0) -> list[bytes]:
        assert self.sock.poll(int(timeout * 1e3)), "no answer"
        return self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def rid(n: int) -> bytes:
    return n.to_bytes(8, "little")


def still_serves(address: str) -> None:
    """A real client is served: set, get, and a get parked until another client's set."""
    with StoreClient(address, timeout=5, auth_token="") as a, \
            StoreClient(address, timeout=5, auth_token="") as b:
        a.set("still", b"here")
        assert b.get("still") == b"here"
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(b.get("later", timeout=5)), daemon=True)
        t.start()
        time.sleep(0.1)
        a.set("later", b"yes")
        t.join(JOIN)
        assert got == [b"yes"]


# ------------------------------------------------------------------- timeouts (finding 2)


@pytest.mark.timeout(30)
def test_requests_with_huge_timeouts_are_parked_and_the_store_serves_on(server):
    """Timeouts of 20 digits of ms, 2**40 ms and 100 s past 2**31 ms (the longest wait a C
    int takes), in gets and waits (once such a request killed the store's serving thread)."""
    stranger = Stranger(server.address)
    asked = [(command, ms) for command in (b"get", b"wait")
             for ms in (b"9" * 20, str(1 << 40).encode(), str((1 << 31) + 100_000).encode())]
    try:
        for n, (command, ms) in enumerate(asked):
            stranger.send(rid(n), command, ms, b"huge/key")
        assert _wait_for(lambda: server.held()["parked"] == len(asked))
        still_serves(server.address)
        with StoreClient(server.address, timeout=5, auth_token="") as client:
            client.set("huge/key", b"set at last")
        replies = sorted(stranger.reply() for _ in asked)
        assert replies == [[rid(n), b"ok", *([b"set at last"] if command == b"get" else [])]
                           for n, (command, _) in enumerate(asked)]
    finally:
        stranger.close()


@pytest.mark.timeout(30)
def test_a_client_takes_blocking_calls_of_any_timeout(server):
    timeouts = [math.inf, 1e12, 2.2e6]
    got: dict[float, list[object]] = {t: [] for t in timeouts}

    def wait_then_get(waiter: StoreClient, timeout: float) -> None:
        try:
            waiter.wait(["k"], timeout=timeout)
            got[timeout].append(waiter.get("k", timeout=timeout))
            got[timeout].append(waiter.get("k"))  # the client's own timeout
        except BaseException as err:  # noqa: BLE001 - handed to the test
            got[timeout].append(err)

    waiters = [StoreClient(server.address, timeout=t, auth_token="") for t in timeouts]
    try:
        assert all(w.timeout == waits.MAX_TIMEOUT for w in waiters)
        threads = [threading.Thread(target=wait_then_get, args=(w, t), daemon=True)
                   for w, t in zip(waiters, timeouts, strict=True)]
        for t in threads:
            t.start()
        assert _wait_for(lambda: server.held()["parked"] == len(timeouts))
        with StoreClient(server.address, timeout=5, auth_token="") as setter:
            setter.set("k", b"v")
        for t in threads:
            t.join(JOIN)
        assert got == {t: [b"v", b"v"] for t in timeouts}
    finally:
        for w in waiters:
            w.close()


def _group(timeout: object, world: int = 2) -> dict[int, object]:
    """``world`` ranks on threads init with ``timeout``, allreduce and close: each rank's
    result (its sum, or the error it raised)."""
    port = free_port()
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            with ringcomm.init(rank=r, world_size=world, store=f"{HOST}:{port}",
                               timeout=timeout) as comm:
                x = np.full(4, r + 1.0)
                comm.allreduce(x)
                results[r] = (x.tolist(), comm.timeout)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            results[r] = err

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    assert not any(t.is_alive() for t in threads), f"a rank hangs: {results}"
    return results


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [timedelta(days=23), timedelta(days=30), math.inf, 2_000_000,
                                     timedelta(days=7)],
                         ids=["23-days", "30-days", "inf", "2e6-s", "7-days"])
def test_init_takes_a_timeout_of_any_size_on_every_rank(timeout):
    """Longer than ``waits.MAX_TIMEOUT`` is taken as that, the same on every rank (once these
    raised OverflowError on some ranks while others waited)."""
    assert _group(timeout) == {r: ([3.0] * 4, waits.MAX_TIMEOUT) for r in range(2)}


# ------------------------------------------------------------- whole messages (finding 3)


def _frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    """One ZMTP 3 frame, written here apart from the store's own encoder."""
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body


def _ready(socket_type: bytes, identity: bytes = b"") -> bytes:
    props = b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    if identity:
        props += b"\x08Identity" + struct.pack(">I", len(identity)) + identity
    return _frame(b"\x05READY" + props, command=True)


GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)


class RawStranger:
    """A ZeroMQ DEALER written by hand on a TCP socket: it can send a message frame by frame
    and leave its replies unread, which a libzmq socket would not let it."""

    def __init__(self, address: str, identity: bytes = b"") -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.sendall(GREETING + _ready(b"DEALER", identity))
        got = b""
        while len(got) < 64:
            more = self.sock.recv(64 - len(got))
            assert more, "the store closed the connection in the handshake"
            got += more
        assert got[:1] == b"\xff" and got[10] == 3 and got[12:16] == b"NULL"

    def send(self, data: bytes) -> bool:
        """Whether ``data`` went out (False: the store had closed the connection)."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def closed_by_the_store(self, within: float = 10.0) -> bool:
        """Whether the store closes the connection within ``within`` s (what comes before
        that, replies included, is read and dropped)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                if not self.sock.recv(1 << 20):
                    return True
            except TimeoutError:
                return False
            except OSError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()


def _wait_for(check, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.timeout(60)
def test_a_message_of_many_large_frames_is_refused_at_its_bound_not_held(server):
    """Frames under the frame limit, MORE set on each: once their sum passes the message
    bound the store closes the connection, having held no more than the bound (once it
    held 48 frames of 32 MiB)."""
    stranger = RawStranger(server.address)
    try:
        body = bytes(32 << 20)
        stranger.send(_frame(rid(1), more=True) + _frame(b"set", more=True))
        sent = 0
        while sent < 8 and stranger.send(_frame(body, more=True)):  # 256 MiB, if it took it
            sent += 1
        assert stranger.closed_by_the_store()
        assert sent * len(body) <= MAX_MESSAGE_BYTES + 2 * len(body)  # cut off on the way
    finally:
        stranger.close()
    held = server.held()
    assert 0 < held["most_message_bytes"] <= MAX_MESSAGE_BYTES
    assert _wait_for(lambda: server.held()["message_bytes"] == 0)
    still_serves(server.address)


@pytest.mark.timeout(30)
def test_a_message_of_too_many_frames_is_refused_at_its_bound(server):
    stranger = RawStranger(server.address)
    try:
        stranger.send(_frame(rid(1), more=True) + _frame(b"wait", more=True)
                      + _frame(b"1000", more=True) + _frame(b"", more=True) * (1 << 17))
        assert stranger.closed_by_the_store()
    finally:
        stranger.close()
    assert server.held()["parked"] == 0
    still_serves(server.address)


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_a_whole_message_up_to_its_bound_is_served(server):
    """The largest request the protocol has (a compare_set of two values of the most) is
    taken whole, from a real client."""
    value = bytes(MAX_VALUE_BYTES)
    with StoreClient(server.address, timeout=20, auth_token="") as client:
        assert client.compare_set("both", b"", value) == value
        assert client.compare_set("both", value, value[:-1] + b"\1") == value[:-1] + b"\1"
    assert server.held()["most_message_bytes"] > 2 * MAX_VALUE_BYTES - (1 << 20)


# ------------------------------------------------------------ parked requests (finding 3)


@pytest.mark.timeout(30)
def test_the_parked_requests_of_a_client_that_leaves_are_dropped(server):
    stranger = Stranger(server.address, identity=b"parker")
    try:
        for n in range(200):
            stranger.send(rid(n), b"get", b"9" * 12, f"never/{n}".encode() * 50)
        assert _wait_for(lambda: server.held()["parked"] == 200)
        assert server.held()["waited_keys"] == 200
    finally:
        stranger.close()  # (once, its 20,000 parked gets kept 100 MB until their deadline)
    assert _wait_for(lambda: server.held()["parked"] == 0, within=5)
    held = server.held()
    assert (held["waited_keys"], held["parked_keys"], held["parking_clients"]) == (0, 0, 0)
    still_serves(server.address)


@pytest.mark.timeout(30)
def test_a_client_parks_a_bounded_number_of_requests(server):
    stranger = Stranger(server.address)
    try:
        asked = MAX_PARKED + 1000
        for n in range(asked):
            stranger.send(rid(n), b"wait", b"60000", f"never/{n}".encode())
        refused = [stranger.reply() for _ in range(asked - MAX_PARKED)]
        assert all(r[1] == b"error" and b"requests parked already" in r[2] for r in refused)
        assert {int.from_bytes(r[0], "little") for r in refused} == set(range(MAX_PARKED, asked))
        assert server.held()["parked"] == MAX_PARKED
        still_serves(server.address)  # another client parks as before
    finally:
        stranger.close()
    assert _wait_for(lambda: server.held()["parked"] == 0, within=5)


@pytest.mark.timeout(30)
def test_a_wait_on_too_many_keys_is_refused(server):
    with StoreClient(server.address, timeout=5, auth_token="") as client:
        with pytest.raises(ArgumentError, match=f"at most {MAX_KEYS}"):
            client.wait([f"k{i}" for i in range(MAX_KEYS + 1)])
        with pytest.raises(ArgumentError, match=f"at most {MAX_KEYS}"):
            client.check([f"k{i}" for i in range(MAX_KEYS + 1)])
    # a stranger's wait on 65,536 keys (once it took 880 MB) is cut off as it comes
    stranger = RawStranger(server.address)
    try:
        keys = b"".join(_frame(b"k%05d" % i, more=i < (1 << 16) - 1) for i in range(1 << 16))
        stranger.send(_frame(rid(1), more=True) + _frame(b"wait", more=True)
                      + _frame(b"60000", more=True) + keys)
        assert stranger.closed_by_the_store()
    finally:
        stranger.close()
    # as many keys as a request may name, but more bytes of keys than a client may park
    stranger = Stranger(server.address)
    try:
        long_keys = [b"%05d" % i + bytes(600) for i in range(MAX_KEYS)]
        stranger.send(rid(2), b"wait", b"60000", *long_keys)
        status, why = stranger.reply()[1:]
        assert status == b"error" and b"B of keys" in why, why
        assert server.held()["parked"] == 0
        short = [b"k%05d" % i for i in range(MAX_KEYS)]  # within the bound: parked
        stranger.send(rid(3), b"wait", b"60000", *short)
        assert _wait_for(lambda: server.held()["parked"] == 1)
        assert server.held()["parked_keys"] <= MAX_PARKED_KEY_BYTES
    finally:
        stranger.close()
    assert _wait_for(lambda: server.held()["parked"] == 0, within=5)
    still_serves(server.address)


@pytest.mark.timeout(30)
def test_replies_a_client_leaves_unread_are_bounded(server):
    """A client that asks and never reads: its connection is closed once the replies queued
    for it pass the bound, not kept growing."""
    value = bytes(1 << 20)
    with StoreClient(server.address, timeout=5, auth_token="") as client:
        client.set("mib", value)
    stranger = RawStranger(server.address)
    stranger.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    try:
        ask = b"".join(_frame(rid(n), more=True) + _frame(b"get", more=True)
                       + _frame(b"0", more=True) + _frame(b"mib") for n in range(2000))
        stranger.send(ask)  # 2000 replies of 1 MiB, if the store queued them all
        assert _wait_for(lambda: server.held()["connections"] == 0, within=10)
    finally:
        stranger.close()
    still_serves(server.address)


@pytest.mark.timeout(30)
def test_small_replies_a_client_leaves_unread_are_bounded_too(server):
    """Replies of a few KiB are copied and sent untracked (a tracker starts pyzmq's garbage
    collector threads for the process's life); they count all the same, and a client that
    never reads them is closed at the bound."""
    with StoreClient(server.address, timeout=5, auth_token="") as client:
        client.set("small", bytes(8 << 10))
    stranger = RawStranger(server.address)
    stranger.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    try:
        ask = b"".join(_frame(rid(n), more=True) + _frame(b"get", more=True)
                       + _frame(b"0", more=True) + _frame(b"small") for n in range(6000))
        stranger.send(ask)  # 6000 replies of 8 KiB: more pieces than a client may leave
        assert _wait_for(lambda: server.held()["connections"] == 0, within=10)
    finally:
        stranger.close()
    still_serves(server.address)


# ------------------------------------------------------------------- the log (finding 4)

STORE_LOG = "ringcomm.bootstrap.store"


def _lines(caplog, *names: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name in names]


@pytest.mark.timeout(30)
def test_a_flood_of_bad_requests_is_logged_at_a_bounded_rate_with_a_count(server, caplog):
    """Each bad request is refused (and answered), but the log gets a few lines a second,
    not one per request (once 1.27 MB/s from one client)."""
    caplog.set_level(logging.WARNING, logger="ringcomm")
    stranger = Stranger(server.address)
    flood = 1000
    started = time.monotonic()
    try:
        for n in range(flood):
            stranger.send(rid(n), b"explode", b"x" * 100)
        replies = [stranger.reply() for _ in range(flood)]
    finally:
        stranger.close()
    elapsed = time.monotonic() - started
    assert all(r[1] == b"error" and b"unknown command" in r[2] for r in replies)
    said = _lines(caplog, STORE_LOG)
    assert 1 <= len(said) <= 10 + elapsed * 1.0 + 2, (len(said), elapsed)
    # once the flood is over, one line says how many were held back
    assert _wait_for(lambda: any("similar lines suppressed" in line
                                 for line in _lines(caplog, STORE_LOG)), within=5)
    counted = sum(int(re.search(r"(\d+) similar lines? suppressed", line).group(1))
                  for line in _lines(caplog, STORE_LOG) if "suppressed" in line)
    assert counted + len([s for s in said if "refused a request" in s]) == flood


@pytest.mark.timeout(30)
def test_strangers_garbage_is_logged_at_a_bounded_rate(server, caplog):
    caplog.set_level(logging.WARNING, logger="ringcomm")
    host, port = server.address.rsplit(":", 1)
    started = time.monotonic()
    for n in range(300):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" if n % 2 else GREETING + _frame(b"x" * 9))
    elapsed = time.monotonic() - started
    assert _wait_for(lambda: server.held()["connections"] == 0)
    said = _lines(caplog, STORE_LOG, "ringcomm")
    assert 1 <= len(said) <= 10 + elapsed + 2, (len(said), elapsed)
    still_serves(server.address)


@pytest.mark.timeout(60)
def test_plain_zeromq_greetings_to_a_store_with_a_token_are_logged_at_a_bounded_rate(caplog):
    """With a token, each plain ZeroMQ peer is refused in the handshake: once, one line each
    (570-750 kB/s from one stranger, no token needed)."""
    caplog.set_level(logging.WARNING, logger="ringcomm")
    with StoreServer(HOST, 0, auth_token="a token of the tests") as server:
        ctx = zmq.Context()
        started = time.monotonic()
        try:
            for _ in range(2):
                socks = []
                for _ in range(60):
                    sock = ctx.socket(zmq.DEALER)
                    sock.linger = 0
                    sock.connect(f"tcp://{server.address}")
                    socks.append(sock)
                time.sleep(0.2)  # their handshakes fail meanwhile
                for sock in socks:
                    sock.close()
        finally:
            ctx.term()
        elapsed = time.monotonic() - started
        time.sleep(0.3)
        said = _lines(caplog, STORE_LOG, "ringcomm")
        assert 1 <= len(said) <= 10 + elapsed + 2, (len(said), elapsed, said[:3])
        with StoreClient(server.address, timeout=5, auth_token="a token of the tests") as c:
            c.set("k", b"v")
            assert c.get("k") == b"v"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_data_the_store_holds_is_bounded_as_a_whole(server):
    value = bytes(MAX_VALUE_BYTES)
    with StoreClient(server.address, timeout=30, auth_token="") as client:
        stored = 0
        with pytest.raises(StoreError, match="it holds at most"):
            while True:
                client.set(f"big/{stored}", value)
                stored += 1
        assert stored == MAX_STORED_BYTES // (MAX_VALUE_BYTES + 64)
        assert server.held()["stored_bytes"] <= MAX_STORED_BYTES
        client.set("big/0", b"small now")  # what shrinks an entry is taken
        client.set("another", value)  # and makes room
        assert client.delete_key("another") and client.delete_key("big/1")
        client.set("big/1", value)
        assert client.get("big/0") == b"small now"
