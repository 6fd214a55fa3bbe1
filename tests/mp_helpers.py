"""Real processes for the multi-process tests: a small pool of spawned ranks, and the jobs they run.

Starting a process that imports torch costs a second or two here, so the processes are
started once (``Cluster``) and each test sends them a *job*: a function of this module that
calls ``ringcomm.init`` on a fresh store port, does its checks, closes, and returns what the
test asserts on (or raises; the exception travels back to the test). A process that dies or
hangs is killed and replaced before the next job.

Jobs get ``rank``, ``world``, ``store`` ("127.0.0.1:PORT", hosted by rank 0), ``stores`` (a few
more fresh ports, for jobs that init more than once) and ``transport``, plus their own
keyword arguments.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch

import ringcomm
from ringcomm import ArgumentError, CommError
from ringcomm.transport import shm_ring
from ringcomm.transport.files import ipc_base

MiB = 1 << 20
BIG = 5 * MiB // 4  # elements: a 5 MiB float32 message, several 1 MiB segments
IPC_BASE = os.path.join(tempfile.gettempdir(), f"ringcomm-{os.getuid()}")
DTYPES = ["float32", "float64", "int64", "bfloat16", "float16"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def files_of(pids) -> list[str]:
    """ringcomm's files named for any of ``pids``: ipc folders and shared-memory rings."""
    found = []
    for folder, prefix in ((ipc_base(), "{}-"), (shm_ring.SHM_DIR, "ringcomm-{}-")):
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            continue
        found += [os.path.join(folder, n) for n in names
                  if any(n.startswith(prefix.format(pid)) for pid in pids)]
    return sorted(found)


def transport_pair(mode: str = "ipc", shm: bool = True,
                   hosts: tuple[str, str] = ("h", "h")) -> list:
    """Two connected GroupTransports (ranks 0 and 1 of this process), made in threads."""
    return transport_group(2, mode, shm, hosts)


def transport_group(world: int, mode: str = "ipc", shm: bool | Sequence[bool] = True,
                    hosts: Sequence[str] | None = None) -> list:
    """``world`` connected GroupTransports (ranks of this process), made in threads through
    a real store. ``shm`` may differ per rank (one bool per rank); ``hosts``: each rank's
    host identity (default: one host)."""
    from ringcomm.bootstrap.store import StoreClient, StoreServer
    from ringcomm.transport.group import GroupTransport

    shms = [shm] * world if isinstance(shm, bool) else list(shm)
    hosts = list(hosts) if hosts is not None else ["h"] * world
    port = free_port()
    server = StoreServer("127.0.0.1", port)
    made: list[Any] = [None] * world
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        client = StoreClient(f"127.0.0.1:{port}", timeout=10)
        try:
            made[rank] = GroupTransport(rank, world, client, hosts=hosts, mode=mode,
                                        shm=shms[rank], timeout=10)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
        finally:
            client.close()

    in_threads(world, make, timeout=20)
    server.close()
    if errors:
        for transport in made:
            if transport is not None:
                transport.close()
    assert not errors, errors
    return made


def in_threads(world: int, fn: Callable[[int], Any], timeout: float = 30.0) -> list[Any]:
    """``fn(rank)`` for every rank at once, each on a thread of its own; their results in
    rank order. The first rank's error is raised once every thread has stopped; a thread
    still running after ``timeout`` seconds fails the test."""
    results: list[Any] = [None] * world

    def main(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as err:  # noqa: BLE001 - raised below
            results[rank] = err

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"a rank did not finish within {timeout} s (hang)")
    for res in results:
        if isinstance(res, BaseException):
            raise res
    return results


# --------------------------------------------------------------------------- the pool


class JobFailed(AssertionError):
    """A rank's job raised something the test did not expect back as a value."""


