"""The rendezvous store (``ringcomm.bootstrap.store``): our ZeroMQ server and client, the
prefix and torch adapters, and ``python -m ringcomm.bootstrap.store``.

Everything runs for real on 127.0.0.1: servers on free ports, clients in threads and in spawned
processes, torch's own TCPStore and FileStore, and the CLI as a subprocess. Timeouts are short
(well under a second) wherever a test waits for one, and every assertion on time is an upper
bound with plenty of slack (or a lower bound showing that a call really waited), never a speed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import zmq

from ringcomm import ArgumentError, StoreError, StoreTimeout
from ringcomm.bootstrap.store import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    PrefixStore,
    StoreClient,
    StoreServer,
    TorchStore,
)

HOST = "127.0.0.1"
SLACK = 3.0  # s: how much later than its timeout a call may return on a loaded machine
JOIN = 15.0  # s: the most a helper thread may take; a thread still running is a hang
MiB = 1 << 20


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Call:
    """Runs ``fn(*args)`` in a daemon thread; ``result`` joins it with a bound."""

    def __init__(self, fn, *args, **kwargs) -> None:
        self.value = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.elapsed: float | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, fn, args, kwargs) -> None:
        try:
            self.value = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            self.error = err
        finally:
            self.elapsed = time.monotonic() - self.started

    def running(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float = JOIN) -> Call:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the call did not return within {timeout} s (hang)"
        return self

    def result(self, timeout: float = JOIN):
        self.join(timeout)
        if self.error is not None:
            raise self.error
        return self.value

    def exception(self, timeout: float = JOIN) -> BaseException:
        self.join(timeout)
        assert self.error is not None, f"expected an error, the call returned {self.value!r}"
        return self.error


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def server():
    srv = StoreServer(HOST, 0)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def connect(server):
    """``connect(timeout=10)``: a new StoreClient of ``server``, closed after the test."""
    made: list[StoreClient] = []

    def make(timeout: float = 10.0) -> StoreClient:
        client = StoreClient(server.address, timeout=timeout)
        made.append(client)
        return client

    try:
        yield make
    finally:
        for client in made:
            client.close()


@pytest.fixture
def store(connect):
    return connect()


@pytest.fixture
def processes():
    """Spawned processes, killed (if still running) and joined after the test."""
    started: list[multiprocessing.process.BaseProcess] = []
    ctx = multiprocessing.get_context("spawn")

    def start(target, *args):
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


# --------------------------------------------------------------------------- process targets
# Module level, so that spawned children can import them (they import this module, which
# imports only pytest and ringcomm: no torch, so a child starts in a fraction of a second).


def job_add_many(rank: int, address: str, count: int, **_: object) -> None:
    """A job of the session's rank processes (``conftest.cluster``): rank ``rank`` adds 1
    ``count`` times, all ranks starting together."""
    with StoreClient(address, timeout=30) as store:
        store.set(f"ready/{rank}", b"1")
        store.wait(["go"])  # all processes start adding together
        seen = [store.add("counter", 1) for _ in range(count)]
        store.set(f"seen/{rank}", ",".join(map(str, seen)))


def _park(address: str, how: str, key: str, timeout: float) -> None:
    """Announce ourselves, then block in ``get`` or ``wait`` until killed."""
    store = StoreClient(address, timeout=60)
    store.set(f"parked/{how}", b"1")
    if how == "get":
        store.get(key, timeout=timeout)
    else:
        store.wait([key], timeout=timeout)


# --------------------------------------------------------------------------- every operation


def test_set_get_bytes_and_str_values(store):
    store.set("bytes", b"\x00\xffraw")
    store.set("text", "héllo wörld")
    store.set(b"bytes-key", bytearray(b"from a bytearray"))
    store.set("view", memoryview(b"from a memoryview"))
    assert store.get("bytes") == b"\x00\xffraw"
    assert store.get("text") == "héllo wörld".encode()
    assert store.get("bytes-key") == b"from a bytearray"
    assert store.get(b"view") == b"from a memoryview"
    assert all(isinstance(store.get(k), bytes) for k in ("bytes", "text", "view"))


def test_set_overwrites(store):
    store.set("k", b"first")
    store.set("k", b"second")
    assert store.get("k") == b"second"
    assert store.num_keys() == 1


def test_empty_value_round_trips_and_counts_as_set(store):
    store.set("empty", b"")
    assert store.get("empty") == b""
    assert store.check(["empty"])
    store.wait(["empty"], timeout=1)


def test_large_value_round_trips(connect):
    writer, reader = connect(), connect()
    value = os.urandom(8 * MiB)
    writer.set("big", value)
    assert reader.get("big") == value
    # and a blocked get is answered with the whole of it
    call = Call(reader.get, "big-later", timeout=10)
    time.sleep(0.1)
    writer.set("big-later", value[::-1])
    assert call.result() == value[::-1]


def test_add_counts_from_zero_and_takes_negative_amounts(store):
    assert store.add("n", 5) == 5  # unset counts as 0
    assert store.add("n", -7) == -2
    assert store.add("n", 0) == -2
    assert store.get("n") == b"-2"  # the value is the decimal text, as in torch's stores
    assert store.add("fresh", -3) == -3
    store.set("preset", b"40")
    assert store.add("preset", 2) == 42
    assert store.add("huge", 2**70) == 2**70


def test_add_on_a_non_integer_value_is_refused_and_server_keeps_serving(store):
    store.set("word", b"abc")
    with pytest.raises(StoreError, match="add") as info:
        store.add("word", 1)
    assert not isinstance(info.value, StoreTimeout)
    assert store.get("word") == b"abc"
    assert store.add("n", 1) == 1


def test_wait_for_several_keys(connect):
    waiter, setter = connect(), connect()
    call = Call(waiter.wait, ["a", "b", "c"], timeout=10)
    time.sleep(0.2)
    setter.set("a", b"1")
    setter.add("b", 1)
    time.sleep(0.1)
    assert call.running(), "wait returned before every key was set"
    setter.compare_set("c", b"", b"x")  # every kind of write wakes waiters
    call.result()
    assert call.elapsed < 10
    waiter.wait(["a", "b", "c"], timeout=0.5)  # all set: returns at once
    waiter.wait("a")  # a single key may be passed as a string
    waiter.wait([])  # nothing to wait for


def test_check(store):
    assert not store.check(["x"])
    store.set("x", b"1")
    assert store.check(["x"])
    assert store.check("x")
    assert not store.check(["x", "y"])
    store.add("y", 1)
    assert store.check(["x", "y"])


def test_compare_set_follows_torch_semantics(store):
    # unset, expected empty: sets desired and returns it
    assert store.compare_set("k", b"", b"first") == b"first"
    assert store.get("k") == b"first"
    # mismatch: returns the current value and leaves it
    assert store.compare_set("k", b"wrong", b"second") == b"first"
    assert store.get("k") == b"first"
    # match: sets and returns desired
    assert store.compare_set("k", b"first", b"second") == b"second"
    assert store.get("k") == b"second"
    # unset, expected not empty: nothing set, expected handed back
    assert store.compare_set("other", b"expected", b"desired") == b"expected"
    assert not store.check(["other"])
    # str arguments work like bytes
    assert store.compare_set("k", "second", "third") == b"third"
    # set to an empty value: a set key whose value is b"" matches expected b""
    store.set("e", b"")
    assert store.compare_set("e", b"", b"filled") == b"filled"


def test_compare_set_lets_exactly_one_of_many_threads_win(connect):
    store = connect()
    calls = [Call(store.compare_set, "leader", b"", f"t{i}") for i in range(8)]
    results = {c.result() for c in calls}
    assert len(results) == 1
    assert store.get("leader") == results.pop()


def test_delete_key_and_num_keys(store):
    assert store.num_keys() == 0
    store.set("a", b"1")
    store.set("b", b"2")
    store.add("c", 1)
    assert store.num_keys() == 3
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.delete_key("never-set") is False
    assert store.num_keys() == 2
    assert not store.check(["a"])
    with pytest.raises(StoreTimeout, match="'a'"):
        store.get("a", timeout=0.2)
    store.set("a", b"again")
    assert store.get("a") == b"again"


def test_key_size_limits(store):
    longest = "k" * MAX_KEY_BYTES
    store.set(longest, b"ok")
    assert store.get(longest) == b"ok"
    too_long = "k" * (MAX_KEY_BYTES + 1)
    for op in (lambda: store.set(too_long, b"x"), lambda: store.get(too_long, timeout=1),
               lambda: store.add(too_long, 1), lambda: store.wait([too_long], timeout=1),
               lambda: store.check([too_long]), lambda: store.delete_key(too_long),
               lambda: store.compare_set(too_long, b"", b"x")):
        with pytest.raises(ArgumentError, match="limited to"):
            op()
    # multi-byte characters count as bytes
    with pytest.raises(ArgumentError):
        store.set("é" * (MAX_KEY_BYTES // 2 + 1), b"x")
    with pytest.raises(ArgumentError, match="empty"):
        store.set("", b"x")
    assert store.num_keys() == 1


def test_value_size_limit(store):
    too_big = b"\0" * (MAX_VALUE_BYTES + 1)
    with pytest.raises(ArgumentError, match="limited to") as info:
        store.set("v", too_big)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ArgumentError):
        store.compare_set("v", b"", too_big)
    assert store.num_keys() == 0


@pytest.mark.parametrize("value", [5, 1.5, None, [b"x"], {"a": 1}, object()],
                         ids=lambda v: type(v).__name__)
def test_non_bytes_values_are_refused(store, value):
    with pytest.raises(ArgumentError, match="bytes or str"):
        store.set("k", value)
    with pytest.raises(ArgumentError, match="bytes or str"):
        store.compare_set("k", b"", value)
    with pytest.raises(ArgumentError, match="bytes or str"):
        store.compare_set("k", value, b"x")
    assert store.num_keys() == 0


def test_bad_arguments(server, store):
    with pytest.raises(ArgumentError, match="int"):
        store.add("n", 1.5)
    with pytest.raises(ArgumentError, match="int"):
        store.add("n", "1")
    with pytest.raises(ArgumentError, match="negative"):
        store.get("n", timeout=-1)
    with pytest.raises(ArgumentError, match="negative"):
        store.wait(["n"], timeout=-1)
    with pytest.raises(ArgumentError, match="positive"):
        StoreClient(server.address, timeout=0)
    for address in ("localhost", "localhost:", ":1234", "host:port"):
        with pytest.raises(ArgumentError, match="host:port"):
            StoreClient(address)


def test_ping_and_address(server, store):
    store.ping()
    store.ping(timeout=1)
    assert server.address == f"{HOST}:{server.port}"
    with StoreServer("0.0.0.0", 0) as everywhere:
        assert everywhere.address == f"127.0.0.1:{everywhere.port}"
        with StoreClient(everywhere.address, timeout=5) as client:
            client.set("k", b"v")
            assert client.get("k") == b"v"


def test_closed_client_raises_store_error(server):
    client = StoreClient(server.address, timeout=5)
    client.set("k", b"v")
    client.close()
    client.close()  # twice is fine
    with pytest.raises(StoreError, match="closed"):
        client.get("k")  # from the thread that used it
    call = Call(client.set, "k", b"w")  # and from one that never did
    with pytest.raises(StoreError, match="closed"):
        call.result()


# --------------------------------------------------------------------------- blocking and timeouts


def test_blocking_get_is_answered_by_a_later_set_from_another_client(connect):
    getter, setter = connect(), connect()
    call = Call(getter.get, "late", timeout=10)
    time.sleep(0.3)
    assert call.running(), "get returned before the key was set"
    setter.set("late", b"here")
    assert call.result() == b"here"
    assert 0.25 <= call.elapsed < 10


def test_blocking_get_is_answered_by_add(connect):
    getter, setter = connect(), connect()
    call = Call(getter.get, "counter", timeout=10)
    time.sleep(0.1)
    setter.add("counter", 3)
    assert call.result() == b"3"


def test_get_timeout_names_the_key(store):
    start = time.monotonic()
    with pytest.raises(StoreTimeout) as info:
        store.get("missing-key", timeout=0.5)
    elapsed = time.monotonic() - start
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, StoreError)
    assert "'missing-key'" in str(err)
    assert store.address in str(err)
    assert 0.45 <= elapsed < 0.5 + SLACK
    # the client goes on working after a timeout
    store.set("missing-key", b"now")
    assert store.get("missing-key") == b"now"


def test_get_uses_the_client_timeout_by_default(connect):
    client = connect(timeout=0.5)
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="'absent'"):
        client.get("absent")
    assert time.monotonic() - start < 0.5 + SLACK


def test_wait_timeout_names_exactly_the_missing_keys(store):
    store.set("present-key", b"1")
    store.set("also-present", b"1")
    start = time.monotonic()
    with pytest.raises(StoreTimeout) as info:
        store.wait(["present-key", "missing-one", "also-present", "missing-two"], timeout=0.5)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert isinstance(info.value, TimeoutError)
    assert "'missing-one'" in message and "'missing-two'" in message
    assert "present-key" not in message and "also-present" not in message
    assert 0.45 <= elapsed < 0.5 + SLACK


def test_wait_timeout_names_only_the_keys_still_missing_at_the_deadline(connect):
    waiter, setter = connect(), connect()
    call = Call(waiter.wait, ["first", "second", "third"], timeout=1.0)
    time.sleep(0.2)
    setter.set("second", b"1")
    err = call.exception()
    assert isinstance(err, StoreTimeout)
    assert "'first'" in str(err) and "'third'" in str(err)
    assert "second" not in str(err)


def test_timeout_zero_answers_from_what_is_there(connect):
    connect().set("here", b"v")
    fresh = connect()  # its first request, before its connection is even up
    assert fresh.get("here", timeout=0) == b"v"
    assert connect().check(["here"])
    connect().wait(["here"], timeout=0)
    with pytest.raises(StoreTimeout) as info:
        connect().get("not-here", timeout=0)
    assert "'not-here'" in str(info.value)
    assert "could not reach" not in str(info.value)


def test_a_waiter_timing_out_does_not_disturb_others_on_the_same_key(connect):
    short, long_, setter = connect(), connect(), connect()
    long_call = Call(long_.get, "shared", timeout=10)
    with pytest.raises(StoreTimeout, match="'shared'"):
        short.get("shared", timeout=0.3)
    assert long_call.running()
    setter.set("shared", b"v")
    assert long_call.result() == b"v"


def test_wait_survives_a_key_deleted_and_set_again(connect):
    waiter, setter = connect(), connect()
    call = Call(waiter.wait, ["x", "y"], timeout=5)
    time.sleep(0.2)
    setter.set("x", b"1")
    setter.delete_key("x")
    setter.set("y", b"1")
    time.sleep(0.1)
    assert call.running(), "wait returned while 'x' was deleted"
    setter.set("x", b"2")
    call.result()
    assert call.elapsed < 5


def test_many_waiters_on_one_key_are_all_woken(connect):
    clients = [connect() for _ in range(3)]
    calls = [Call(c.get, "flag", timeout=10) for c in clients for _ in range(3)]
    time.sleep(0.2)
    assert all(c.running() for c in calls)
    connect().set("flag", b"up")
    assert [c.result() for c in calls] == [b"up"] * len(calls)


# --------------------------------------------------------------------------- concurrency


def test_threads_sharing_a_client_do_not_block_each_other(store):
    """One thread parked in ``get`` must not delay another thread's ``set`` on the same
    client: each thread has its own socket."""
    getter = Call(store.get, "from-another-thread", timeout=10)
    time.sleep(0.2)
    assert getter.running()
    setter = Call(store.set, "from-another-thread", b"v")
    setter.result(timeout=5)
    assert setter.elapsed < 5
    assert getter.result() == b"v"


def test_threads_sharing_a_client_add_exactly(store):
    per_thread, threads = 100, 6

    def adds():
        return [store.add("shared-counter", 1) for _ in range(per_thread)]

    calls = [Call(adds) for _ in range(threads)]
    seen = [v for c in calls for v in c.result(timeout=30)]
    assert sorted(seen) == list(range(1, per_thread * threads + 1))
    assert store.get("shared-counter") == str(per_thread * threads).encode()


@pytest.mark.timeout(60)
def test_processes_adding_to_one_counter_get_an_exact_total(server, store, cluster):
    """Four processes (the session's rank processes, already running) add at once."""
    nprocs, count = 4, 150
    adding = Call(cluster.run, nprocs, "test_store.job_add_many", address=server.address,
                  count=count, timeout=45)
    store.wait([f"ready/{i}" for i in range(nprocs)], timeout=45)
    store.set("go", b"1")
    store.wait([f"seen/{i}" for i in range(nprocs)], timeout=45)
    assert adding.result(timeout=50) == [None] * nprocs  # every process's job returned
    assert store.get("counter") == str(nprocs * count).encode()
    # every add returned a distinct total: they were atomic
    seen = [int(v) for i in range(nprocs) for v in store.get(f"seen/{i}").split(b",")]
    assert sorted(seen) == list(range(1, nprocs * count + 1))


@pytest.mark.timeout(60)
def test_clients_killed_while_parked_do_not_disturb_the_server(server, connect, processes):
    store = connect()
    getter = processes(_park, server.address, "get", "wanted-by-the-dead", 30.0)
    waiter = processes(_park, server.address, "wait", "expires-for-the-dead", 1.0)
    store.wait(["parked/get", "parked/wait"], timeout=45)
    time.sleep(0.3)  # let their requests reach the server and park
    for proc in (getter, waiter):
        proc.kill()
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
    # the server answers the dead getter (nobody there to hear it) ...
    store.set("wanted-by-the-dead", b"v")
    # ... and the dead waiter's deadline passes while this wait is parked beside it
    with pytest.raises(StoreTimeout, match="'expires-for-the-dead'"):
        store.wait(["expires-for-the-dead"], timeout=1.5)
    # and goes on serving everyone correctly
    assert store.get("wanted-by-the-dead") == b"v"
    other = connect()
    call = Call(other.get, "after", timeout=10)
    time.sleep(0.1)
    store.set("after", b"fine")
    assert call.result() == b"fine"
    assert store.add("n", 2) == 2
    assert store.num_keys() == 5  # parked/get, parked/wait, wanted-by-the-dead, after, n


# --------------------------------------------------------------------------- failures


def test_server_closing_under_a_blocked_get_raises_store_error_quickly(server, connect):
    client = connect(timeout=30)

    def get_after_ping():
        client.ping()
        return client.get("never", timeout=30)

    call = Call(get_after_ping)
    time.sleep(0.3)
    assert call.running()
    closed_at = time.monotonic()
    server.close()
    err = call.exception(timeout=JOIN)
    assert type(err) is StoreError, repr(err)  # lost, not timed out
    assert time.monotonic() - closed_at < 5.0  # far within the get's 30 s
    assert server.address in str(err)


@pytest.mark.parametrize("op", ["get", "set", "wait"])
def test_nothing_listening_times_out_saying_so(op):
    address = f"{HOST}:{free_port()}"
    timeout = 1.0
    with StoreClient(address, timeout=timeout) as client:
        start = time.monotonic()
        with pytest.raises(StoreTimeout) as info:
            if op == "get":
                client.get("k")
            elif op == "set":
                client.set("k", b"v")
            else:
                client.wait(["k"], timeout=timeout)
        elapsed = time.monotonic() - start
    assert "could not reach" in str(info.value)
    assert address in str(info.value)
    assert timeout * 0.9 <= elapsed < timeout + SLACK


def test_port_in_use_raises_store_error(server, store):
    with pytest.raises(StoreError, match="in use"):
        StoreServer(HOST, server.port)
    with pytest.raises(StoreError, match="in use"):
        StoreServer("0.0.0.0", server.port)
    # the first server is untouched
    store.set("k", b"v")
    assert store.get("k") == b"v"


def test_server_close_is_idempotent_and_frees_the_port():
    srv = StoreServer(HOST, 0)
    port = srv.port
    srv.close()
    srv.close()
    with StoreServer(HOST, port) as again, StoreClient(again.address, timeout=5) as client:
        client.set("k", b"v")
        assert client.get("k") == b"v"


# --------------------------------------------------------------------------- a store that goes away
# The store rank 0 serves belongs to its group (``StoreServer.own``): from the first rank's
# ``leave`` it turns away clients it has never served (a rank's next init on the same address)
# with a status that client answers by asking again, while the group's own clients are served
# until ``retire`` closes it, once every rank has left or gone.

GROUP = "ringcomm/0/1"


def _ask_once(address: str, command: bytes, *args: bytes) -> list[bytes]:
    """One request on a new plain ZeroMQ connection (a client the store has never seen):
    the reply's status and results."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart([b"\1" * 8, command, *args])
        assert sock.poll(int(JOIN * 1e3)), f"no answer to {command!r}"
        reply = sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()
    assert reply[0] == b"\1" * 8
    return reply[1:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "a shared secret"], ids=["plain", "token"])
def test_a_leaving_store_turns_newcomers_away_until_the_next_store_serves_them(token):
    port = free_port()
    server = StoreServer(HOST, port, auth_token=token or "")
    ranks = [StoreClient(server.address, timeout=10, auth_token=token or "") for _ in range(2)]
    newcomer = StoreClient(server.address, timeout=15, auth_token=token or "")
    try:
        hold = server.hold()
        server.own(hold, GROUP, 2)
        for r, rank in enumerate(ranks):
            rank.set(f"joined/{r}", b"1")  # the group's clients are known from here on
        if token is None:  # a stranger is served while the store is not leaving
            assert _ask_once(server.address, b"ping") == [b"ok"]
        ranks[0].leave(GROUP, 0)
        assert server.leaving
        if token is None:
            status, why = _ask_once(server.address, b"add", b"generation", b"1")
            assert status == b"leaving" and b"going away" in why
        call = Call(newcomer.add, "generation", 1)  # asks again and again
        time.sleep(0.5)
        assert call.running()
        # the group's ranks are still served, from a thread (a socket) they had not used
        assert Call(ranks[1].get, "joined/0", timeout=5).result() == b"1"
        ranks[1].set("closed/1", b"1")
        assert ranks[0].get("closed/1", timeout=5) == b"1"  # after its leave, too
        assert call.running() and newcomer.turned_away
        ranks[1].leave(GROUP, 1)
        started = time.monotonic()
        assert server.retire(hold, 10) is True  # every rank has left
        assert server.closed and server.hold() is None
        assert time.monotonic() - started < SLACK
        # the next group's store at the address serves the newcomer's add: there, not here
        with StoreServer(HOST, port, auth_token=token or "") as following:
            assert call.result() == 1
            assert newcomer.get("generation", timeout=1) == b"1"
            assert following.address == server.address
    finally:
        for client in (*ranks, newcomer):
            client.close()
        server.close()


@pytest.mark.timeout(60)
def test_retire_waits_for_a_rank_still_using_the_store_but_not_for_one_that_died(processes):
    server = StoreServer(HOST, 0)
    try:
        hold = server.hold()
        server.own(hold, GROUP, 3)
        with StoreClient(server.address, timeout=10) as rank0, \
                StoreClient(server.address, timeout=10) as rank2:
            child = processes(_park, server.address, "get", "never", 30.0)  # rank 1
            rank0.wait(["parked/get"], timeout=45)
            rank2.ping()
            rank0.leave(GROUP, 0)
            rank0.close()
            retire = Call(server.retire, hold, 20)
            time.sleep(0.5)
            assert retire.running()  # ranks 1 and 2 still hold connections
            rank2.set("last-use", b"1")  # rank 2 still closing, served
            rank2.leave(GROUP, 2)
            rank2.close()
            time.sleep(0.3)
            assert retire.running()  # rank 1 has not left
            child.kill()
            child.join(10)
            killed = time.monotonic()
            assert retire.result() is True  # its connection closed with its process
            assert time.monotonic() - killed < SLACK
    finally:
        server.close()


def test_retire_gives_up_after_its_timeout(server):
    hold = server.hold()
    server.own(hold, GROUP, 2)
    with StoreClient(server.address, timeout=10) as rank0, \
            StoreClient(server.address, timeout=10) as rank1:
        rank0.ping()
        rank1.ping()
        rank0.leave(GROUP, 0)
        started = time.monotonic()
        assert server.retire(hold, 0.5) is False  # rank 1 neither left nor went
        assert 0.45 <= time.monotonic() - started < 0.5 + SLACK
        with pytest.raises(StoreError, match="lost the connection") as info:
            rank1.set("too-late", b"1")
        assert not isinstance(info.value, StoreTimeout)


def test_a_store_two_groups_hold_goes_away_with_the_last(server, connect):
    first, second = server.hold(), server.hold()
    server.own(first, "ringcomm/0/1", 1)
    server.own(second, "ringcomm/0/2", 1)
    member = connect()
    member.set("k", b"v")
    member.leave("ringcomm/0/1", 0)
    assert not server.leaving  # the second group still holds it
    assert connect().get("k", timeout=1) == b"v"  # a newcomer is served
    assert server.retire(first, 5) is True and not server.closed
    member.leave("ringcomm/0/2", 0)
    assert server.leaving
    third = server.hold()  # a group of rank 0's process meets on it while it is leaving
    assert third is not None and not server.leaving
    assert connect().get("k", timeout=1) == b"v"
    assert server.retire(third, 5) is True and not server.closed  # (it never met)
    member.close()
    assert server.retire(second, 5) is True and server.closed


def test_a_store_nobody_holds_never_goes_away(server, connect):
    first = connect()
    first.set("k", b"v")
    first.leave(GROUP, 0)  # a group meeting on a stand-alone store says so too
    assert not server.leaving
    assert connect().get("k", timeout=1) == b"v"  # a newcomer is served
    server.own(server.hold(), GROUP, 2)
    first.leave("another/group", 0)
    first.leave(GROUP, 2)  # no such rank
    assert not server.leaving
    assert connect().get("k", timeout=1) == b"v"


@pytest.mark.timeout(60)
def test_init_waits_out_a_store_still_leaving_on_its_address():
    """A rank 0 whose address still has the store of a group that is closing (another
    process was that group's rank 0) serves the port once that store has gone."""
    import ringcomm

    port = free_port()
    old = StoreServer(HOST, port)
    try:
        hold = old.hold()
        old.own(hold, GROUP, 2)
        with StoreClient(old.address, timeout=10) as rank0, \
                StoreClient(old.address, timeout=10) as rank1:
            rank1.ping()
            rank0.leave(GROUP, 0)
            call = Call(ringcomm.init, rank=0, world_size=1, store=old.address, timeout=15)
            time.sleep(0.8)
            assert call.running()  # neither served by the leaving store nor failed
            rank1.leave(GROUP, 1)
        assert old.retire(hold, 5)
        comm = call.result()
        try:
            x = np.ones(3)
            comm.allreduce(x)
            assert x.tolist() == [1.0] * 3
        finally:
            comm.close()
    finally:
        old.close()


# --------------------------------------------------------------------------- PrefixStore


def test_prefix_store_isolates_keys(store):
    a, b = PrefixStore("job-a", store), PrefixStore("job-b/", store)
    a.set("k", b"from a")
    b.set("k", b"from b")
    assert a.get("k") == b"from a" and b.get("k") == b"from b"
    assert store.get("job-a/k") == b"from a" and store.get("job-b/k") == b"from b"
    assert a.add("n", 2) == 2 and b.add("n", 5) == 5 and a.add("n", 1) == 3
    assert a.check(["k", "n"]) and not a.check(["only-b"])
    b.set("only-b", b"1")
    assert not a.check("only-b") and b.check("only-b")
    assert a.compare_set("c", b"", b"1") == b"1"
    assert b.compare_set("c", b"1", b"2") == b"1"  # b's "c" is unset: expected comes back
    assert not b.check(["c"])
    assert a.delete_key("k") is True
    assert b.get("k") == b"from b" and not a.check(["k"])
    assert a.num_keys() == store.num_keys()  # the whole store, as in torch
    b.wait(["k", "only-b"], timeout=1)
    with pytest.raises(StoreTimeout, match="only-b"):
        a.wait("only-b", timeout=0.3)
    with pytest.raises(StoreTimeout, match="job-a/missing"):
        a.get("missing", timeout=0.3)
    nested = PrefixStore("inner", a)
    nested.set("k", b"deep")
    assert store.get("job-a/inner/k") == b"deep"
    assert nested.timeout == store.timeout


def test_prefix_store_blocking_get_across_clients(connect):
    a = PrefixStore("p", connect())
    b = PrefixStore("p", connect())
    call = Call(a.get, "k", timeout=10)
    time.sleep(0.1)
    PrefixStore("q", connect()).set("k", b"wrong prefix")
    time.sleep(0.1)
    assert call.running()
    b.set("k", b"right")
    assert call.result() == b"right"


# --------------------------------------------------------------------------- TorchStore


@pytest.fixture(params=["tcp", "file"])
def torch_stores(request, tmp_path):
    """Two TorchStores over one torch store (the second for another thread)."""
    dist = pytest.importorskip("torch.distributed")
    kind = request.param
    opened = []
    try:
        if kind == "tcp":
            master = dist.TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=10),
                                   wait_for_workers=False)
            opened.append(master)
            other = dist.TCPStore(HOST, master.port, is_master=False,
                                  timeout=timedelta(seconds=10))
        else:
            path = str(tmp_path / "filestore")
            master = dist.FileStore(path, -1)
            opened.append(master)
            other = dist.FileStore(path, -1)
            master.set_timeout(timedelta(seconds=10))
            other.set_timeout(timedelta(seconds=10))
        opened.append(other)
        yield kind, TorchStore(master), TorchStore(other)
    finally:
        opened.clear()  # torch's stores close when dropped


