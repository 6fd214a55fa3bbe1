"""Deadlines and waits, timed: an op fails after the timeout it was given (not before, not
much later), a barrier returns only once every rank has entered it, and a receive spins for
as long as ``RINGCOMM_SPIN_US`` says.

In-process groups (``run_group``) and real ZeroMQ transports (``ringcomm.init`` in one
thread per rank on 127.0.0.1), plus torch's ``init_process_group(timeout=...)`` in two
processes. Bounds leave room for a noisy two-core machine but are far tighter than the
errors they guard against (a timeout several times too long, a barrier that does not wait).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import ringcomm
from ringcomm import CommTimeout, RemoteError
from ringcomm.runtime.local import run_group

pytestmark = pytest.mark.timeout(60)

SLACK = 1.5  # seconds an error may come after its deadline on a busy machine


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zmq_group(world: int, fn: Callable[[Any], Any], *, timeout: float,
              limit: float = 30.0) -> list[Any]:
    """``fn(comm)`` on every rank of a real group (``ringcomm.init``, ZeroMQ transport),
    one thread per rank; a rank's exception is returned in its slot. Every rank keeps its
    communicator open until all have finished ``fn``, so that a rank that skips an op is
    still there (its peers time out instead of seeing it leave)."""
    store = f"127.0.0.1:{free_port()}"
    results: list[Any] = [None] * world
    done = threading.Barrier(world)

    def rank_main(r: int) -> None:
        comm = None
        try:
            comm = ringcomm.init(rank=r, world_size=world, store=store, timeout=timeout)
            results[r] = fn(comm)
        except BaseException as err:  # noqa: BLE001 - returned to the test
            results[r] = err
        finally:
            with contextlib.suppress(threading.BrokenBarrierError):
                done.wait(limit)
            if comm is not None:  # a rank that skipped an op finds its peers' messages
                with contextlib.suppress(ringcomm.DesyncError):  # at close, and says so
                    comm.close()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True,
                                name=f"test-rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit)
    assert not any(t.is_alive() for t in threads), f"a rank did not finish in {limit} s"
    return results


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(start, end, result or exception) of ``fn()``, on the monotonic clock."""
    start = time.monotonic()
    try:
        res = fn()
    except Exception as err:  # noqa: BLE001 - returned to the test
        res = err
    return start, time.monotonic(), res


def check_timeouts(results: list, skipper: int, timeout: float) -> None:
    """Ranks other than ``skipper`` waited for it: each failed, none before its deadline
    and none much after. A rank whose deadline passed raised CommTimeout (at least one
    did); every other one raised RemoteError, told so by a rank that timed out."""
    waiting = [results[r] for r in range(len(results)) if r != skipper]
    assert results[skipper] == "skipped", results[skipper]
    for res in waiting:
        assert not isinstance(res, BaseException), res  # a failure of the harness itself
    kinds = [type(err).__name__ for _, _, err in waiting]
    assert set(kinds) <= {"CommTimeout", "RemoteError"}, waiting
    timeouts = [(s, e, err) for s, e, err in waiting if isinstance(err, CommTimeout)]
    assert timeouts, f"no rank timed out: {waiting}"
    earliest_deadline = min(s for s, _, _ in waiting) + timeout
    for start, end, err in waiting:
        # nobody gives up before a deadline (a RemoteError can only follow a timeout)
        assert end >= earliest_deadline, (end - start, err)
        assert end - start <= timeout + SLACK, f"{end - start:.2f} s for a {timeout} s timeout"
    timed_out = {err.rank for _, _, err in timeouts}
    for _, _, err in waiting:
        if isinstance(err, RemoteError):
            assert err.peer in timed_out and "CommTimeout" in str(err), (err, timed_out)
    for start, end, err in timeouts:
        assert timeout <= end - start <= timeout + SLACK, (end - start, err)
        assert err.rank is not None and err.op is not None and "allreduce" in err.op, err


# --------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("world", [2, 3, 5])
def test_a_collective_times_out_after_the_timeout_it_was_given(world):
    timeout = 0.6
    skipper = world // 2

    def fn(comm):
        if comm.rank == skipper:
            return "skipped"
        return timed(lambda: comm.allreduce(np.ones(16)))

    check_timeouts(run_group(world, fn, timeout=timeout), skipper, timeout)