def _restore_environment(environment: dict[str, str]) -> None:
    """``os.environ`` back to ``environment``, changing only the variables that differ."""
    for key in set(os.environ) - set(environment):
        del os.environ[key]
    for key, value in environment.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _serve(slot: int, inbox: Any, outbox: Any) -> None:
    """Worker process main loop: run jobs until told to stop (``None``).

    Every job starts from the environment the process started with: the pool serves every
    module of a test session (``conftest.cluster``), so a variable one job sets (a forced
    engine, a ring size) must not reach the next. Told to stop, the process runs its exit
    hooks (files a job left behind are removed, the queues are flushed) and ends without
    tearing the interpreter down, which takes about a second with torch loaded."""
    environment = dict(os.environ)
    while True:
        msg = inbox.get()
        if msg is None:
            break
        job_id, name, kwargs = msg
        try:
            module, _, function = name.rpartition(".")  # "module.job": a job of another module
            job = getattr(importlib.import_module(module), function) if module else \
                globals()[name]
            result = ("ok", job(**kwargs), "")
        except BaseException as err:  # noqa: BLE001 - sent back to the test
            result = ("err", err, traceback.format_exc())
        finally:
            _restore_environment(environment)
        try:
            pickle.dumps(result)
        except Exception:  # noqa: BLE001 - an unpicklable result becomes its description
            result = ("err", JobFailed(repr(result[1])), result[2])
        outbox.put((job_id, slot, *result))
    atexit._run_exitfuncs()  # multiprocessing's among them: the outbox is flushed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Cluster:
    """Up to ``size`` spawned processes that run jobs as ranks of one group.

    ``dirty``: a job had a rank die since the processes were last closed, so the others
    may still hold what their aborted groups could not free (``conftest.cluster`` gives
    the next module fresh processes then)."""

    def __init__(self, size: int) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.size = size
        self.outbox = self.ctx.Queue()
        self.procs: list[Any] = [None] * size
        self.inboxes: list[Any] = [None] * size
        self._ids = itertools.count()
        self.dirty = False

    def _ensure(self, slots: range) -> None:
        for i in slots:
            p = self.procs[i]
            if p is None or not p.is_alive():
                if p is not None:
                    p.join(1)
                self.inboxes[i] = self.ctx.Queue()
                p = self.ctx.Process(target=_serve, args=(i, self.inboxes[i], self.outbox),
                                     name=f"rank-slot-{i}", daemon=True)
                p.start()
                self.procs[i] = p

    def start(self) -> None:
        self._ensure(range(self.size))

    def kill(self, slot: int) -> None:
        p = self.procs[slot]
        if p is not None and p.is_alive():
            p.kill()
        if p is not None:
            p.join(5)
        self.procs[slot] = None

    def close(self) -> None:
        for i, p in enumerate(self.procs):
            if p is not None and p.is_alive():
                with contextlib.suppress(Exception):
                    self.inboxes[i].put(None)
        deadline = time.monotonic() + 5
        for i, p in enumerate(self.procs):
            if p is not None:
                p.join(max(0.1, deadline - time.monotonic()))
                self.kill(i)
        self.dirty = False  # a later job starts the processes afresh

    def run(
        self,
        world: int,
        job: str,
        *,
        transport: str = "ipc",
        timeout: float = 45.0,
        dies: tuple[int, ...] = (),
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``job`` on ranks ``0..world-1``; return their results in rank order.

        Ranks in ``dies`` are expected to end their process; their slot is ``None``. A rank
        that raises fails the test with its traceback. Anything still running after
        ``timeout`` s is killed: a hang fails the test instead of blocking the suite.
        """
        assert world <= self.size
        self._ensure(range(world))
        self.dirty = self.dirty or bool(dies)
        job_id = next(self._ids)
        ports = [free_port() for _ in range(4)]
        common = dict(world=world, store=f"127.0.0.1:{ports[0]}",
                      stores=[f"127.0.0.1:{p}" for p in ports[1:]], transport=transport)
        for r in range(world):
            args = dict(common, rank=r, **kwargs)
            self.inboxes[r].put((job_id, job, args))
        results: dict[int, tuple] = {}
        want = set(range(world)) - set(dies)
        deadline = time.monotonic() + timeout
        ok = False
        try:
            while not want <= results.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise JobFailed(f"{job}: ranks {sorted(want - results.keys())} did not "
                                    f"finish within {timeout} s (hang)")
                try:
                    jid, slot, status, value, tb = self.outbox.get(timeout=min(left, 0.5))
                except queue.Empty:
                    for r in want - results.keys():
                        if not self.procs[r].is_alive():
                            raise JobFailed(f"{job}: rank {r}'s process died "
                                            f"(exit code {self.procs[r].exitcode})") from None
                    continue
                if jid == job_id:
                    results[slot] = (status, value, tb)
            for r in dies:
                self.procs[r].join(max(0.5, deadline - time.monotonic()))
                if self.procs[r].is_alive():
                    raise JobFailed(f"{job}: rank {r} should have died but is still running")
            # the dead are replaced by the next job: after a death the module's end closes
            # the processes (``dirty``), and one started now might only be stopped
            ok = True
        finally:
            if not ok:  # leave no rank half-way through a job for the next test
                for r in range(world):
                    self.kill(r)
        failed = [r for r in range(world) if r not in dies and results[r][0] == "err"]
        if failed:  # every failed rank's traceback: the first is often another's symptom
            first = results[failed[0]][1]
            raise JobFailed("\n".join(f"{job} failed on rank {r}:\n{results[r][2]}"
                                      for r in failed)) from first
        return [None if r in dies else results[r][1] for r in range(world)]


# --------------------------------------------------------------------------- helpers for jobs


def init(rank: int, world: int, store: str, transport: str, timeout: float = 30.0,
         **kw: Any) -> ringcomm.Communicator:
    return ringcomm.init(rank=rank, world_size=world, store=store, timeout=timeout,
                         transport=transport, **kw)


def values(rank: int, count: int, salt: int = 0) -> np.ndarray:
    """Small integers (exact in every dtype, also when summed over a few ranks), as float64."""
    return ((np.arange(count, dtype=np.int64) * 7 + rank * 13 + salt * 5) % 23 - 11).astype(
        np.float64)


_NP = {"float32": np.float32, "float64": np.float64, "int64": np.int64,
       "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
_TORCH = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64,
          "float16": torch.float16, "bfloat16": torch.bfloat16}


class Lib:
    """Makes buffers of one kind (numpy arrays or torch CPU tensors) and reads them back."""

    def __init__(self, name: str) -> None:
        self.name = name

    def make(self, a: np.ndarray, dtype: str) -> Any:
        if self.name == "numpy":
            return np.ascontiguousarray(a.astype(_NP[dtype]))
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(_TORCH[dtype])

    def empty(self, count: int, dtype: str) -> Any:
        return self.make(np.full(count, -99.0), dtype)

    def read(self, x: Any) -> np.ndarray:
        if self.name == "numpy":
            return np.asarray(x, dtype=np.float64)
        return x.to(torch.float64).numpy()


def expect_equal(what: str, got: np.ndarray, want: np.ndarray, dtype: str,
                 exact: bool = True) -> None:
    want = want.astype(_NP[dtype]).astype(np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}")
    if exact:
        bad = np.flatnonzero(got != want)
    else:
        tol = {"bfloat16": 1e-2, "float16": 1e-3}.get(dtype, 1e-6)
        bad = np.flatnonzero(~np.isclose(got, want, rtol=tol, atol=tol))
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} wrong elements, first at {i}: "
                             f"got {got[i]}, expected {want[i]}")


def error_info(err: BaseException, elapsed: float) -> dict:
    return {"type": type(err).__name__, "msg": str(err), "elapsed": elapsed,
            "rank": getattr(err, "rank", None), "op": getattr(err, "op", None),
            "peer": getattr(err, "peer", None), "error": err}


def timed_error(fn: Any) -> dict | None:
    start = time.monotonic()
    try:
        fn()
    except CommError as err:
        return error_info(err, time.monotonic() - start)
    return None


# --------------------------------------------------------------------------- jobs: correctness


def job_collectives(rank: int, world: int, store: str, transport: str, lib: str,
                    **_: Any) -> int:
    """Every collective with checked values: counts 0, 1, < world, indivisible, and 5 MiB."""
    L = Lib(lib)
    checks = 0
    counts = [0, 1, world - 1, 3 * world + 1, BIG]
    with init(rank, world, store, transport) as comm:
        for count in counts:
            big = count == BIG
            dtypes = ["float32"] if big else DTYPES
            for dtype in dtypes:
                ops = ["sum", "max"] + ([] if dtype == "int64" else ["avg"])
                for op in ops:
                    x = L.make(values(rank, count), dtype)
                    assert comm.allreduce(x, op) is x
                    parts = [values(r, count).astype(_NP[dtype]).astype(np.float64)
                             for r in range(world)]
                    if op == "max":
                        want = np.max(parts, axis=0) if count else np.zeros(0)
                    else:
                        want = np.sum(parts, axis=0) if count else np.zeros(0)
                    if op == "avg":
                        want = want.astype(_NP[dtype]).astype(np.float64) / world
                    expect_equal(f"allreduce {op} {dtype} x{count}", L.read(x), want, dtype,
                                 exact=op != "avg")
                    checks += 1
            for dtype in dtypes:
                # reduce_scatter: x has world blocks of `count`, rank r keeps block r reduced
                x = L.make(values(rank, count * world, 1), dtype)
                out = L.empty(count, dtype)
                comm.reduce_scatter(out, x, "sum")
                want = sum(values(r, count * world, 1) for r in range(world))
                expect_equal(f"reduce_scatter {dtype} x{count}", L.read(out),
                             want[rank * count:(rank + 1) * count], dtype)
                # allgather
                x = L.make(values(rank, count, 2), dtype)
                out = L.empty(count * world, dtype)
                comm.allgather(out, x)
                want = np.concatenate([values(r, count, 2) for r in range(world)])
                expect_equal(f"allgather {dtype} x{count}", L.read(out), want, dtype)
                checks += 2
            dtype = "float32" if big else "bfloat16" if lib == "torch" else "float64"
            for root in sorted({0, world - 1}):
                x = L.make(values(rank, count, 3), dtype)
                comm.broadcast(x, root=root)
                expect_equal(f"broadcast root {root} x{count}", L.read(x), values(root, count, 3),
                             dtype)
                x = L.make(values(rank, count, 4), dtype)
                comm.reduce(x, root=root, op="sum")
                want = (sum(values(r, count, 4) for r in range(world)) if rank == root
                        else values(rank, count, 4))
                expect_equal(f"reduce root {root} x{count}", L.read(x), want, dtype)
                x = L.make(values(rank, count, 5), dtype)
                out = L.empty(count * world, dtype) if rank == root else None
                comm.gather(out, x, root=root)
                if rank == root:
                    want = np.concatenate([values(r, count, 5) for r in range(world)])
                    expect_equal(f"gather root {root} x{count}", L.read(out), want, dtype)
                x = L.empty(count, dtype)
                src = L.make(values(root, count * world, 6), dtype) if rank == root else None
                comm.scatter(x, src, root=root)
                want = values(root, count * world, 6)[rank * count:(rank + 1) * count]
                expect_equal(f"scatter root {root} x{count}", L.read(x), want, dtype)
                checks += 4
            # scatter from a list of tensors
            x = L.empty(count, dtype)
            src = ([L.make(values(10 + r, count), dtype) for r in range(world)] if rank == 0
                   else None)
            comm.scatter(x, src, root=0)
            expect_equal(f"scatter list x{count}", L.read(x), values(10 + rank, count), dtype)
            # alltoall, equal blocks: block j of rank r's input holds values(r * world + j)
            x = L.make(np.concatenate([values(rank * world + j, count) for j in range(world)]
                                      or [np.zeros(0)]), dtype)
            out = L.empty(count * world, dtype)
            comm.alltoall(out, x)
            want = np.concatenate([values(r * world + rank, count) for r in range(world)])
            expect_equal(f"alltoall x{count}", L.read(out), want, dtype)
            # alltoall, uneven: rank r sends split(r, j) elements to rank j
            def split(r: int, j: int, count: int = count, big: bool = big) -> int:
                return (count + r * 2 + j) % 4 if not big else count // world + j - r

            x = L.make(np.concatenate([values(rank * 31 + j, split(rank, j))
                                       for j in range(world)]), dtype)
            out = L.empty(sum(split(r, rank) for r in range(world)), dtype)
            comm.alltoall(out, x, in_splits=[split(rank, j) for j in range(world)],
                          out_splits=[split(r, rank) for r in range(world)])
            want = np.concatenate([values(r * 31 + rank, split(r, rank)) for r in range(world)])
            expect_equal(f"alltoall uneven x{count}", L.read(out), want, dtype)
            comm.barrier()
            checks += 4
    return checks


def job_async_and_p2p(rank: int, world: int, store: str, transport: str, **_: Any) -> list:
    """Several async ops in flight at once; send/recv with tags, ordering and sizes."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    with init(rank, world, store, transport) as comm:
        done: list[str] = []
        a = np.full(BIG, float(rank + 1), np.float32)
        b = torch.arange(1000, dtype=torch.float64) * (rank + 1)
        c = np.full(7, rank, np.int64)
        gathered = np.zeros(7 * world, np.int64)
        bc = np.full(3 * MiB, rank, np.uint8)
        works = [
            comm.allreduce(a, "sum", async_op=True),
            comm.allreduce(b, "max", async_op=True),
            comm.allgather(gathered, c, async_op=True),
            comm.broadcast(bc, root=world - 1, async_op=True),
            comm.barrier(async_op=True),
            comm.allreduce(a, "avg", async_op=True),  # runs after the first one on `a`
        ]
        for w in works:
            w.add_done_callback(lambda w: done.append(w.name))
        busy = float(np.sum(np.sqrt(np.arange(200_000.0))))  # the caller computes meanwhile
        for w in reversed(works):
            w.wait(timeout=60)
        assert busy > 0
        assert all(w.is_completed() and w.exception() is None for w in works)
        names = [w.name for w in works]
        assert done == names, (done, names)
        assert [n.split(" #")[0] for n in names] == [
            "allreduce", "allreduce", "allgather", "broadcast", "barrier", "allreduce"]
        seqs = [int(n.split("#")[1]) for n in names]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
        total = world * (world + 1) / 2
        np.testing.assert_array_equal(a, total)  # sum, then avg of equal values
        assert torch.equal(b, torch.arange(1000, dtype=torch.float64) * world)
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(world), 7))
        np.testing.assert_array_equal(bc, world - 1)

        # p2p around the ring: several tagged messages of several sizes, sends issued async
        sizes = [0, 3, MiB + 1]
        sends = []
        for i, n in enumerate(sizes):
            msg = np.arange(n, dtype=np.float32) + 1000 * rank + i
            sends.append((comm.send(msg, nxt, tag=10 + i, async_op=True), msg))
        bf = torch.full((5,), float(rank), dtype=torch.bfloat16)
        sends.append((comm.send(bf, nxt, tag=99, async_op=True), bf))
        for i, n in enumerate(sizes):
            got = np.full(n, -1, np.float32)
            comm.recv(got, prv, tag=10 + i)
            np.testing.assert_array_equal(got, np.arange(n, dtype=np.float32) + 1000 * prv + i)
        got_bf = torch.zeros(5, dtype=torch.bfloat16)
        w = comm.recv(got_bf, prv, tag=99, async_op=True)
        assert w.wait(timeout=30) is got_bf
        assert torch.equal(got_bf, torch.full((5,), float(prv), dtype=torch.bfloat16))
        for w, _ in sends:
            w.wait(timeout=30)
        # a send issued before a collective does not disturb the collective on the receiver
        if rank == 0:
            comm.send(np.array([42.0]), dst=1, tag=5)
        y = np.ones(10)
        comm.allreduce(y)
        np.testing.assert_array_equal(y, world)
        if rank == 1:
            z = np.zeros(1)
            comm.recv(z, src=0, tag=5)
            assert z[0] == 42.0
        # everyone sends to rank 0, which receives in a chosen order
        if rank == 0:
            for src in reversed(range(1, world)):
                z = np.zeros(4, np.int64)
                comm.recv(z, src=src, tag=src)
                np.testing.assert_array_equal(z, src)
        else:
            comm.send(np.full(4, rank, np.int64), dst=0, tag=rank)
        comm.barrier()
    return done