def test_torch_store_operations(torch_stores):
    kind, store, other = torch_stores
    assert store.timeout == 10.0
    before = store.num_keys()
    store.set("b", b"\x00bytes")
    store.set("s", "text")
    assert other.get("b") == b"\x00bytes" and other.get("s") == b"text"
    assert isinstance(store.get("b"), bytes)
    assert store.num_keys() == before + 2
    assert store.add("n", 5) == 5 and other.add("n", -7) == -2
    assert store.get("n") == b"-2"
    assert store.check(["b", "s"]) and store.check("b") and not store.check(["b", "nope"])
    assert store.compare_set("c", b"", b"first") == b"first"
    assert store.compare_set("c", b"wrong", b"second") == b"first"
    assert store.get("c") == b"first"
    assert store.compare_set("c", "first", "second") == b"second"
    assert store.compare_set("unset", b"expected", b"x") == b"expected"
    assert not store.check(["unset"])
    assert store.delete_key("b") is True
    assert not store.check(["b"])
    if kind == "tcp":  # FileStore answers True for any key
        assert store.delete_key("b") is False
    with pytest.raises(ArgumentError):
        store.set("k", 5)


def test_torch_store_blocking_wait_and_get(torch_stores):
    # A TCPStore handle runs one request at a time, so each blocked call is answered
    # through the other handle.
    _, store, other = torch_stores
    waiting = Call(store.wait, ["w1", "w2"], timeout=10)
    time.sleep(0.2)
    other.set("w1", b"1")
    time.sleep(0.1)
    assert waiting.running(), "wait returned before every key was set"
    other.set("w2", b"2")
    waiting.result()
    assert waiting.elapsed < 10
    getting = Call(other.get, "g", timeout=10)
    time.sleep(0.2)
    assert getting.running()
    store.set("g", b"got")
    assert getting.result() == b"got"
    assert getting.elapsed < 10


