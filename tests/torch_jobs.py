"""Real ranks for the torch-backend tests: spawned once, each test sends them a job.

Starting a process that imports torch costs seconds here, so ``Ranks`` starts its processes
once per test module (``OnThePool`` uses the session's shared ones) and runs *jobs* on
them: functions of this module that call ``dist.init_process_group("ringcomm")`` (tcp://,
file:// or env://), do their checks, destroy the group and return what the test asserts
on. Every job re-initialises torch's default group in a process that has had one before,
which is the re-init check too. A job that raises fails the test with its traceback; a
hang is killed after the job's limit.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import multiprocessing
import os
import queue
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import ringcomm  # noqa: F401 - registers the backend
from ringcomm import ArgumentError, CommError, CommTimeout


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the pool


def _serve(rank: int, inbox: Any, outbox: Any, jobs_module: str = __name__) -> None:
    """A rank's loop: run the jobs named in ``inbox`` (functions of ``jobs_module``). Told
    to stop (``None``), the process runs its exit hooks (the queues are flushed) and ends
    without tearing the interpreter down, which takes about a second with torch loaded."""
    torch.set_num_threads(1)
    jobs = importlib.import_module(jobs_module)
    while True:
        msg = inbox.get()
        if msg is None:
            break
        job_id, name, kwargs = msg
        try:
            result = ("ok", getattr(jobs, name)(rank=rank, **kwargs), "")
        except BaseException as err:  # noqa: BLE001 - sent back to the test
            result = ("err", repr(err), traceback.format_exc())
        outbox.put((job_id, rank, *result))
    atexit._run_exitfuncs()  # multiprocessing's among them: the outbox is flushed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Ranks:
    """``size`` spawned processes that run jobs as the ranks of one group."""

    jobs_module = __name__  # where the jobs the ranks run are defined
    role = "torch"  # names the processes

    def __init__(self, size: int) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.size = size
        self.outbox = self.ctx.Queue()
        self.procs: list[Any] = [None] * size
        self.inboxes: list[Any] = [None] * size
        self._ids = itertools.count()

    def start(self, count: int | None = None) -> None:
        """Start ranks ``0..count-1`` (all of them by default) that are not running."""
        for r in range(self.size if count is None else count):
            p = self.procs[r]
            if p is None or not p.is_alive():
                self.inboxes[r] = self.ctx.Queue()
                p = self.ctx.Process(target=_serve, daemon=True, name=f"{self.role}-rank-{r}",
                                     args=(r, self.inboxes[r], self.outbox, self.jobs_module))
                p.start()
                self.procs[r] = p

    def close(self) -> None:
        for r, p in enumerate(self.procs):
            if p is not None and p.is_alive():
                with contextlib.suppress(Exception):
                    self.inboxes[r].put(None)
        for p in self.procs:
            if p is not None:
                p.join(5)
                if p.is_alive():
                    p.kill()

    def run(self, job: str, world: int | None = None, timeout: float = 60.0,
            **kwargs: Any) -> list[Any]:
        """Run ``job(rank=r, world=world, **kwargs)`` on ranks ``0..world-1``."""
        world = world or self.size
        self.start(world)
        job_id = next(self._ids)
        ports = [free_port() for _ in range(3)]
        with tempfile.TemporaryDirectory(prefix="ringcomm-torch-") as folder:
            kwargs = dict(kwargs, world=world, port=ports[0], ports=ports,
                          file=os.path.join(folder, "init"))
            return self._run(job, job_id, world, timeout, kwargs)

    def _run(self, job: str, job_id: int, world: int, timeout: float,
             kwargs: dict[str, Any]) -> list[Any]:
        for r in range(world):
            self.inboxes[r].put((job_id, job, kwargs))
        results: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{job}: ranks {sorted(set(range(world)) - set(results))}"
                                         f" did not finish within {timeout} s")
                try:
                    jid, rank, status, value, tb = self.outbox.get(timeout=min(left, 0.5))
                except queue.Empty:
                    for r in range(world):
                        if r not in results and not self.procs[r].is_alive():
                            raise AssertionError(f"{job}: rank {r} died") from None
                    continue
                if jid == job_id:
                    results[rank] = (status, value, tb)
        except BaseException:
            for p in self.procs:  # leave no rank half-way through a job
                if p is not None and p.is_alive():
                    p.kill()
            raise
        failed = [r for r in range(world) if results[r][0] == "err"]
        if failed:  # every rank's error: the first may only be a peer's leaving
            said = "\n".join(f"rank {r}: {results[r][1]}" for r in failed)
            raise AssertionError(f"{job} failed on ranks {failed}:\n{said}\n"
                                 + "\n".join(results[r][2] for r in failed))
        return [results[r][1] for r in range(world)]


class OnThePool:
    """``Ranks``' ``run`` on the processes of an ``mp_helpers.Cluster`` (the session's shared
    rank pool, ``conftest.cluster``): processes that have imported torch for one module's
    jobs run the next module's too. A job (a function of ``jobs_module``) gets what
    ``Ranks`` gives it (three free ports, an init file in a folder of its own) and runs
    with one torch thread, as there."""

    def __init__(self, cluster: Any, size: int, jobs_module: str = __name__) -> None:
        self.cluster = cluster
        self.size = size
        self.jobs_module = jobs_module

    def run(self, job: str, world: int | None = None, timeout: float = 60.0,
            **kwargs: Any) -> list[Any]:
        """Run ``job(rank=r, world=world, **kwargs)`` on ranks ``0..world-1``."""
        with tempfile.TemporaryDirectory(prefix="ringcomm-torch-") as folder:
            return self.cluster.run(world or self.size, f"{__name__}.job_on_the_pool",
                                    timeout=timeout, jobs_module=self.jobs_module,
                                    torch_job=job, folder=folder, **kwargs)


def job_on_the_pool(rank: int, world: int, stores: list[str], jobs_module: str,
                    torch_job: str, folder: str, **kwargs: Any) -> Any:
    """A pool's job (``OnThePool``): the function ``torch_job`` of ``jobs_module``, with
    ports taken from the pool's fresh store addresses."""
    for given in ("store", "transport"):  # the pool's own, not the job's
        kwargs.pop(given, None)
    job = getattr(importlib.import_module(jobs_module), torch_job)
    ports = [int(address.rsplit(":", 1)[1]) for address in stores[:3]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return job(rank=rank, world=world, port=ports[0], ports=ports,
                   file=os.path.join(folder, "init"), **kwargs)
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def group(rank: int, world: int, port: int, file: str, how: str = "tcp",
          timeout: float = 30.0) -> Iterator[None]:
    """torch's default group on ringcomm for the duration of a job, torn down after."""
    kw: dict[str, Any] = dict(backend="ringcomm", rank=rank, world_size=world,
                              timeout=timedelta(seconds=timeout))
    if how == "tcp":
        kw["init_method"] = f"tcp://127.0.0.1:{port}"
    elif how == "file":
        kw["init_method"] = f"file://{file}"
    elif how == "env":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        kw["init_method"] = "env://"
    elif how == "store":
        kw["store"] = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                                    timeout=timedelta(seconds=timeout))
    dist.init_process_group(**kw)
    try:
        yield
    finally:
        dist.destroy_process_group()