def test_a_receive_nobody_sends_to_times_out_after_the_timeout():
    timeout = 0.6

    def fn(comm):
        if comm.rank == 1:
            return "skipped"
        return timed(lambda: comm.recv(np.empty(4), src=1))

    start, end, err = run_group(2, fn, timeout=timeout)[0]
    assert isinstance(err, CommTimeout), err
    assert timeout <= end - start <= timeout + SLACK, end - start


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,shm", [(2, "1"), (2, "0"), (3, "1")])
def test_a_collective_over_zeromq_times_out_after_the_timeout(world, shm, monkeypatch):
    """Pipes and shared memory between local ranks, or ZeroMQ sockets only."""
    monkeypatch.setenv("RINGCOMM_SHM", shm)
    timeout = 0.8  # below the 1 s after which a stalled receive probes its peer
    skipper = world - 1

    def fn(comm):
        if comm.rank == skipper:
            return "skipped"
        return timed(lambda: comm.allreduce(np.ones(16)))

    check_timeouts(zmq_group(world, fn, timeout=timeout), skipper, timeout)


TORCH_RANK = textwrap.dedent("""
    import json, os, sys, time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ringcomm  # noqa: F401 - registers the backend

    rank, port, timeout, sync = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]

    def flag(name):
        open(os.path.join(sync, name), "w").close()

    def wait_for(name):
        end = time.monotonic() + 60
        while not os.path.exists(os.path.join(sync, name)) and time.monotonic() < end:
            time.sleep(0.02)

    flag(f"imported-{rank}")  # start the rendezvous once both have imported torch
    wait_for(f"imported-{1 - rank}")
    dist.init_process_group("ringcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=timeout))
    out = {"rank": rank, "comm_timeout": dist.group.WORLD.comm.timeout}
    print(json.dumps(out), flush=True)
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
            out["error"] = None
        except Exception as err:
            out["error"], out["message"] = type(err).__name__, str(err)[:400]
        out["elapsed"] = time.monotonic() - start
        flag("done")
    else:
        wait_for("done")  # stay in the group, never joining the all_reduce
    try:
        dist.destroy_process_group()
        out["close"] = None
    except Exception as err:
        out["close"] = type(err).__name__
    print(json.dumps(out), flush=True)
    os._exit(0)  # skip torch's slow interpreter shutdown
""")


@pytest.mark.slow  # two processes that import torch: about 6 s
@pytest.mark.timeout(90)
def test_init_process_group_timeout_reaches_the_communicator_and_its_ops(tmp_path):
    """``timeout=`` of ``init_process_group`` is the op timeout (not the 300 s default)."""
    timeout = 2.0
    script = tmp_path / "rank.py"
    script.write_text(TORCH_RANK)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(timeout),
                               str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail("a rank did not finish within 60 s (an op waiting out a much longer "
                    f"timeout than {timeout} s?):\n" + "\n---\n".join(o[-2000:] for o in outs))
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    last = [json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
            for out in outs]
    assert [r["comm_timeout"] for r in last] == [timeout, timeout]
    rank0 = last[0]
    assert rank0["error"] is not None, rank0
    assert rank0["error"] == "CommTimeout" and "timed out" in rank0["message"].lower(), rank0
    assert timeout <= rank0["elapsed"] <= timeout + SLACK, rank0
    # rank 1 skipped an op that rank 0 ran: its close finds rank 0's message and says so
    assert [r["close"] for r in last] == [None, "DesyncError"], last


# --------------------------------------------------------------------------- spin


@dataclass
class Wait:
    """Rank 0's thread in an allreduce that rank 1 joins ``late`` seconds after it."""

    cpu: float  # CPU seconds of the thread over the allreduce
    wall: float
    yields: list[float]  # when the thread yielded the CPU, seconds after the call