def test_torch_store_timeouts_name_the_keys(torch_stores):
    _, store, _ = torch_stores
    start = time.monotonic()
    with pytest.raises(StoreTimeout) as info:
        store.wait(["missing-a", "missing-b"], timeout=0.5)
    assert time.monotonic() - start < 0.5 + SLACK
    assert isinstance(info.value, TimeoutError)
    assert "'missing-a'" in str(info.value) and "'missing-b'" in str(info.value)
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="'missing-c'"):
        store.get("missing-c", timeout=0.5)
    assert time.monotonic() - start < 0.5 + SLACK
    assert store.store.timeout == timedelta(seconds=10)  # the store's own timeout is restored
    store.set("missing-c", b"v")
    assert store.get("missing-c") == b"v"


def test_prefix_store_over_torch_store(torch_stores):
    _, store, other = torch_stores
    PrefixStore("x", store).set("k", b"1")
    PrefixStore("y", other).set("k", b"2")
    assert other.get("x/k") == b"1" and store.get("y/k") == b"2"


# --------------------------------------------------------------------------- the CLI


def _cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ringcomm.bootstrap.store", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, **kwargs)


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no output from the CLI within {timeout} s")
    return proc.stdout.readline()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("port_from", ["flag", "env"])
def test_cli_serves_a_store_until_interrupted(port_from):
    port = free_port()
    if port_from == "flag":
        proc = _cli("--host", HOST, "--port", str(port))
    else:
        proc = _cli("--host", HOST, env={"MASTER_PORT": str(port)})
    try:
        line = _read_line(proc, 30)
        assert "serving" in line and f"{HOST}:{port}" in line, (line, proc.poll())
        with StoreClient(f"{HOST}:{port}", timeout=10) as client:
            client.set("k", b"v")
            assert client.get("k") == b"v"
            assert client.add("n", 3) == 3
            client.wait(["k", "n"], timeout=1)
            with pytest.raises(StoreTimeout, match="'absent'"):
                client.get("absent", timeout=0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=15)
        with contextlib.suppress(Exception):
            proc.stdout.close()
            proc.stderr.close()


@pytest.mark.timeout(60)
def test_cli_on_a_port_in_use_exits_with_an_error(server):
    proc = _cli("--host", HOST, "--port", str(server.port))
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=15)
    assert proc.returncode != 0
    assert "error" in err and "in use" in err, err
    assert "serving" not in out