# --------------------------------------------------------------------------- jobs: errors


def job_mismatch(rank: int, world: int, store: str, transport: str, case: str,
                 algorithm: str | None = None, **_: Any) -> dict:
    """Ranks that disagree about an op: every rank raises a typed error, then stays failed.
    ``algorithm`` forces the allreduce algorithm (default: the automatic choice)."""
    comm = init(rank, world, store, transport, timeout=30.0)
    if algorithm is not None:
        comm_allreduce = comm.allreduce
        comm.allreduce = lambda x, *a, **k: comm_allreduce(x, *a, algorithm=algorithm, **k)
    try:
        if case == "dtype":
            dtype = np.float32 if rank == 1 else np.float64
            err = timed_error(lambda: comm.allreduce(np.ones(1000, dtype)))
        elif case == "count":
            err = timed_error(lambda: comm.allreduce(np.ones(100 + (rank == 1), np.float32)))
        elif case == "board-vs-links":  # rank 1 forces a link algorithm, the others not
            err = timed_error(lambda: comm.allreduce(
                np.ones(4, np.float32), algorithm="ring" if rank == 1 else None))
        elif case == "one-shot-vs-two-shot":  # rank 1's op is too big for one post
            n = BIG if rank == 1 else 4
            err = timed_error(lambda: comm.allreduce(np.ones(n, np.float32)))
        elif case == "big-count":  # differs deep into a 5 MiB pipelined op
            n = BIG + (world if rank == world - 1 else 0)
            err = timed_error(lambda: comm.allreduce(np.ones(n, np.float32)))
        elif case == "broadcast-count":
            err = timed_error(lambda: comm.broadcast(np.ones(10 + (rank == 1)), root=0))
        elif case == "op":  # rank 1 runs a different collective
            x = np.ones(12)
            err = timed_error(lambda: comm.broadcast(x, root=0) if rank == 1
                              else comm.allreduce(x))
        elif case == "root":
            err = timed_error(lambda: comm.broadcast(np.ones(12), root=int(rank == 1)))
        elif case == "torch-dtype":
            dtype = torch.bfloat16 if rank == 1 else torch.float16
            err = timed_error(lambda: comm.allreduce(torch.ones(64, dtype=dtype)))
        elif case == "tag":
            def p2p() -> None:
                if rank == 0:
                    comm.send(np.ones(4), dst=1, tag=1)
                    comm.barrier()  # learns about rank 1's failure here
                elif rank == 1:
                    comm.recv(np.ones(4), src=0, tag=2)
                else:
                    comm.barrier()
            err = timed_error(p2p)
        else:
            raise ValueError(case)
        after = timed_error(lambda: comm.allreduce(np.ones(4)))
        return {"err": err, "after": after}
    finally:
        comm.close()