def wait_for_a_late_peer(spin_us: str, monkeypatch, late: float = 0.6) -> Wait:
    """Two real ranks (ZeroMQ transport, pipes between them) with RINGCOMM_SPIN_US=spin_us."""
    monkeypatch.setenv("RINGCOMM_SPIN_US", spin_us)
    calls: list[tuple[int, float]] = []
    real_yield = os.sched_yield

    def recorded_yield() -> None:
        calls.append((threading.get_ident(), time.monotonic()))
        real_yield()

    monkeypatch.setattr(os, "sched_yield", recorded_yield)

    def fn(comm):
        x = np.ones(8)
        comm.allreduce(x)  # warm: both ranks have used their channels once
        comm.barrier()
        if comm.rank == 1:
            time.sleep(late)
            comm.allreduce(x)
            return None
        cpu, start = time.thread_time(), time.monotonic()
        comm.allreduce(x)  # a blocking collective runs on the calling thread
        end = time.monotonic()
        mine = [t - start for ident, t in list(calls)
                if ident == threading.get_ident() and start <= t <= end]
        return Wait(time.thread_time() - cpu, end - start, mine)

    res = zmq_group(2, fn, timeout=20.0)
    for r in res:
        assert not isinstance(r, BaseException), r
    assert res[0].wall >= late - 0.1, res[0].wall  # rank 0 did wait for rank 1
    return res[0]


@pytest.mark.timeout(60)
def test_a_receive_spins_for_ringcomm_spin_us_then_sleeps(monkeypatch):
    """RINGCOMM_SPIN_US=500000: the receive polls and yields the CPU for 0.5 s of its 0.9 s
    wait, then sleeps; RINGCOMM_SPIN_US=0: it sleeps at once. The spin burns CPU time on an
    idle machine; on a busy one each yield hands the core over for a whole time slice and
    the spin burns little, so CPU time is compared between the two settings only, and the
    spin is seen directly in when the thread yields."""
    spin = wait_for_a_late_peer("500000", monkeypatch, late=0.9)
    idle = wait_for_a_late_peer("0", monkeypatch, late=0.9)
    assert spin.yields, "no spin at all with RINGCOMM_SPIN_US=500000"
    assert spin.yields[-1] - spin.yields[0] >= 0.3, (spin.yields[0], spin.yields[-1])
    assert spin.yields[-1] <= 0.5 + 0.05, spin.yields[-1]  # the spin ends, the wait goes on
    assert idle.yields == [], f"{len(idle.yields)} yields with RINGCOMM_SPIN_US=0"
    assert spin.cpu > 2 * idle.cpu + 0.002, (spin.cpu, idle.cpu)
    # asleep for the rest of the wait: far less CPU time than its 0.9 s (the yields above say
    # when the spin ended; a slow or loaded machine adds a tenth of a second around the wait
    # itself, recording every yield included)
    assert spin.cpu <= 0.5 + 0.2, spin.cpu


# --------------------------------------------------------------------------- barrier


def check_barrier(times: list[tuple[float, float]]) -> None:
    last_entry = max(entry for entry, _ in times)
    for r, (_entry, exit_) in enumerate(times):
        assert exit_ >= last_entry, f"rank {r} left the barrier before the last rank entered"
        assert exit_ - last_entry <= SLACK, f"rank {r} left {exit_ - last_entry:.2f} s late"


def barrier_fn(delays: list[float]) -> Callable[[Any], tuple[float, float]]:
    def fn(comm):
        time.sleep(delays[comm.rank])
        entry = time.monotonic()
        comm.barrier()
        return entry, time.monotonic()

    return fn


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_barrier_returns_only_after_every_rank_entered(world):
    order = random.Random(world).sample(range(world), world)  # who enters when
    delays = [0.04 * order[r] for r in range(world)]
    check_barrier(run_group(world, barrier_fn(delays), timeout=10.0))


def test_barrier_with_a_rank_missing_fails_on_every_rank_that_entered():
    def fn(comm):
        if comm.rank == 1:
            return "skipped"
        comm.barrier()
        return "passed"

    results = run_group(3, fn, timeout=0.4, return_errors=True)
    assert results[1] == "skipped"
    assert all(isinstance(r, (CommTimeout, RemoteError)) for r in (results[0], results[2])), \
        results


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_barrier_over_zeromq_returns_only_after_every_rank_entered(world):
    delays = [0.3 * ((r + 1) % world) for r in range(world)]  # rank world-1 enters first
    results = zmq_group(world, barrier_fn(delays), timeout=10.0)
    for r in results:
        assert not isinstance(r, BaseException), r
    check_barrier(results)