def ringcomm_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ringcomm")]


def check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


# --------------------------------------------------------------------------- collectives


def vals(rank: int, n: int, dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    """Small integers, exact in every dtype and in sums/products over a few ranks."""
    base = (torch.arange(n) * 7 + rank * 3 + salt) % 5 + 1
    if dtype == torch.bool:
        return (base % 2).bool()
    return base.to(dtype)


def job_collectives(rank: int, world: int, port: int, file: str, how: str = "tcp", **_: Any) -> int:
    """Every collective torch exposes, checked against values computed locally."""
    checks = 0

    def ok(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        nonlocal checks
        check_equal(got, want, what)
        checks += 1

    ranks = range(world)
    with group(rank, world, port, file, how):
        assert dist.get_backend() == "ringcomm"
        # all_reduce: every op, several dtypes, a non-contiguous and a 0-dim tensor
        ops = {
            dist.ReduceOp.SUM: lambda ts: torch.stack(ts).sum(0),
            dist.ReduceOp.PRODUCT: lambda ts: torch.stack(ts).prod(0),
            dist.ReduceOp.MIN: lambda ts: torch.stack(ts).min(0).values,
            dist.ReduceOp.MAX: lambda ts: torch.stack(ts).max(0).values,
            dist.ReduceOp.AVG: lambda ts: torch.stack(ts).sum(0) / world,
            dist.ReduceOp.BAND: lambda ts: _fold(ts, torch.bitwise_and),
            dist.ReduceOp.BOR: lambda ts: _fold(ts, torch.bitwise_or),
            dist.ReduceOp.BXOR: lambda ts: _fold(ts, torch.bitwise_xor),
        }
        for op, ref in ops.items():
            bitwise = op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR)
            dtypes = [torch.int64, torch.uint8, torch.bool] if bitwise else [
                torch.float32, torch.float64, torch.bfloat16, torch.float16]
            if op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
                dtypes += [torch.int32, torch.int8]
            for dtype in dtypes:
                t = vals(rank, 11, dtype)
                dist.all_reduce(t, op=op)
                # the expected values come from the CPU: on CUDA, torch divides by a
                # number as a multiplication by its inverse, which can round differently
                want = ref([vals(r, 11, dtype).cpu() for r in ranks]).to(dtype).to(t.device)
                ok(t, want, f"all_reduce {op} {dtype}")
        m = torch.arange(24.0).reshape(4, 6) * (rank + 1)
        col = m[:, 1]  # non-contiguous: results must land in m
        dist.all_reduce(col)
        ok(m[:, 1], torch.arange(24.0).reshape(4, 6)[:, 1] * sum(r + 1 for r in ranks),
           "non-contiguous")
        ok(m[:, 0], torch.arange(24.0).reshape(4, 6)[:, 0] * (rank + 1), "untouched column")
        s = torch.tensor(float(rank + 1))
        dist.all_reduce(s)
        ok(s, torch.tensor(float(sum(r + 1 for r in ranks))), "0-dim")
        z = torch.zeros(2, 3, dtype=torch.complex64) + (rank + 1j)
        dist.all_reduce(z)
        ok(z, torch.zeros(2, 3, dtype=torch.complex64) + sum(r + 1j for r in ranks), "complex")
        big = torch.full((3 << 18,), float(rank))  # 3 MiB: several segments
        dist.all_reduce(big)
        ok(big, torch.full((3 << 18,), float(sum(ranks))), "3 MiB")
        # coalesced, and the coalescing manager
        ts = [vals(rank, 3), vals(rank, 5), vals(rank, 6).reshape(2, 3).t()]
        dist.all_reduce_coalesced(ts)
        for i, t in enumerate(ts[:2]):
            ok(t, sum(vals(r, t.numel()) for r in ranks), f"all_reduce_coalesced {i}")
        ok(ts[2], sum(vals(r, 6) for r in ranks).reshape(2, 3).t(), "coalesced non-contiguous")
        ts = [vals(rank, 4), vals(rank, 6)]
        with dist._coalescing_manager(async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t)
        cm.wait()
        for t in ts:
            ok(t, sum(vals(r, t.numel()) for r in ranks), "coalescing manager")
        # broadcast, reduce from every root
        for root in ranks:
            b = vals(rank, 6, torch.int64)
            dist.broadcast(b, src=root)
            ok(b, vals(root, 6, torch.int64), f"broadcast from {root}")
            t = vals(rank, 5, torch.float64)
            dist.reduce(t, dst=root, op=dist.ReduceOp.MAX)
            if rank == root:
                ok(t, torch.stack([vals(r, 5, torch.float64) for r in ranks]).max(0).values,
                   "reduce")
        # all_gather and friends
        outs = [torch.empty(3, 2) for _ in ranks]
        dist.all_gather(outs, vals(rank, 6).reshape(3, 2))
        for r in ranks:
            ok(outs[r], vals(r, 6).reshape(3, 2), "all_gather")
        out = torch.empty(world * 4, dtype=torch.int16)
        dist.all_gather_into_tensor(out, vals(rank, 4, torch.int16))
        ok(out, torch.cat([vals(r, 4, torch.int16) for r in ranks]), "all_gather_into_tensor")
        lists = [[torch.empty(2), torch.empty(3)] for _ in ranks]
        dist.all_gather_coalesced(lists, [vals(rank, 2), vals(rank, 3, salt=1)])
        for r in ranks:
            ok(lists[r][0], vals(r, 2), "all_gather_coalesced 0")
            ok(lists[r][1], vals(r, 3, salt=1), "all_gather_coalesced 1")
        u16 = [torch.empty(3, dtype=torch.uint16) for _ in ranks]  # moved as bytes
        dist.all_gather(u16, torch.full((3,), 60000 + rank, dtype=torch.uint16))
        for r in ranks:
            ok(u16[r].int(), torch.full((3,), 60000 + r, dtype=torch.int32), "uint16 bytes")
        # reduce_scatter
        out = torch.empty(3)
        dist.reduce_scatter(out, [vals(rank, 3, salt=j) for j in ranks])
        ok(out, sum(vals(r, 3, salt=rank) for r in ranks), "reduce_scatter")
        out = torch.empty(2, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, vals(rank, 2 * world, torch.float64),
                                   op=dist.ReduceOp.MIN)
        want = torch.stack([vals(r, 2 * world, torch.float64) for r in ranks]).min(0).values
        ok(out, want[2 * rank: 2 * rank + 2], "reduce_scatter_tensor")
        # gather, scatter
        for root in ranks:
            gl = [torch.empty(4) for _ in ranks] if rank == root else None
            dist.gather(vals(rank, 4), gl, dst=root)
            if rank == root:
                for r in ranks:
                    ok(gl[r], vals(r, 4), "gather")
            out = torch.empty(3, dtype=torch.int32)
            sl = [vals(j, 3, torch.int32, salt=root) for j in ranks] if rank == root else None
            dist.scatter(out, sl, src=root)
            ok(out, vals(rank, 3, torch.int32, salt=root), "scatter")
        # all_to_all: tensor lists of different sizes; single with even and uneven splits
        ins = [torch.full((rank + j + 1,), float(10 * rank + j)) for j in ranks]
        outs = [torch.empty(j + rank + 1) for j in ranks]
        dist.all_to_all(outs, ins)
        for j in ranks:
            ok(outs[j], torch.full((j + rank + 1,), float(10 * j + rank)), "all_to_all")
        x = torch.arange(world * 2.0) + 100 * rank
        y = torch.empty(world * 2)
        dist.all_to_all_single(y, x)
        ok(y, torch.cat([torch.arange(2.0 * rank, 2.0 * rank + 2) + 100 * j for j in ranks]),
           "all_to_all_single even")
        in_splits = [j + 1 for j in ranks]  # rank r sends j + 1 rows of 2 to rank j
        out_splits = [rank + 1] * world
        x = torch.arange(sum(in_splits) * 2.0).reshape(-1, 2) + 1000 * rank
        y = torch.empty(sum(out_splits), 2)
        dist.all_to_all_single(y, x, out_splits, in_splits)
        want = [(torch.arange(sum(j + 1 for j in ranks) * 2.0).reshape(-1, 2) + 1000 * j)
                [sum(range(1, rank + 1)): sum(range(1, rank + 2))] for j in ranks]
        ok(y, torch.cat(want), "all_to_all_single uneven")
        x16 = x.to(torch.int32).to(torch.uint16)  # a dtype moved as bytes: splits in bytes
        y16 = torch.empty(sum(out_splits), 2, dtype=torch.uint16)
        dist.all_to_all_single(y16, x16, out_splits, in_splits)
        ok(y16.int(), torch.cat(want).int(), "all_to_all_single uneven, as bytes")
        dist.barrier()
        # objects
        objs: list[Any] = [None] * world
        dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
        assert objs == [{"rank": r, "s": "x" * r} for r in ranks], objs
        blist = [rank, "hello"] if rank == 0 else [None, None]
        dist.broadcast_object_list(blist, src=0)
        assert blist == [0, "hello"], blist
        got: list[Any] = [None] * world if rank == 0 else None
        dist.gather_object(("r", rank), got, dst=0)
        if rank == 0:
            assert got == [("r", r) for r in ranks], got
        sout: list[Any] = [None]
        dist.scatter_object_list(sout, [{"to": r} for r in ranks] if rank == 0 else None, 0)
        assert sout == [{"to": rank}], sout
        checks += 4
        # functional collectives (they go through C++ and look the group up by name)
        import torch.distributed._functional_collectives as fc

        r = fc.all_reduce(vals(rank, 4), "sum", dist.group.WORLD)
        ok(fc.wait_tensor(r), sum(vals(q, 4) for q in ranks), "functional all_reduce")
        r = fc.all_gather_tensor(vals(rank, 3), 0, dist.group.WORLD)
        ok(fc.wait_tensor(r), torch.cat([vals(q, 3) for q in ranks]), "functional all_gather")
        r = fc.reduce_scatter_tensor(vals(rank, 2 * world), "sum", 0, dist.group.WORLD)
        ok(fc.wait_tensor(r), sum(vals(q, 2 * world) for q in ranks)[2 * rank: 2 * rank + 2],
           "functional reduce_scatter")
    return checks


def _fold(ts: list[torch.Tensor], fn: Any) -> torch.Tensor:
    out = ts[0]
    for t in ts[1:]:
        out = fn(out, t)
    return out


def job_p2p(rank: int, world: int, port: int, file: str, how: str = "tcp", **_: Any) -> dict:
    """send/recv with tags, isend/irecv posted in either order, batch_isend_irecv, recv from
    any source (dist.recv's return value and irecv's _source_rank)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    with group(rank, world, port, file, how):
        # both ranks post their receive first: must not deadlock
        got = torch.empty(3 << 18)  # 3 MiB
        r = dist.irecv(got, src=prv, tag=7)
        s = dist.isend(torch.full((3 << 18,), float(rank)), dst=nxt, tag=7)
        r.wait()
        s.wait()
        check_equal(got, torch.full((3 << 18,), float(prv)), "irecv")
        # batch_isend_irecv with every peer, receives listed before sends
        ops, bufs = [], {}
        for peer in range(world):
            if peer == rank:
                continue
            bufs[peer] = torch.empty(peer + 1, dtype=torch.int64)
            ops.append(dist.P2POp(dist.irecv, bufs[peer], peer, tag=peer))
            ops.append(dist.P2POp(dist.isend, torch.full((rank + 1,), rank), peer, tag=rank))
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        for peer, b in bufs.items():
            check_equal(b, torch.full((peer + 1,), peer), "batch_isend_irecv")
        # blocking send/recv of a non-contiguous tensor and a 0-dim one
        if rank == 0:
            dist.send(torch.arange(12.0).reshape(3, 4)[:, 2], dst=1)
            dist.send(torch.tensor(5, dtype=torch.int16), dst=1)
        elif rank == 1:
            m = torch.zeros(3, 4)
            dist.recv(m[:, 1], src=0)
            check_equal(m[:, 1], torch.arange(12.0).reshape(3, 4)[:, 2], "recv non-contiguous")
            z = torch.tensor(0, dtype=torch.int16)
            dist.recv(z, src=0)
            check_equal(z, torch.tensor(5, dtype=torch.int16), "recv 0-dim")
        # recv from any source: rank 0 takes one message from each other rank, twice
        sources = []
        if rank == 0:
            for i in range(2 * (world - 1)):
                t = torch.empty(2)
                if i % 2:
                    w = dist.irecv(t)
                    w.wait()
                    src = w._source_rank()
                else:
                    src = dist.recv(t)
                check_equal(t, torch.full((2,), float(src)), "recv any source")
                sources.append(src)
        else:
            dist.send(torch.full((2,), float(rank)), dst=0)
            dist.send(torch.full((2,), float(rank)), dst=0)
        dist.barrier()
    return {"sources": sorted(sources)}


def job_any_source_after_a_rank_left(rank: int, world: int, port: int, file: str,
                                     **_: Any) -> Any:
    """Rank 2 leaves the group; rank 0's receive from any rank still gets rank 1's message."""
    with group(rank, world, port, file):
        dist.barrier()
        if rank == 2:
            return "left"  # destroys its group on the way out
        if rank == 0:
            t = torch.zeros(2)
            source = dist.recv(t)
            check_equal(t, torch.full((2,), 7.0), "any source after a rank left")
            dist.send(t, dst=1)  # lets rank 1 leave only now
            return source
        time.sleep(1.0)  # rank 2 is gone by now
        dist.send(torch.full((2,), 7.0), dst=0)
        dist.recv(torch.zeros(2), src=0)
        return "sent"


def job_groups(rank: int, world: int, port: int, file: str, how: str = "tcp", **_: Any) -> dict:
    """new_group and new_subgroups get communicators of their own; each is checked, and the
    default group still works between and after them."""
    with group(rank, world, port, file, how):
        evens = dist.new_group([r for r in range(world) if r % 2 == 0])
        pair = dist.new_group([0, 1])
        sub, subs = dist.new_subgroups(group_size=1 if world % 2 else 2)
        t = torch.ones(3)
        if rank % 2 == 0:
            dist.all_reduce(t, group=evens)
            check_equal(t, torch.full((3,), float(len(range(0, world, 2)))), "evens")
        t = torch.full((2,), float(rank))
        if rank < 2:
            dist.all_reduce(t, group=pair)
            check_equal(t, torch.ones(2), "pair")
        t = torch.full((2,), float(rank))
        dist.all_reduce(t, group=sub)
        members = dist.get_process_group_ranks(sub)
        check_equal(t, torch.full((2,), float(sum(members))), "subgroup")
        t = torch.ones(1)
        dist.all_reduce(t)
        check_equal(t, torch.full((1,), float(world)), "world after subgroups")
        names = {g.group_name for g in (dist.group.WORLD, pair if rank < 2 else sub, sub)}
        n_subs = len(subs)
    return {"threads_after": ringcomm_threads(), "names": len(names), "subgroups": n_subs}


def job_errors(rank: int, world: int, port: int, file: str, **_: Any) -> dict:
    """Typed errors through torch: a wait that runs out, a desync, a bad argument."""
    out: dict[str, Any] = {}
    with group(rank, world, port, file, timeout=20):
        # a receive nobody sends to: wait(timeout) gives up on time with CommTimeout
        if rank == 1:
            w = dist.irecv(torch.empty(2), src=0, tag=99)
            start = time.monotonic()
            try:
                w.wait(timeout=timedelta(seconds=0.3))
            except CommTimeout as err:
                out["wait_timeout"] = (type(err).__name__, time.monotonic() - start)
            assert not w.is_completed()
            dist.send(torch.ones(1), dst=0)  # tells rank 0 to send now
            w.wait()
            out["late_recv"] = True
        elif rank == 0:
            dist.recv(torch.empty(1), src=1)
            dist.send(torch.ones(2), dst=1, tag=99)
        # gloo's monitored barrier, reached through the group object
        dist.group.WORLD.monitored_barrier(timedelta(seconds=10))
        if rank == 0:
            try:
                dist.group.WORLD.monitored_barrier(timedelta(seconds=0))
            except CommTimeout as err:
                out["monitored"] = str(err)
        # a bad argument raises at the call, before anything is sent
        try:
            dist.all_gather([torch.empty(3)], torch.ones(3))  # one output for several ranks
        except (ArgumentError, ValueError, RuntimeError) as err:
            out["bad_arg"] = type(err).__name__
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.uint16))
        except ArgumentError as err:
            out["bad_dtype"] = str(err)
        dist.barrier()
        # ranks disagree on the size: DesyncError / RemoteError, from wait() and the future
        t = torch.ones(4 + (rank == 1))
        w = dist.all_reduce(t, async_op=True)
        try:
            w.wait()
        except CommError as err:
            out["desync"] = type(err).__name__
        fut = w.get_future()
        try:
            fut.wait()
        except Exception as err:  # noqa: BLE001 - torch re-raises it as its own type
            out["future"] = str(err)[:200]
        try:
            dist.all_reduce(torch.ones(2))
        except CommError as err:
            out["after"] = type(err).__name__
    out["threads"] = ringcomm_threads()
    return out


def job_reinit(rank: int, world: int, ports: list[int], file: str, **_: Any) -> dict:
    """Three default groups in a row in one process, by three init methods; each destroy
    leaves no thread, ipc directory or shared-memory file behind."""
    shm = "/dev/shm"
    before = set(os.listdir(shm)) if os.path.isdir(shm) else set()
    left = []
    for port, how in zip(ports, ("tcp", "file", "env"), strict=True):
        with group(rank, world, port, f"{file}.{how}", how):
            t = torch.ones(2)
            dist.all_reduce(t)
            check_equal(t, torch.full((2,), float(world)), how)
            ipc_dir = dist.group.WORLD.comm.transport.ipc_dir
        if ipc_dir is not None and os.path.exists(ipc_dir):
            left.append(ipc_dir)
        left += ringcomm_threads()
    after = set(os.listdir(shm)) if os.path.isdir(shm) else set()
    return {"left": left + sorted(n for n in after - before if n.startswith("ringcomm"))}


# --------------------------------------------------------------------------- DDP


class Net(nn.Module):
    """Two layers, and optionally a branch that forward uses only when asked (for
    find_unused_parameters)."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 3) if branch else None

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        out = self.b(h)
        return out + self.unused(h) if use_branch else out


def _data(steps: int, world: int, per_rank: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches on every rank and every device (drawn on the CPU, then moved to
    the default device: ``job_on_cuda`` makes that CUDA)."""
    g = torch.Generator().manual_seed(1234)
    device = torch.get_default_device()
    return [(torch.randn(world * per_rank, 6, generator=g, dtype=torch.float64,
                         device="cpu").to(device),
             torch.randn(world * per_rank, 3, generator=g, dtype=torch.float64,
                         device="cpu").to(device))
            for _ in range(steps)]


def _model(branch: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(branch).double()


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _close(a: list, b: list, what: str, rtol: float = 1e-12, atol: float = 1e-14) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            if (x is None) != (y is None) and not torch.equal(
                    (x if x is not None else torch.zeros_like(y)),
                    (y if y is not None else torch.zeros_like(x))):
                raise AssertionError(f"{what}: parameter {i}: {x} vs {y}")
            continue
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=f"{what}: parameter {i}")


def job_ddp(rank: int, world: int, port: int, file: str, **_: Any) -> list[str]:
    """torch's DistributedDataParallel on ringcomm: after every step, gradients and weights
    equal those of one process training on the whole batch (float64), in each mode."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    done = []
    loss_fn = nn.MSELoss()
    with group(rank, world, port, file):
        modes: dict[str, dict] = {
            "plain": {},
            "find_unused_parameters": {"find_unused_parameters": True},
            "static_graph": {"static_graph": True},
            "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
            "small buckets": {"bucket_cap_mb": 0.0001},
        }
        for mode, kwargs in modes.items():
            ref = _model()
            ddp = DDP(_model(), **kwargs)
            opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for x, y in _data(3, world):
                mine = slice(rank * 4, rank * 4 + 4)
                opt_ref.zero_grad()
                loss_fn(ref(x), y).backward()
                opt.zero_grad()
                loss_fn(ddp(x[mine]), y[mine]).backward()
                _close(_grads(ddp.module), _grads(ref), f"{mode} gradients")
                opt_ref.step()
                opt.step()
            _close(list(ddp.module.parameters()), list(ref.parameters()), f"{mode} weights")
            done.append(mode)

        # no_sync: two micro-batches accumulate locally, the second one syncs
        ref, ddp = _model(), DDP(_model())
        (x1, y1), (x2, y2) = _data(2, world)
        mine = slice(rank * 4, rank * 4 + 4)
        (loss_fn(ref(x1), y1) + loss_fn(ref(x2), y2)).backward()
        with ddp.no_sync():
            loss_fn(ddp(x1[mine]), y1[mine]).backward()
        loss_fn(ddp(x2[mine]), y2[mine]).backward()
        _close(_grads(ddp.module), _grads(ref), "no_sync")
        done.append("no_sync")

        # the fp16 compression hook: gradients within fp16 precision
        ref, ddp = _model(), DDP(_model())
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
        x, y = _data(1, world)[0]
        loss_fn(ref(x), y).backward()
        loss_fn(ddp(x[mine]), y[mine]).backward()
        _close(_grads(ddp.module), _grads(ref), "fp16_compress_hook", rtol=2e-3, atol=1e-4)
        done.append("fp16_compress_hook")

        # a branch used only in some steps, with find_unused_parameters
        ref, ddp = _model(True), DDP(_model(True), find_unused_parameters=True)
        for i, (x, y) in enumerate(_data(3, world)):
            for m in (ref, ddp):
                for p in m.parameters():
                    p.grad = None
            loss_fn(ref(x, use_branch=i == 1), y).backward()
            loss_fn(ddp(x[mine], use_branch=i == 1), y[mine]).backward()
            _close(_grads(ddp.module), _grads(ref), f"unused branch step {i}")
        done.append("unused branch")

        # Join: rank r has 2 + r batches; joined ranks contribute zeros, and gradients are
        # divided by the world size throughout (divide_by_initial_world_size)
        ref, ddp = _model(), DDP(_model())
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = _data(2 + world - 1, world)
        with Join([ddp]):
            for x, y in data[: 2 + rank]:
                opt.zero_grad()
                loss_fn(ddp(x[mine]), y[mine]).backward()
                opt.step()
        for i, (x, y) in enumerate(data):
            opt_ref.zero_grad()
            active = [r for r in range(world) if i < 2 + r]
            loss = sum(loss_fn(ref(x[r * 4: r * 4 + 4]), y[r * 4: r * 4 + 4]) for r in active)
            (loss / world).backward()
            opt_ref.step()
        _close(list(ddp.module.parameters()), list(ref.parameters()), "Join")
        done.append("Join")
    return done


def job_on_cuda(rank: int, inner: str, **kwargs: Any) -> Any:
    """The job named ``inner`` with CUDA as torch's default device, so that every tensor it
    makes (its inputs, outputs and expected values, DDP's model and batches) lives on the GPU; its
    checks compare tensors with ``torch.equal``, which refuses tensors of two devices, so a
    result that left the GPU fails them too. All ranks share GPU 0: ringcomm's device engines
    need no GPU of their own per rank."""
    return on_cuda(globals()[inner], rank=rank, **kwargs)


def on_cuda(job: Any, **kwargs: Any) -> Any:
    """``job(**kwargs)`` with CUDA as torch's default device, its device work done."""
    torch.set_default_device("cuda")
    try:
        assert torch.empty(1).is_cuda
        result = job(**kwargs)
        torch.cuda.synchronize()
        return result
    finally:
        torch.set_default_device(None)


def job_another_default_device(rank: int, world: int, port: int, file: str, **_: Any) -> dict:
    """A program may make another device torch's default (``torch.set_default_device``);
    the buffers the group makes for tensors it cannot use in place stay on the host all
    the same. "meta" here, a device whose tensors hold no data."""
    cpu = torch.device("cpu")
    got: dict[str, Any] = {}
    with group(rank, world, port, file):
        torch.set_default_device("meta")
        try:
            m = torch.arange(12.0, device=cpu).reshape(3, 4) * (rank + 1)
            dist.all_reduce(m[:, 1])  # a column: not contiguous, so staged
            got["all_reduce"] = m[:, 1].tolist()
            b = (torch.arange(6, device=cpu) + 10 * rank).reshape(2, 3).t()
            dist.broadcast(b, src=world - 1)
            got["broadcast"] = b.flatten().tolist()
            outs = [torch.empty(2, device=cpu) for _ in range(world)]
            dist.all_gather(outs, torch.full((2,), float(rank), device=cpu))
            got["all_gather"] = [o.tolist() for o in outs]
            out = torch.empty(2, device=cpu)
            dist.reduce_scatter_tensor(out, torch.arange(2.0 * world, device=cpu))
            got["reduce_scatter"] = out.tolist()
            # the group's own methods, called directly: no torch function mode is left
            # aside on the way (torch 2.11's dist.broadcast left it in place, 2.13's not)
            pg = dist.distributed_c10d._get_default_group()
            b = (torch.arange(6, device=cpu) + 10 * rank).reshape(2, 3).t()
            opts = dist.BroadcastOptions()
            opts.rootRank = world - 1
            pg.broadcast([b], opts).wait()
            got["group's broadcast"] = b.flatten().tolist()
            outs = [torch.empty(2, device=cpu) for _ in range(world)]  # into a buffer of its own
            pg.allgather([outs], [torch.full((2,), float(rank), device=cpu)],
                         dist.distributed_c10d.AllgatherOptions()).wait()
            got["group's all_gather"] = [o.tolist() for o in outs]
            outs = [torch.empty(1, device=cpu) for _ in range(world)]
            ins = [torch.full((1,), float(10 * rank + j), device=cpu) for j in range(world)]
            pg.alltoall(outs, ins, dist.distributed_c10d.AllToAllOptions()).wait()
            got["group's all_to_all"] = [o.item() for o in outs]
            sparse = torch.sparse_coo_tensor([[rank]], [rank + 1.0], (world,), device=cpu)
            pg.allreduce([sparse], dist.AllreduceOptions()).wait()
            got["group's sparse all_reduce"] = sparse.to_dense().tolist()
        finally:
            torch.set_default_device(None)
    return got


def job_staged_async(rank: int, world: int, port: int, file: str, **_: Any) -> dict:
    """Async calls on tensors the group cannot use in place (a column, a transposed view, a
    dtype moved as bytes, lists of outputs), every op handed to the worker
    (RINGCOMM_INLINE_BYTES=0): the results reach the caller's tensors when the work
    completes, before ``wait`` returns and before its future's callbacks run."""
    os.environ["RINGCOMM_INLINE_BYTES"] = "0"
    ranks, last = range(world), world - 1
    try:
        with group(rank, world, port, file):
            m = torch.arange(24.0).reshape(4, 6) * (rank + 1)
            b = (torch.arange(6) + 10 * rank).reshape(2, 3).t()
            u16 = [torch.zeros(3, dtype=torch.uint16) for _ in ranks]
            gathered = [torch.zeros(2, 4).t() for _ in ranks] if rank == 0 else None
            scattered = torch.zeros(2, 3).t()
            pieces = [torch.arange(6.0).reshape(3, 2) + 10 * j for j in ranks]
            works = [
                dist.all_reduce(m[:, 1], async_op=True),
                dist.broadcast(b, src=last, async_op=True),
                dist.gather(vals(rank, 8).reshape(4, 2), gathered, dst=0, async_op=True),
                dist.scatter(scattered, pieces if rank == last else None, src=last,
                             async_op=True),
            ]
            work = dist.all_gather(u16, torch.full((3,), 60000 + rank, dtype=torch.uint16),
                                   async_op=True)
            seen = work.get_future().then(lambda _: [t.int().tolist() for t in u16])
            for w in [*works, work]:
                w.wait()
            return {"all_reduce": m.tolist(), "broadcast": b.tolist(),
                    "gather": None if gathered is None else [g.tolist() for g in gathered],
                    "scatter": scattered.tolist(), "all_gather": seen.wait(),
                    "completed": all(w.is_completed() for w in [*works, work])}
    finally:
        del os.environ["RINGCOMM_INLINE_BYTES"]


def job_size_mismatch(rank: int, world: int, port: int, file: str, **_: Any) -> dict:
    """Rank 1 all-reduces 2^20 + 8 floats where the others all-reduce 2^20 (a few MiB, several
    segments): the all_reduce itself raises on every rank; nobody returns half a sum."""
    n = (1 << 20) + (8 if rank == 1 else 0)
    with group(rank, world, port, file, timeout=20):
        t = torch.full((n,), float(rank + 1))
        start = time.monotonic()
        try:
            dist.all_reduce(t)
        except CommError as err:
            return {"type": type(err).__name__, "msg": str(err), "peer": err.peer,
                    "elapsed": time.monotonic() - start}
        return {"type": None, "right": bool((t == world * (world + 1) / 2).all())}


ONE_BITS = 0x3F800000  # 1.0 as a float32's bits


def job_short_way(rank: int, world: int, port: int, file: str, **_: Any) -> dict:
    """``dist.all_reduce(t)`` on tensors that share an address with one reduced before (the
    short way keeps a view per address, size and dtype): other parts of one storage, the
    same memory as another dtype, a negated view (whose MAX is not the memory's), a column
    whose address and size are those of a row reduced before, a tensor made where a freed
    one was; and the views keep no tensor alive."""
    import gc
    import weakref

    got: dict[str, Any] = {}
    with group(rank, world, port, file):
        total = sum(r + 1 for r in range(world))
        base = torch.arange(12.0) * (rank + 1)
        dist.all_reduce(base[0:4])
        dist.all_reduce(base[4:8])
        got["parts"] = base.tolist()
        f = torch.zeros(4)
        dist.all_reduce(f)
        ints = f.view(torch.int32)
        ints.fill_(ONE_BITS + rank)  # as floats: 1.0 and its neighbours, whose sum differs
        dist.all_reduce(ints)
        got["other dtype"] = ints.tolist()
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)  # now known by its address
        t.fill_(rank + 1)
        negated = torch._neg_view(t)
        dist.all_reduce(negated, op=dist.ReduceOp.MAX)
        got["negated"] = (negated.tolist(), t.tolist())
        m = torch.arange(16.0).reshape(4, 4) * (rank + 1)
        dist.all_reduce(m.view(-1)[1:5])  # elements 1-4, by the address of element 1
        column = m[:, 1]  # elements 1, 5, 9 and 13: that address and size, strided
        dist.all_reduce(column)
        got["column"] = m.tolist()
        for value in (1.0, 2.0):
            fresh = torch.full((16,), value * (rank + 1))
            dist.all_reduce(fresh)
            got[f"fresh {value}"] = fresh.tolist()
            del fresh
        memory = np.ones(8, np.float32)  # the tensor's storage holds it while it lives
        alive = weakref.ref(memory)
        gone = torch.from_numpy(memory)
        del memory
        dist.all_reduce(gone)
        del gone
        gc.collect()
        got["kept alive"] = alive() is not None
        got["total"] = total
    return got


def job_blocking_call_leaves_nothing_running(rank: int, world: int, port: int, file: str,
                                             **_: Any) -> dict:
    """A blocking coalesced all-gather whose second pair is bad raises; the first pair's op,
    which used the caller's memory, must have finished by then (async ops go to the worker
    here: RINGCOMM_INLINE_BYTES=0), or freeing the output would leave it writing freed
    memory."""
    os.environ["RINGCOMM_INLINE_BYTES"] = "0"
    try:
        with group(rank, world, port, file):
            pg = dist.distributed_c10d._get_default_group()
            n = 1 << 18
            inp = torch.full((n,), float(rank + 1))
            out = torch.zeros(n * world)
            opts = dist.distributed_c10d.AllgatherOptions()
            opts.asyncOp = False
            if rank == 1:
                time.sleep(0.5)  # rank 0's first op waits for this rank meanwhile
            try:
                pg.allgather_into_tensor_coalesced([out], [inp, inp], opts)
                raised = None
            except ValueError as err:  # the lists differ in length
                raised = type(err).__name__
            idle = pg.comm.idle
            gathered = sorted(set(out.tolist()))
            dist.barrier()
            return {"raised": raised, "idle": idle, "gathered": gathered}
    finally:
        del os.environ["RINGCOMM_INLINE_BYTES"]