def job_bad_arguments(rank: int, world: int, store: str, transport: str, **_: Any) -> int:
    """Mistakes raise ArgumentError at the call, on the caller's thread, before anything is
    sent: only rank 0 makes them, and the group is still in step afterwards."""
    caught = 0
    with init(rank, world, store, transport) as comm:
        if rank == 0:
            x = np.ones(8)
            bad = [
                lambda: comm.allreduce(x, "average", async_op=True),
                lambda: comm.allreduce(np.ones(8, np.int64), "avg", async_op=True),
                lambda: comm.reduce(x, root=0, op="median", async_op=True),
                lambda: comm.broadcast(x, root=world, async_op=True),
                lambda: comm.broadcast(x, root=-1, async_op=True),
                lambda: comm.broadcast(x, root="0", async_op=True),
                lambda: comm.reduce(x, root=world + 5, async_op=True),
                lambda: comm.gather(np.ones(8 * world), x, root=world, async_op=True),
                lambda: comm.scatter(x, None, root=0, async_op=True),
                lambda: comm.send(x, dst=world, async_op=True),
                lambda: comm.send(x, dst=0, async_op=True),
                lambda: comm.recv(x, src=-2, async_op=True),
                lambda: comm.allgather(np.ones(3), x, async_op=True),
                lambda: comm.reduce_scatter(np.ones(3), x, async_op=True),
                lambda: comm.alltoall(np.ones(8), x, in_splits=[9] * world, async_op=True),
                lambda: comm.allreduce(torch.ones(4, dtype=torch.int32)[::2], async_op=True),
                lambda: comm.allreduce([1.0], async_op=True),
            ]
            for i, call in enumerate(bad):
                try:
                    call()
                except ArgumentError as err:
                    assert err.rank in (0, None), err
                    caught += 1
                else:
                    raise AssertionError(f"bad call {i} did not raise ArgumentError")
        # nothing was sent and no op number was used: the group is still in step
        y = np.full(16, float(rank))
        comm.allreduce(y, "sum")
        np.testing.assert_array_equal(y, world * (world - 1) / 2)
        if rank == 0:
            comm.send(np.ones(2), dst=1, tag=3)
        elif rank == 1:
            z = np.zeros(2)
            comm.recv(z, src=0, tag=3)
            np.testing.assert_array_equal(z, 1)
        comm.barrier()
    return caught


