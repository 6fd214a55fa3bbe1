"""Which async ops run on the caller's thread, and what a caller sees either way.

A small async collective with nothing queued ahead of it runs at once on the caller's
thread (``inline_bytes``, ``RINGCOMM_INLINE_BYTES``): it takes less than the two thread
hand-offs the worker would cost. A large one goes to the worker, so the caller's own work
overlaps it, where the host has a spare core for the worker; where it has not, every size
runs on the caller's thread. Either way the result, the order of ops and the errors are the same: an
inline op's error is raised by ``wait``, as the worker's would be.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from ringcomm import ArgumentError, CommTimeout
from ringcomm.plan.topology import RankFacts, Topology
from ringcomm.runtime.communicator import DEFAULT_INLINE_BYTES, EVERY_SIZE, inline_bytes
from ringcomm.runtime.local import run_group

LATE_S = 0.5


def _late_peer(count: int, *, inline: int | None = None):
    """Rank 0 starts an async allreduce of ``count`` floats at once, rank 1 only after
    ``LATE_S``; rank 0 reports how long its call took and the result after ``wait``."""

    def fn(comm):
        if inline is not None:
            comm.inline_bytes = inline
        x = np.full(count, comm.rank + 1.0, np.float32)
        if comm.rank == 1:
            time.sleep(LATE_S)
        started = time.monotonic()
        work = comm.allreduce(x, async_op=True)
        returned = time.monotonic() - started
        done_at_return = work.is_completed()
        work.wait()
        return returned, done_at_return, x

    return run_group(2, fn)[0]


@pytest.mark.timeout(30)
def test_a_small_async_op_runs_inline_and_returns_completed():
    returned, done, x = _late_peer(16)
    assert done, "a small async op should be complete when the call returns"
    assert returned >= LATE_S * 0.8  # it waited for the late peer on the caller's thread
    assert np.all(x == 3.0)


@pytest.mark.timeout(30)
def test_a_large_async_op_overlaps_the_callers_work_given_a_spare_core():
    returned, done, x = _late_peer(DEFAULT_INLINE_BYTES // 4 + 1,
                                   inline=inline_bytes(spare_core=True))
    assert not done and returned < LATE_S / 2, returned
    assert np.all(x == 3.0)


@pytest.mark.timeout(30)
def test_without_a_spare_core_a_large_async_op_runs_inline_too():
    returned, done, x = _late_peer(DEFAULT_INLINE_BYTES // 4 + 1,
                                   inline=inline_bytes(spare_core=False))
    assert done and returned >= LATE_S * 0.8, returned
    assert np.all(x == 3.0)


def test_a_spare_core_is_two_cores_per_rank_of_the_host():
    def facts(host: str, cpus: int) -> RankFacts:
        return RankFacts(host, host, tuple(range(cpus)), 1)

    two_on_two = Topology((facts("a", 2), facts("a", 2)))
    two_on_four = Topology((facts("a", 4), facts("a", 4)))
    hosts = Topology((facts("a", 2), facts("b", 4), facts("b", 4)))  # 2 for 1, 4 for 2
    assert [two_on_two.spare_core(r) for r in range(2)] == [False, False]
    assert [two_on_four.spare_core(r) for r in range(2)] == [True, True]
    assert [hosts.spare_core(r) for r in range(3)] == [True, True, True]
    assert inline_bytes(spare_core=False) == EVERY_SIZE


@pytest.mark.timeout(30)
def test_inline_bytes_zero_sends_every_async_op_to_the_worker():
    returned, done, x = _late_peer(16, inline=0)
    assert not done and returned < LATE_S / 2, returned
    assert np.all(x == 3.0)


@pytest.mark.timeout(30)
def test_an_inline_async_ops_error_is_raised_by_wait_not_by_the_call():
    def fn(comm):
        if comm.rank == 1:
            return None  # never joins
        work = comm.allreduce(np.ones(4, np.float32), async_op=True)
        assert work.is_completed()
        with pytest.raises(CommTimeout, match="no message from rank 1"):
            work.wait()
        return "raised by wait"

    assert run_group(2, fn, timeout=0.3, return_errors=True)[0] == "raised by wait"


def test_inline_bytes_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RINGCOMM_INLINE_BYTES", "4096")
    assert inline_bytes() == 4096
    assert inline_bytes(spare_core=False) == 4096  # the setting wins
    monkeypatch.setenv("RINGCOMM_INLINE_BYTES", "-1")
    with pytest.raises(ArgumentError, match="RINGCOMM_INLINE_BYTES='-1' is negative"):
        inline_bytes()
    monkeypatch.delenv("RINGCOMM_INLINE_BYTES")
    assert inline_bytes() == DEFAULT_INLINE_BYTES


def job_torch_pair(rank: int, world: int, store: str, late: float, **_: object) -> list:
    """A rank of a torch group of two (``mp_helpers.Cluster``): a 1 MiB allreduce with
    ``asyncOp`` False, then True, rank 1 joining each ``late`` s after rank 0. For each:
    ``asyncOp``, how long the call took, whether its Work was complete when the call
    returned, and the result."""
    import os

    import torch
    import torch.distributed as dist

    # the default, not every size as on a host without a spare core (undone after the job)
    os.environ["RINGCOMM_INLINE_BYTES"] = str(DEFAULT_INLINE_BYTES)
    dist.init_process_group("ringcomm", rank=rank, world_size=world,
                            init_method=f"tcp://{store}")
    seen = []
    try:
        pg = dist.group.WORLD
        big = torch.ones(1 << 18)  # 1 MiB: above inline_bytes
        for async_op in (False, True):
            big.fill_(1.0)
            if rank == 1:
                time.sleep(late)
            opts = dist.AllreduceOptions()
            opts.asyncOp = async_op
            started = time.monotonic()
            work = pg.allreduce([big], opts)
            returned, done = time.monotonic() - started, work.is_completed()
            work.wait()
            seen.append((async_op, returned, done, big[0].item()))
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return seen


@pytest.mark.timeout(90)
def test_torch_says_when_its_caller_waits_and_such_an_op_completes_in_the_call(cluster):
    """``dist.all_reduce(t)`` sets ``opts.asyncOp = False``: the backend then runs the op as
    a blocking call (no hand-off to the worker) and returns a completed Work, whatever its
    size; with ``asyncOp`` True a large op still returns at once and overlaps (as on a host
    with a spare core: ``RINGCOMM_INLINE_BYTES`` at its default there). Rank 0's view, in
    two processes of the shared pool, each a torch group."""
    sync, asyn = cluster.run(2, "test_inline.job_torch_pair", late=LATE_S, timeout=80)[0]
    assert sync[0] is False and sync[2] is True and sync[1] >= LATE_S * 0.8, sync
    assert asyn[0] is True and asyn[2] is False and asyn[1] < LATE_S / 2, asyn
    assert sync[3] == asyn[3] == 2.0
