"""Point-to-point ops in one process (in-memory channels): receives posted before their
sends on every rank, receives from any rank, ordering, and the errors."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ringcomm import ArgumentError, CommAborted, CommTimeout, DesyncError, RemoteError
from ringcomm.runtime.communicator import Communicator
from ringcomm.runtime.local import run_group
from ringcomm.transport.inmemory import InMemoryNetwork

SEG = 256  # bytes per segment: every message below is several segments


@pytest.mark.parametrize("world", [2, 3, 5])
def test_receives_posted_before_the_sends_on_every_rank_do_not_deadlock(world):
    def fn(comm):
        r, n = comm.rank, comm.world_size
        outs = {p: np.full(100 + p, -1.0) for p in range(n) if p != r}
        recvs = [comm.recv(out, p, tag=3, async_op=True) for p, out in outs.items()]
        sends = [comm.send(np.full(100 + r, float(r)), p, tag=3, async_op=True)
                 for p in range(n) if p != r]
        x = np.ones(5)
        comm.allreduce(x)  # a collective while receives are posted
        for w in recvs + sends:
            w.wait(timeout=10)
        assert all((out == p).all() for p, out in outs.items())
        return x

    for x in run_group(world, fn, segment_bytes=SEG, timeout=10):
        np.testing.assert_array_equal(x, world)


def test_recv_from_any_source_says_who_sent_and_keeps_each_pairs_order():
    def fn(comm):
        if comm.rank == 0:
            got = []
            for _ in range(2 * (comm.world_size - 1)):
                x = np.zeros(3, np.int64)
                w = comm.recv(x, None, async_op=True)
                assert w.wait(timeout=10) is x
                got.append((w.source, int(x[1])))
            return got
        for i in range(2):
            comm.send(np.array([comm.rank, i, 0]), dst=0)
        return None

    got = run_group(4, fn, segment_bytes=SEG, timeout=10)[0]
    assert sorted(got) == [(r, i) for r in (1, 2, 3) for i in (0, 1)]
    for r in (1, 2, 3):  # from one sender, first sent is first received
        assert [i for s, i in got if s == r] == [0, 1]


def test_a_specific_receive_posted_first_gets_the_first_message():
    def fn(comm):
        if comm.rank == 1:
            comm.send(np.array([1.0]), dst=0)
            comm.send(np.array([2.0]), dst=0)
            return None
        a, b = np.zeros(1), np.zeros(1)
        wa = comm.recv(a, 1, async_op=True)
        wb = comm.recv(b, None, async_op=True)
        wb.wait(10)
        wa.wait(10)
        return a[0], b[0], wb.source

    assert run_group(2, fn, timeout=10)[0] == (1.0, 2.0, 1)


def test_a_different_tag_is_a_desync_on_the_receiver_and_aborts_the_sender():
    def fn(comm):
        if comm.rank == 0:
            comm.send(np.ones(4), dst=1, tag=1)
            comm.barrier()
        else:
            comm.recv(np.ones(4), src=0, tag=2)

    errors = run_group(2, fn, timeout=10, return_errors=True)
    assert isinstance(errors[1], DesyncError)
    assert "ranks disagree about the op: rank 0 uses tag 1, rank 1 tag 2." in str(errors[1])
    assert errors[1].op == "recv #0 from rank 0"
    assert isinstance(errors[0], RemoteError)


def test_a_receive_nobody_answers_times_out_and_close_fails_pending_ones():
    net = InMemoryNetwork(2)
    comm = Communicator(net.transport(0), timeout=0.3)
    start = time.monotonic()
    with pytest.raises(CommTimeout, match="no message from rank 1"):
        comm.recv(np.zeros(2), 1)
    assert time.monotonic() - start < 3
    comm.close()

    comm = Communicator(net.transport(0), timeout=30)
    w = comm.recv(np.zeros(2), None, async_op=True)
    with pytest.raises(CommTimeout):
        w.wait(timeout=0.1)  # the wait gives up; the receive stays posted
    comm.close()
    with pytest.raises(CommAborted, match="closed before"):
        w.wait(timeout=5)


def test_bad_point_to_point_arguments_raise_at_the_call():
    net = InMemoryNetwork(1)
    with Communicator(net.transport(0)) as comm, \
            pytest.raises(ArgumentError, match="no other rank"):
        comm.recv(np.zeros(2), None)
    net = InMemoryNetwork(2)
    with Communicator(net.transport(0)) as comm:
        with pytest.raises(ArgumentError, match="tag must be"):
            comm.send(np.zeros(2), 1, tag=-3)
        with pytest.raises(ArgumentError, match="src=5 is out of range"):
            comm.recv(np.zeros(2), 5)