def _die(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def job_peer_dies(rank: int, world: int, store: str, transport: str, victim: int, when: str,
                  how: str = "exit", report: str = "", op_timeout: float = 20.0,
                  op: str = "allreduce", idle: tuple = (), **_: Any) -> dict:
    """Rank ``victim`` dies (``os._exit`` or SIGKILL) before the op, in the middle of a run of
    ops, or while the others wait for it to join; the others must raise a typed error fast
    and stay failed (CommAborted) afterwards. Ranks in ``idle`` do nothing after the op for
    a while, so that no abort from them helps the others notice."""
    comm = init(rank, world, store, transport, timeout=op_timeout)

    def run_op() -> None:
        if op == "broadcast":  # a 5 MiB pipelined chain: ranks send to the victim
            comm.broadcast(np.ones(BIG, np.float32), root=0)
        elif op == "small":  # on the shared board: no link carries anything of the op
            comm.allreduce(np.ones(8, np.float32))
        else:
            comm.allreduce(np.ones(BIG, np.float32))

    if rank == victim:
        with open(report, "w") as f:  # where its ipc sockets were, for the test to clean up
            f.write(comm.transport.ipc_dir or "")
        if when == "during":  # queues many ops and dies part-way through them
            x = np.ones(BIG, np.float32)
            comm.inline_bytes = 0  # queued on the worker, even where cores are few
            for _ in range(100):
                comm.allreduce(x, async_op=True)
            time.sleep(0.1)
        elif when == "sleeping":  # never joins the op: dies while the others wait for it
            time.sleep(0.5)
        else:  # "before": let init's last barrier message leave (os._exit drops queued sends)
            time.sleep(0.2)
        _die(how)
    if when == "before":
        time.sleep(0.5)  # the victim is gone before the op starts
    try:
        done = 0
        err = None
        while err is None and done < 100:
            err = timed_error(run_op)
            done += err is None
            if when != "during":
                break
        if rank in idle:
            time.sleep(3.0)
        after = timed_error(comm.barrier)
        start = time.monotonic()
        comm.close()
        return {"err": err, "after": after, "close_s": time.monotonic() - start, "done": done,
                "board": comm.transport.board is not None}
    finally:
        comm.close()


# --------------------------------------------------------------------------- jobs: lifecycle


def _ringcomm_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("ringcomm"))


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def job_lifecycle(rank: int, world: int, store: str, stores: list, transport: str,
                  **_: Any) -> dict:
    """close() releases sockets, files and threads; init again in the same process works."""
    base_threads, base_os = _ringcomm_threads(), _os_threads()
    seen = []
    for i, address in enumerate([store, *stores[:2]]):
        comm = init(rank, world, address, transport)
        ipc_dir = comm.transport.ipc_dir
        if transport == "ipc":
            assert ipc_dir and os.path.dirname(ipc_dir) == IPC_BASE, ipc_dir
            # its pipes, sockets and doorbell are open at both ends: their names are gone
            assert not os.path.exists(ipc_dir), os.listdir(ipc_dir)
        else:
            assert ipc_dir is None
        assert _ringcomm_threads() != base_threads
        x = np.full(1000, float(i + rank))
        with comm:  # the context manager closes it
            comm.allreduce(x)
        np.testing.assert_array_equal(x, world * i + world * (world - 1) / 2)
        comm.close()  # closing twice is harmless
        if ipc_dir:
            assert not os.path.exists(ipc_dir), os.listdir(ipc_dir)
        for _ in range(50):  # zmq's own threads end in term(); allow the OS a moment
            if _os_threads() <= base_os:
                break
            time.sleep(0.02)
        assert _ringcomm_threads() == base_threads, _ringcomm_threads()
        assert _os_threads() <= base_os, (_os_threads(), base_os)
        closed = timed_error(lambda comm=comm: comm.allreduce(np.ones(3)))
        assert closed and closed["type"] == "CommAborted", closed
        seen.append(ipc_dir)
    return {"dirs": seen}


