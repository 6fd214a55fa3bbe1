"""What a stranger and a careless caller can do to the store, bounded (issue 35, findings 2-4):
timeouts of any size, whole messages, parked requests and waited keys per client, a client's
state dropped when it leaves, and refusals logged at a bounded rate.

Everything runs for real on 127.0.0.1: a store on a free port, strangers as raw ZeroMQ
sockets and plain TCP, ranks as threads calling ``ringcomm.init``. What the store holds is
read from its own counters (``StoreServer.held``), not from the process's memory.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import zmq

import ringcomm
from ringcomm.bootstrap.store import StoreClient, StoreServer
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


# --------------------------------------------------------------------------- timeouts (finding 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ms", [b"9" * 20, str(1 << 31).encode(), str(1 << 40).encode()],
                         ids=["20-digits", "2^31", "2^40"])
@pytest.mark.parametrize("command", [b"get", b"wait"])
def test_a_request_with_a_huge_timeout_is_parked_and_the_store_serves_on(server, command, ms):
    stranger = Stranger(server.address)
    try:
        stranger.send(rid(1), command, ms, b"huge/key")
        time.sleep(0.2)  # parked (once, this killed the serving thread)
        still_serves(server.address)
        with StoreClient(server.address, timeout=5, auth_token="") as client:
            client.set("huge/key", b"set at last")
        expected = [b"set at last"] if command == b"get" else []
        assert stranger.reply() == [rid(1), b"ok", *expected]
    finally:
        stranger.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("timeout", [math.inf, 1e12, 2.2e6])
def test_a_client_takes_a_blocking_call_of_any_timeout(server, timeout):
    with StoreClient(server.address, timeout=timeout, auth_token="") as waiter, \
            StoreClient(server.address, timeout=5, auth_token="") as setter:
        assert waiter.timeout == waits.MAX_TIMEOUT
        got: list[object] = []

        def wait_then_get() -> None:
            try:
                waiter.wait(["k"], timeout=timeout)
                got.append(waiter.get("k", timeout=timeout))
                got.append(waiter.get("k"))  # the client's own timeout
            except BaseException as err:  # noqa: BLE001 - handed to the test
                got.append(err)

        t = threading.Thread(target=wait_then_get, daemon=True)
        t.start()
        time.sleep(0.2)
        setter.set("k", b"v")
        t.join(JOIN)
        assert got == [b"v", b"v"]


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
