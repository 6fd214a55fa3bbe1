"""Every kind of link keeps the same contract, and each call's op travels with the call.

The kinds: in-memory (threads of one process), local (a named pipe and a shared-memory ring),
and ZeroMQ sockets over ipc and over tcp. Each pair is two transports in this process, so
the tests read one side's errors directly.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from mp_helpers import transport_pair

from ringcomm import CommTimeout, PeerLostError, RemoteError
from ringcomm.transport import InMemoryNetwork, Transport, local_link, mailbox, zmq_control
from ringcomm.transport.header import Header, OpKind
from ringcomm.transport.link import Wait
from ringcomm.transport.local_link import SHM_MIN_BYTES, LocalLink
from ringcomm.transport.socket_link import SocketLink

KINDS = ["in-memory", "local", "local-mailbox", "socket-ipc", "socket-tcp"]


def make_pair(kind: str) -> list[Transport]:
    if kind == "in-memory":
        net = InMemoryNetwork(2)
        return [net.transport(0), net.transport(1)]
    if kind.startswith("local"):
        # RINGCOMM_MAILBOX is read by each transport as it is made, in this process
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RINGCOMM_MAILBOX", "1" if kind == "local-mailbox" else "0")
            return transport_pair("ipc", shm=True)
    if kind == "socket-ipc":
        return transport_pair("ipc", shm=False)
    return transport_pair("tcp", shm=False, hosts=("a", "b"))


@pytest.fixture(params=KINDS)
def pair(request):
    made = make_pair(request.param)
    yield made
    for t in made:
        t.close()


def header(seq: int, nbytes: int, index: int = 0, sender: int = 0) -> Header:
    count = nbytes // 4
    return Header(seq, nbytes, count, 1 << 20, sender, index, 0, OpKind.ALLREDUCE, 0, 0, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_the_kind_of_link_follows_from_hosts_and_settings(kind):
    a, b = make_pair(kind)
    try:
        expected = {"in-memory": "in-memory", "local": "pipe + shared memory",
                    "local-mailbox": "and mailbox",
                    "socket-ipc": "ipc://", "socket-tcp": "tcp://"}[kind]
        assert expected in a.describe() and expected in b.describe(), a.describe()
        assert type(a.links[1]) is {"local": LocalLink, "local-mailbox": LocalLink,
                                    "socket-ipc": SocketLink,
                                    "socket-tcp": SocketLink}.get(kind, type(a.links[1]))
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_messages_arrive_in_order_whole_and_into_place(pair):
    """Empty, small (inline) and large (shared memory where there is some) payloads, mixed,
    read both as a buffer and straight into place; each header checked by the receiver."""
    a, b = pair
    rng = np.random.default_rng(0)
    sizes = [0, 4, 4096, SHM_MIN_BYTES, 3 << 20, 8, SHM_MIN_BYTES * 2]
    payloads = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    handles = [a.send(1, header(0, n, i), p if n else None, "allreduce #0")
               for i, (n, p) in enumerate(zip(sizes, payloads, strict=True))]
    deadline = time.monotonic() + 10
    for i, (n, p) in enumerate(zip(sizes, payloads, strict=True)):
        expected = header(0, n, i)
        if i % 2:
            out = np.zeros(n, np.uint8)
            b.recv_into(0, expected, out, deadline, "allreduce #0")
        else:
            out = np.frombuffer(bytes(b.recv(0, expected, deadline, "allreduce #0")), np.uint8)
        assert np.array_equal(out, p), f"message {i} ({n} B) arrived changed"
    for h in handles:
        if h is not None:
            a.wait_sent(1, h, deadline, "allreduce #0")
    assert not b.ready(0)


def arrived(receiver: Transport, peer: int = 0) -> None:
    """Wait until a message from ``peer`` can be read without waiting."""
    deadline = time.monotonic() + 10
    while not receiver.links[peer].peek():
        assert time.monotonic() < deadline, "the message never arrived"
        time.sleep(0.001)


@pytest.mark.timeout(30)
def test_credits_are_a_stream_of_their_own_beside_collective_and_p2p_messages(pair):
    """Credits (a device channel's) interleaved with collective and point-to-point messages:
    each stream is read in its own order whichever is asked for first, and credits left
    unread prove nothing at close."""
    a, b = pair
    p2p = Header(0, 4, 1, 0, 0, 0, 7, OpKind.P2P, 0)
    a.send_credit(1, 1, "allreduce #0")
    a.send(1, header(0, 8), np.arange(8, dtype=np.uint8), "allreduce #0")
    a.send_credit(1, 2, "allreduce #0")
    a.send(1, p2p, np.full(4, 9, np.uint8), "send #0")
    a.send_credit(1, 5, "allreduce #0")
    a.send(1, header(0, 8, 1), np.full(8, 3, np.uint8), "allreduce #0")
    deadline = time.monotonic() + 10
    # the collective's second message first: two credits and a p2p message are set aside
    out = np.zeros(8, np.uint8)
    b.recv_into(0, header(0, 8), out, deadline, "allreduce #0")
    assert list(out) == list(range(8))
    assert b.recv_credit(0, deadline, "allreduce #0") == 1
    b.recv_into(0, header(0, 8, 1), out, deadline, "allreduce #0")
    assert list(out) == [3] * 8
    assert b.recv_credit(0, deadline, "allreduce #0") == 2
    assert bytes(b.recv(0, p2p, deadline, "recv #0")) == bytes([9] * 4)
    assert b.recv_credit(0, deadline, "allreduce #0") == 5
    a.send_credit(1, 6, "allreduce #0")
    arrived(b)
    b.screen(0, Wait("allreduce #1", deadline, header(1, 8)))  # a board wait sets it aside
    assert b.recv_credit(0, deadline, "allreduce #1") == 6
    started = time.monotonic()
    with pytest.raises(CommTimeout) as info:
        b.recv_credit(0, time.monotonic() + 0.2, "allreduce #1")
    assert time.monotonic() - started < 3 and info.value.peer == 0
    assert info.value.op == "allreduce #1"
    a.send_credit(1, 7, "allreduce #1")
    arrived(b)
    assert b.leftover() is None  # a credit left unread at close proves nothing


@pytest.mark.timeout(30)
def test_a_receive_times_out_naming_its_own_op_and_peer(pair):
    a, b = pair
    a.send(1, header(0, 8), np.zeros(8, np.uint8), "allreduce #0")
    b.recv(0, header(0, 8), time.monotonic() + 10, "allreduce #0")
    started = time.monotonic()
    with pytest.raises(CommTimeout) as info:  # the op named is this call's, not the last one's
        b.recv(0, header(1, 8), time.monotonic() + 0.3, "broadcast #1")
    assert 0.25 < time.monotonic() - started < 3
    assert info.value.op == "broadcast #1" and info.value.peer == 0 and info.value.rank == 1


@pytest.mark.timeout(30)
def test_an_abort_wakes_a_receive_that_waits_on_another_peer(pair):
    a, b = pair
    a.abort(3, "ValueError: out of memory on rank 0")
    with pytest.raises(RemoteError, match="rank 0 failed.*out of memory") as info:
        b.recv(0, header(3, 8), time.monotonic() + 10, "allreduce #3")
    assert info.value.peer == 0 and info.value.op == "allreduce #3"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["local", "local-mailbox", "socket-tcp"])
def test_a_send_to_a_closed_peer_names_the_op_of_the_send(kind):
    """The per-op state travels with the call: a send that finds its peer gone names the op
    it belongs to, even after a receive of another op ran on the same transport."""
    a, b = make_pair(kind)
    try:
        b.send(0, header(0, 8, sender=1), np.zeros(8, np.uint8), "barrier #0")
        a.recv(1, header(0, 8, sender=1), time.monotonic() + 10, "barrier #0")
        b.close()
        big = np.zeros(4 << 20, np.uint8)
        deadline = time.monotonic() + 10
        with pytest.raises(PeerLostError) as info:
            for i in range(64):  # until the pipe (or the socket's tracker) tells
                h = a.send(1, header(1, big.nbytes, i), big, "allgather #1")
                if h is not None:
                    a.wait_sent(1, h, deadline, "allgather #1")
        assert info.value.op == "allgather #1" and info.value.peer == 1
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["local", "local-mailbox"])
def test_counters_show_which_path_payloads_took(kind):
    a, b = make_pair(kind)
    try:
        a.send(1, header(0, 16), np.zeros(16, np.uint8), "x")
        a.send(1, header(0, SHM_MIN_BYTES, 1), np.zeros(SHM_MIN_BYTES, np.uint8), "x")
        boxed = int(kind == "local-mailbox")
        assert a.counters == {"mailbox": boxed, "pipe": 1 - boxed, "shm": 1, "shm_full": 0,
                              "doorbell": 0}
        assert a.counters["socket"] == 0
    finally:
        a.close()
        b.close()


def small(i: int) -> np.ndarray:
    return np.full(8, i % 251, np.uint8)


@pytest.mark.timeout(30)
def test_a_full_mailbox_overflows_into_the_pipe_and_order_holds():
    """More small messages than the mailbox has slots, with large ones between them, sent
    before the receiver reads any: the rest go down the pipe and every message arrives in
    order, whole, whichever path it took."""
    a, b = make_pair("local-mailbox")
    try:
        sizes = [8] * (mailbox.SLOTS + 5) + [SHM_MIN_BYTES] + [8] * 3 + [0, 8]
        payloads = [small(i) if n == 8 else np.arange(n, dtype=np.uint8) for i, n in
                    enumerate(sizes)]
        deadline = time.monotonic() + 10
        received = 0

        def receive(upto: int) -> None:
            nonlocal received
            for i in range(received, upto):
                got = np.frombuffer(bytes(b.recv(0, header(0, sizes[i], i), deadline, "x")),
                                    np.uint8)
                assert np.array_equal(got, payloads[i]), f"message {i} arrived changed"
            received = upto

        for i, (n, p) in enumerate(zip(sizes, payloads, strict=True)):
            a.send(1, header(0, n, i), p if n else None, "x")
            if i == mailbox.SLOTS + 2:  # slots freed while later messages wait in the pipe
                assert a.counters["mailbox"] == mailbox.SLOTS and a.counters["pipe"] == 3
                receive(3)
        assert a.counters["mailbox"] > mailbox.SLOTS
        receive(len(sizes))
        # slots freed as they were read: the next messages use the mailbox again
        before = a.counters["mailbox"]
        a.send(1, header(1, 8), small(7), "y")
        assert a.counters["mailbox"] == before + 1
        assert np.array_equal(np.frombuffer(bytes(b.recv(0, header(1, 8), deadline, "y")),
                                            np.uint8), small(7))
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_a_sleeping_receiver_is_woken_by_the_mailbox_doorbell(monkeypatch):
    """A receive that has gone to sleep in poll is woken by the sender's doorbell, not by
    its periodic look at the mailbox or its stall probe (both made an hour long here)."""
    monkeypatch.setattr(zmq_control, "STALL_PROBE_S", 3600.0)
    a, b = make_pair("local-mailbox")
    try:
        link = b.links[0]
        link.spin_s = 0.0
        link.max_sleep_ms = 3_600_000
        timer = threading.Timer(0.3, lambda: a.send(1, header(0, 8), small(3), "x"))
        timer.start()
        started = time.monotonic()
        got = b.recv(0, header(0, 8), time.monotonic() + 20, "x")
        assert time.monotonic() - started < 10
        assert np.array_equal(np.frombuffer(bytes(got), np.uint8), small(3))
        timer.join()
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_messages_in_the_mailbox_are_read_before_the_peer_is_reported_lost():
    a, b = make_pair("local-mailbox")
    try:
        for i in range(3):
            a.send(1, header(0, 8, i), small(i), "x")
        a.close()
        deadline = time.monotonic() + 10
        for i in range(3):
            got = b.recv(0, header(0, 8, i), deadline, "x")
            assert np.array_equal(np.frombuffer(bytes(got), np.uint8), small(i))
        with pytest.raises(PeerLostError) as info:
            b.recv(0, header(0, 8, 3), deadline, "x")
        assert info.value.peer == 0 and info.value.op == "x"
    finally:
        b.close()


@pytest.mark.timeout(30)
def test_a_sender_learns_that_its_mailbox_frames_will_never_be_read():
    """A mailbox write cannot fail the way a pipe's does: once an op has sent, the link
    checks that a receiver still holding unread frames is alive. One that read them and
    closed is fine; one gone with frames unread (its pipe's end closed, nothing released) is
    a PeerLostError naming the sending op."""
    a, b = make_pair("local-mailbox")
    try:
        a.send(1, header(0, 8), small(1), "x")
        b.recv(0, header(0, 8), time.monotonic() + 10, "x")
        a.check_delivered(1, "x")
        a.send(1, header(1, 8), small(2), "y")
        a.check_delivered(1, "y")  # unread, but the receiver is alive: it may read it later
        os.close(b.links[0].pipe_in.fd)  # the receiving process dies: its fds close
        time.sleep(2 * local_link._CHECK_EVERY_S)  # it asks at most this often
        with pytest.raises(PeerLostError, match="still had data to send") as info:
            a.check_delivered(1, "y")
        assert info.value.peer == 1 and info.value.op == "y"
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_a_receiver_that_closes_after_reading_is_not_a_lost_peer():
    a, b = make_pair("local-mailbox")
    try:
        for i in range(3):
            a.send(1, header(0, 8, i), small(i), "x")
        for i in range(3):
            b.recv(0, header(0, 8, i), time.monotonic() + 10, "x")
        b.close()
        a.check_delivered(1, "x")
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_order_holds_when_the_mailbox_fills_between_the_receivers_two_looks():
    """The receiver finds the mailbox empty, and before it looks at the pipe the sender fills
    the mailbox and spills the next message into the pipe: the pipe then shows a later
    message than the one the receiver waits for, which is in the mailbox by then. (The
    sender's burst is made to happen exactly there, by running it from the pipe's peek.)"""
    a, b = make_pair("local-mailbox")
    try:
        pipe = b.links[0].pipe_in
        peek = pipe.peek
        burst = mailbox.SLOTS + 3

        def peek_after_a_burst(n: int) -> bytes | None:
            if a.counters["mailbox"] == 0:
                for i in range(burst):
                    a.send(1, header(0, 8, i), small(i), "x")
            return peek(n)

        pipe.peek = peek_after_a_burst
        deadline = time.monotonic() + 10
        for i in range(burst):
            got = b.recv(0, header(0, 8, i), deadline, "x")
            assert np.array_equal(np.frombuffer(bytes(got), np.uint8), small(i)), i
        assert a.counters["mailbox"] == mailbox.SLOTS and a.counters["pipe"] == 3
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_a_shared_memory_payload_stays_intact_until_it_is_released():
    """A payload the receiver holds (a view of the ring) is the sender's to overwrite only
    once the receiver releases it: the next message lands elsewhere until then, and after
    the release the ring starts over on the same memory."""
    a, b = make_pair("local")
    try:
        deadline = time.monotonic() + 10
        first, second = (np.full(SHM_MIN_BYTES, v, np.uint8) for v in (1, 2))
        a.send(1, header(0, SHM_MIN_BYTES, 0), first, "x")
        held = b.recv(0, header(0, SHM_MIN_BYTES, 0), deadline, "x")
        a.send(1, header(0, SHM_MIN_BYTES, 1), second, "x")
        assert np.array_equal(held, first), "overwritten while still held"
        b.release(0)
        a.send(1, header(0, SHM_MIN_BYTES, 2), second, "x")  # the ring may reuse it now
        got = b.recv(0, header(0, SHM_MIN_BYTES, 1), deadline, "x")
        assert np.array_equal(got, second)
    finally:
        a.close()
        b.close()