def job_world_one(rank: int, world: int, store: str, transport: str, **_: Any) -> bool:
    with init(rank, world, store, transport) as comm:
        x = np.arange(5.0)
        comm.allreduce(x, "avg")
        np.testing.assert_array_equal(x, np.arange(5.0))
        out = np.zeros(5)
        comm.allgather(out, x)
        comm.barrier()
    return True



def job_uneven_history(rank: int, world: int, store: str, stores: list, transport: str,
                       **_: Any) -> float:
    """Rank 0 made two communicators of its own before (world size 1, on other stores); the
    group must still meet on ``store``: ranks agree on its keys by counting per store."""
    if rank == 0:
        for address in stores[:2]:
            with ringcomm.init(rank=0, world_size=1, store=address, timeout=5) as alone:
                alone.barrier()
    with init(rank, world, store, transport, timeout=10) as comm:
        x = np.ones(3)
        comm.allreduce(x)
        return float(x[0])


def job_reinit_one_address(rank: int, world: int, store: str, transport: str, cycles: int,
                           jitter: float = 0.0, seed: int = 0, **_: Any) -> list[float]:
    """init -> allreduce (checked) -> close, ``cycles`` times, always on the same address:
    rank 0 serves the store afresh each cycle, while a fast rank's next init may already be
    knocking at the store of the cycle that is still closing. With ``jitter``, every rank
    sleeps a random time (up to ``jitter`` s, its own draw each cycle) before it closes, so
    that fast and slow ranks interleave in every order. Returns each cycle's init-to-close
    time on this rank."""
    rng = np.random.default_rng([seed, rank])
    took = []
    for cycle in range(cycles):
        started = time.monotonic()
        with init(rank, world, store, transport, timeout=20.0) as comm:
            x = np.full(4, float(rank + cycle))
            comm.allreduce(x)
            want = world * cycle + world * (world - 1) / 2
            assert x.tolist() == [want] * 4, (cycle, x.tolist(), want)
            if jitter:
                time.sleep(float(rng.uniform(0.0, jitter)))
        took.append(time.monotonic() - started)
    return took


def job_next_group_while_the_first_lives(rank: int, world: int, store: str, transport: str,
                                         **_: Any) -> list[float]:
    """Rank 0 makes its next group on the address while its first one still lives there;
    the other ranks close the first one before they make the next. The store stays up for
    the next group after rank 0 closes the first (a split, which sets up through the store,
    works), and goes when the last closes. Returns each allreduce's first value."""
    seen = []
    first = init(rank, world, store, transport, timeout=20.0)
    x = np.full(3, float(rank))
    first.allreduce(x)
    seen.append(float(x[0]))
    if rank != 0:
        first.close()
    with init(rank, world, store, transport, timeout=20.0) as second:
        if rank == 0:
            first.close()
        y = np.ones(3)
        second.allreduce(y)
        seen.append(float(y[0]))
        sub = second.split(0)  # both ranks: it meets through the store
        z = np.ones(3)
        sub.allreduce(z)
        seen.append(float(z[0]))
        sub.close()
    return seen


# --------------------------------------------------------------------------- jobs: the hunt


def job_hunt(rank: int, world: int, store: str, transport: str, seed: int, n: int,
             op_timeout: float, **_: Any) -> list[dict]:
    """The disagreement hunt's cases for this world (``tests/hunt.py``), each on a fresh
    communicator over one store that rank 0 serves for the whole job. Returns each case's
    report, its error reduced to what pickles."""
    import hunt

    from ringcomm.bootstrap.store import StoreClient, StoreServer

    host, port = store.rsplit(":", 1)
    server = StoreServer(host, int(port)) if rank == 0 else None
    client = StoreClient(store, timeout=30)
    reports = []
    try:
        for case in hunt.cases(seed, n, worlds=(world,)):
            comm = ringcomm.init(rank=rank, world_size=world, store=client,
                                 timeout=op_timeout, transport=transport)
            try:
                comm.segment_bytes = case.calls[rank].segment  # as if not agreed
                report = hunt.play(comm, case.calls[rank])
            finally:
                comm.close()
            if report["error"] is not None:
                err = report["error"]
                report["error"] = CommError(str(err)) if isinstance(err, CommError) else repr(err)
                report["type"] = type(err).__name__
            reports.append(report)
    finally:
        client.close()
        if server is not None:
            server.close()
    return reports


# --------------------------------------------------------------------------- jobs: agreement


@contextlib.contextmanager
def _rank_environment(env: dict[str, str | None], cpus: list[int] | None) -> Any:
    """This rank's own environment variables and CPU affinity for one job, restored after
    (the process runs later jobs too)."""
    saved = {k: os.environ.get(k) for k in env}
    affinity = os.sched_getaffinity(0)
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.sched_setaffinity(0, affinity)


def job_agreement(rank: int, world: int, store: str, transport: str,
                  env: dict[int, dict[str, str | None]], cpus: dict[int, list[int]] | None = None,
                  sizes: tuple[int, ...] = (), version: dict[int, str] | None = None,
                  **_: Any) -> dict:
    """Init with this rank's own settings (``env``, ``cpus``, a faked ``version``); report
    the init error, or what the communicator agreed on and chose, and whether allreduces of
    ``sizes`` bytes (float32) came out right."""
    import ringcomm.plan.settings as settings

    real_version = settings.VERSION
    with _rank_environment(env.get(rank, {}), (cpus or {}).get(rank)):
        settings.VERSION = (version or {}).get(rank, real_version)
        start = time.monotonic()
        try:
            comm = init(rank, world, store, transport, timeout=30.0)
        except ArgumentError as err:
            return {"init_error": error_info(err, time.monotonic() - start)}
        finally:
            settings.VERSION = real_version
        with comm:
            out = {"chosen": {n: comm.allreduce_algorithm(n) for n in sizes},
                   "segment": comm.segment_bytes, "profile": comm.settings.profile_source,
                   "params": comm.settings.cost_params(world),
                   "cores_per_rank": comm.topology.cores_per_rank, "right": []}
            for n in sizes:
                x = values(rank, n // 4).astype(np.float32)
                comm.allreduce(x)
                want = sum(values(r, n // 4) for r in range(world)).astype(np.float32)
                out["right"].append(x.tobytes() == want.tobytes())
        return out


def job_split(rank: int, world: int, store: str, transport: str, **_: Any) -> dict:
    """comm.split by parity and by host over real channels: each sub-communicator reduces
    among its own members only, alongside the parent."""
    with init(rank, world, store, transport) as comm:
        sub = comm.split(rank % 2, key=-rank + world)  # reversed order inside each part
        x = np.full(5, float(rank))
        sub.allreduce(x)
        y = np.ones(3)
        comm.allreduce(y)  # the parent still works, its messages apart from the sub's
        out = {"sub_rank": sub.rank, "sub_size": sub.world_size, "sum": float(x[0]),
               "parent": float(y[0]), "none": comm.split(None) is None}
        sub.close()
    return out


def job_fake_device_allreduce(rank: int, world: int, store: str, transport: str,
                              **_: Any) -> list:
    """Ring allreduces of the fake runtime's device arrays over real channels, staged
    through host memory: a small one, and 1 MiB in 64 KiB segments (payloads that take the
    shared-memory path). Returns the element counts checked."""
    from ringcomm.testing import FakeDeviceArray

    done = []
    with init(rank, world, store, transport, segment_bytes=64 * 1024) as comm:
        for count in (5, MiB // 4):
            x = FakeDeviceArray.from_host(values(rank, count), dtype=np.float32)
            assert comm.allreduce(x, algorithm="ring") is x
            want = sum(values(r, count) for r in range(world))
            expect_equal(f"fake-device allreduce x{count}", x.to_host().astype(np.float64),
                         want, "float32")
            # freed now: a group without a device runtime leaves the arrays it staged held
            # (keep_until_done) after its close, to be freed during a later job of the process
            x.close()
            done.append(count)
    return done


# --------------------------------------------------------------------------- jobs: the board


def job_board(rank: int, world: int, store: str, transport: str,
              env: dict[int, dict[str, str | None]] | None = None, **_: Any) -> dict:
    """Board ops mixed with link ops, point-to-point messages and async ops, each checked:
    what the board and the automatic choice were, and which checks failed."""
    from ringcomm.schedules.board import one_shot_bytes
    from ringcomm.transport.board import SLOT_BYTES

    with _rank_environment((env or {}).get(rank, {}), None):
        comm = init(rank, world, store, transport, timeout=30.0)
    wrong: list[str] = []
    with comm:
        # one-shot, two-shot in one piece and in three (the last one short)
        one_shot = one_shot_bytes(world)
        sizes = (4, 4096, one_shot, one_shot + 4, 2 * SLOT_BYTES + 12)
        chosen = {n: comm.allreduce_algorithm(n) for n in sizes}
        for salt in range(3):
            for n in sizes:
                x = values(rank, n // 4, salt).astype(np.float32)
                comm.allreduce(x)
                want = sum(values(r, n // 4, salt) for r in range(world))
                if not np.array_equal(x, want.astype(np.float32)):
                    wrong.append(f"allreduce {n} B, round {salt}")
                x = values(rank, n // 4, salt).astype(np.float32)
                comm.allreduce(x, algorithm="ring")  # over the links, between board ops
                if not np.array_equal(x, want.astype(np.float32)):
                    wrong.append(f"ring allreduce {n} B, round {salt}")
                t = torch.from_numpy(values(rank, n // 8, salt)).to(torch.float64)
                comm.allreduce(t, "max")
                if not torch.equal(t, torch.from_numpy(
                        np.max([values(r, n // 8, salt) for r in range(world)], axis=0))):
                    wrong.append(f"max of a tensor, {n} B, round {salt}")
            comm.barrier()
            blocks = np.zeros(3 * world)
            comm.allgather(blocks, np.full(3, float(rank + salt)))
            if not np.array_equal(blocks, np.repeat(np.arange(world) + float(salt), 3)):
                wrong.append(f"allgather, round {salt}")
            for root in range(world):
                b = np.full(5, float(rank))
                comm.broadcast(b, root=root)
                if not np.array_equal(b, np.full(5, float(root))):
                    wrong.append(f"broadcast from {root}, round {salt}")
            # a message between two board ops, taken after them
            if rank == 1:
                comm.send(np.full(5, 7.0 + salt), dst=0)
            small = np.full(3, float(rank))
            comm.allreduce(small)
            got = np.zeros(5)
            if rank == 0:
                comm.recv(got, src=1)
                if not np.array_equal(got, np.full(5, 7.0 + salt)):
                    wrong.append(f"recv after a board op, round {salt}")
            if not np.array_equal(small, np.full(3, float(sum(range(world))))):
                wrong.append(f"allreduce around a send, round {salt}")
            # async ops queue on the worker, which runs board ops too, in order
            parts = [np.full(2, float(rank + i)) for i in range(4)]
            works = [comm.allreduce(p, async_op=True) for p in parts]
            for w in works:
                w.wait()
            for i, p in enumerate(parts):
                if not np.array_equal(p, np.full(2, float(sum(range(world)) + world * i))):
                    wrong.append(f"async allreduce {i}, round {salt}")
        return {"board": comm.transport.board is not None, "chosen": chosen, "wrong": wrong}


def job_board_p2p_while_waiting(rank: int, world: int, store: str, transport: str,
                                **_: Any) -> dict:
    """Rank 1 sends to rank 0, then joins an allreduce that rank 2 joins late: rank 0 waits
    on the board meanwhile and reads rank 1's message off the pipe while it watches it; the
    message must reach the receive after the op, whole."""
    comm = init(rank, world, store, transport, timeout=30.0)
    with comm:
        payload = np.arange(20000, dtype=np.float64)  # through the pipe and the ring
        if rank == 1:
            comm.send(payload, dst=0)
        if rank == 2:
            time.sleep(0.3)
        x = np.ones(4)
        comm.allreduce(x)
        got = np.zeros_like(payload)
        if rank == 0:
            comm.recv(got, src=1)
        return {"sum": x.tolist(), "recv": bool(rank != 0 or np.array_equal(got, payload)),
                "board": comm.transport.board is not None}


def job_allreduce_now(rank: int, world: int, store: str, transport: str, board: bool = True,
                      **_: Any) -> dict:
    """``allreduce_now``: the short way or nothing. With nothing queued it reduces on the
    board (and does nothing without one); with an async op queued before it (rank 1 joins
    that op late, and async ops go to the worker here), it must not run ahead of it."""
    env = {"RINGCOMM_INLINE_BYTES": "0", "RINGCOMM_BOARD": None if board else "0"}
    with _rank_environment(env, None):
        comm = init(rank, world, store, transport, timeout=30.0)
    with comm:
        x = np.full(3, float(rank))
        ran = comm.allreduce_now(x)
        if not ran:
            comm.allreduce(x)  # every rank did nothing: keep them in step
        first = (ran, x.tolist())
        jumped = None
        if rank == 0:
            queued = comm.allreduce(np.ones(2), async_op=True)
            jumped = comm.allreduce_now(np.zeros(3))  # must find the queued op ahead of it
            queued.wait()
        else:
            time.sleep(0.3)
            comm.allreduce(np.ones(2))
        y = np.full(3, float(rank))
        comm.allreduce(y)
        return {"board": comm.transport.board is not None, "first": first, "jumped": jumped,
                "after": y.tolist()}


def spawned_ranks(target: Callable[..., None], world: int, wait_s: float = 200.0
                  ) -> list[Any]:
    """Run ``target(rank, world, store, out)`` in ``world`` fresh spawned processes (CUDA
    does not survive ``fork``; ranks meet through a file store at ``store``); each puts
    ``(rank, "ok", result)`` or ``(rank, "err", traceback)`` on ``out``. Every rank's result
    in rank order; an assertion naming every rank that failed otherwise. Processes still
    running at the end are killed."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(r, world, store, out)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            got = [out.get(timeout=wait_s) for _ in range(world)]
        finally:
            for p in procs:
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()
    errors = [f"rank {r}:\n{detail}" for r, status, detail in got if status != "ok"]
    assert not errors, "\n".join(errors)
    return [detail for _, _, detail in sorted(got, key=lambda g: g[0])]
