"""What the CUDA IPC channel's tests run on each rank: a small driver of ``IpcChannel`` over
the strict fake runtime, for ranks that are threads (in-memory transports) and for ranks
that are real processes (links and an exchange through a store).

The driver plays a device engine's part by hand: device buffers are the fake runtime's
allocations, every copy goes on the rank's own stream, and values are read back only
through ``to_host`` after the stream is synchronized.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

import ringcomm.testing  # noqa: F401 - registers the fake runtime
from ringcomm.core.device import runtime as device_runtime
from ringcomm.core.device.runtime import Allocation, DeviceRuntime, Stream
from ringcomm.core.dtypes import REDUCE_OPS, dtype_code, finish_reduction, reduce_into
from ringcomm.engines.context import OpContext
from ringcomm.engines.cuda_ipc import IpcChannel
from ringcomm.errors import CommTimeout
from ringcomm.transport.base import Transport
from ringcomm.transport.header import OpDescriptor, OpKind, reduce_code

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "int64": np.dtype(np.int64)}


# --------------------------------------------------------------------------- exchanges
class ThreadExchange:
    """The exchange of ranks that are threads of one process: a shared table."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._table: dict[tuple[str, int], bytes] = {}

    def for_rank(self, rank: int) -> _RankExchange:
        return _RankExchange(self, rank)

    def put(self, key: str, rank: int, value: bytes) -> None:
        with self._cond:
            self._table[key, rank] = value
            self._cond.notify_all()

    def get(self, key: str, rank: int, deadline: float) -> bytes:
        with self._cond:
            while (key, rank) not in self._table:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"rank {rank} did not publish {key!r} in time",
                                      peer=rank)
                self._cond.wait(left)
            return self._table[key, rank]


class _RankExchange:
    def __init__(self, shared: ThreadExchange, rank: int) -> None:
        self._shared, self._rank = shared, rank

    def publish(self, key: str, value: bytes) -> None:
        self._shared.put(key, self._rank, value)

    def read(self, key: str, rank: int, deadline: float) -> bytes:
        return self._shared.get(key, rank, deadline)


class StoreExchange:
    """The exchange of ranks that are processes: keys in a store."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store, self._rank = store, rank

    def publish(self, key: str, value: bytes) -> None:
        self._store.set(f"{key}/{self._rank}", value)

    def read(self, key: str, rank: int, deadline: float) -> bytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeout(f"rank {rank} did not publish {key!r} in time", peer=rank)
        return bytes(self._store.get(f"{key}/{rank}", timeout=left))


# --------------------------------------------------------------------------- one rank
def context(seq: int, dtype: np.dtype, *, op: str | None = None, timeout: float = 10.0,
            count: int = 0) -> OpContext:
    """An op as both ends of its messages see it."""
    reduce = REDUCE_OPS[op] if op else None
    desc = OpDescriptor(int(OpKind.ALLREDUCE), seq, dtype_code(dtype), 0, reduce_code(reduce),
                        count=count)
    return OpContext(desc, f"allreduce #{seq}", np.dtype(dtype), time.monotonic() + timeout,
                     reduce)


class Rank:
    """One rank's side of a test: its runtime, stream, transport and channel, and device
    buffers it made (given back by ``close``)."""

    def __init__(self, transport: Transport, exchange: Any, *, slots: int,
                 slot_bytes: int, close_wait_s: float = 5.0) -> None:
        self.rt: DeviceRuntime = device_runtime("fake")
        self.rank, self.world = transport.rank, transport.world_size
        self.transport = transport
        self.stream: Stream = self.rt.new_stream()
        self.before = self.rt.live_allocations()
        self.channel = IpcChannel(self.rt, transport, exchange, self.rank, self.world,
                                  slots=slots, slot_bytes=slot_bytes,
                                  close_wait_s=close_wait_s)
        self.buffers: list[Allocation] = []

    def put(self, values: np.ndarray) -> int:
        """Device memory holding ``values`` (queued on this rank's stream)."""
        memory = self.rt.malloc(max(values.nbytes, 16))
        self.buffers.append(memory)
        self.rt.from_host(memory.ptr, np.ascontiguousarray(values), self.stream)
        return memory.ptr

    def empty(self, nbytes: int) -> int:
        memory = self.rt.malloc(max(nbytes, 16))
        self.buffers.append(memory)
        return memory.ptr

    def get(self, ptr: int, count: int, dtype: np.dtype) -> np.ndarray:
        """The values at ``ptr`` once this rank's stream has done its work."""
        out = np.empty(count, dtype)
        self.rt.to_host(out, ptr, self.stream)
        self.rt.synchronize(self.stream)
        return out

    def send(self, peer: int, ctx: OpContext, index: int, ptr: int, nbytes: int) -> None:
        header = ctx.desc.outgoing(peer, self.rank, index, nbytes)
        self.channel.send(peer, header, ptr, nbytes, self.stream, ctx)

    def recv(self, peer: int, ctx: OpContext, index: int, ptr: int, nbytes: int,
             **reduce: Any) -> None:
        header = ctx.desc.incoming(peer, index, nbytes)
        self.channel.recv(peer, header, ptr, nbytes, self.stream, ctx, **reduce)

    def finish(self, ctx: OpContext) -> None:
        """The op's last step is queued: pieces still waiting for slots get them."""
        self.channel.finish(self.stream, ctx)

    def close(self) -> int:
        """Close the channel, free the buffers; what ``live_allocations`` says then, less
        what it said before the channel was made (for a rank alone in its process)."""
        self.rt.synchronize(self.stream)
        self.channel.close()
        for memory in self.buffers:
            self.rt.free(memory)
        self.buffers = []
        return self.rt.live_allocations() - self.before


def message(rank: int, index: int, nbytes: int) -> np.ndarray:
    """A message's bytes, different for every sender, index and size."""
    return ((np.arange(nbytes, dtype=np.int64) * 7 + rank * 31 + index * 13) % 251).astype(
        np.uint8)


def values(rank: int, count: int, dtype: np.dtype, round_: int = 0) -> np.ndarray:
    """A rank's contribution: small integers, exact in every dtype of the tests."""
    ints = (np.arange(count, dtype=np.int64) * (rank + 3) + round_ * 5 + rank) % 17 - 8
    return ints.astype(dtype)


def expected_reduction(mine: np.ndarray, theirs: np.ndarray, op: str,
                       divide_by: int) -> np.ndarray:
    out = np.empty_like(mine)
    reduce_into(out, mine, theirs, REDUCE_OPS[op])
    finish_reduction(out, REDUCE_OPS[op], divide_by)
    return out


# --------------------------------------------------------------------------- scenarios
def stream_of_messages(me: Rank, sizes: list[int], *, sender: int, receiver: int, seq: int,
                       meet: Callable[[], None]) -> None:
    """``sender`` sends one message of each size to ``receiver``, queued back to back (the
    sender runs ahead, reusing its slots as credits come back), then overwrites its sources;
    the sender's stream finishes its work first (``meet`` between), so a slot written again
    before its reader read it shows as wrong bytes."""
    ctx = context(seq, np.dtype(np.uint8))
    if me.rank == sender:
        sources = [me.put(message(sender, i, n)) for i, n in enumerate(sizes)]
        for i, (ptr, n) in enumerate(zip(sources, sizes, strict=True)):
            me.send(receiver, ctx, i, ptr, n)
        me.finish(ctx)
        for ptr, n in zip(sources, sizes, strict=True):
            me.rt.from_host(ptr, np.zeros(max(n, 1), np.uint8), me.stream)
        me.rt.synchronize(me.stream)
        meet()
        meet()
    elif me.rank == receiver:
        targets = [me.empty(n) for n in sizes]
        for i, (ptr, n) in enumerate(zip(targets, sizes, strict=True)):
            me.recv(sender, ctx, i, ptr, n)
        meet()  # the sender's stream runs first
        meet()
        for i, (ptr, n) in enumerate(zip(targets, sizes, strict=True)):
            got = me.get(ptr, n, np.dtype(np.uint8))
            assert np.array_equal(got, message(sender, i, n)), \
                f"message {i} ({n} B) from rank {sender} arrived wrong"
    else:
        meet()
        meet()


def ring_reductions(me: Rank, count: int, dtype_name: str, op: str, rounds: int,
                    seq: int) -> None:
    """Each round every rank sends its vector to the next rank and reduces the previous
    rank's into its own, reading the peer's slot directly."""
    dtype = DTYPES[dtype_name]
    nxt, prev = (me.rank + 1) % me.world, (me.rank - 1) % me.world
    nbytes = count * dtype.itemsize
    for round_ in range(rounds):
        ctx = context(seq + round_, dtype, op=op, count=count)
        mine = values(me.rank, count, dtype, round_)
        theirs = values(prev, count, dtype, round_)
        src, dst = me.put(mine), me.empty(nbytes)
        me.send(nxt, ctx, 0, src, nbytes)
        me.recv(prev, ctx, 0, dst, nbytes, reduce_with=src, op=REDUCE_OPS[op],
                divide_by=2 if op == "avg" else 1)
        me.finish(ctx)
        got = me.get(dst, count, dtype)
        want = expected_reduction(mine, theirs, op, 2 if op == "avg" else 1)
        assert np.array_equal(got.astype(np.float64), want.astype(np.float64)), \
            f"round {round_}: {op} of {dtype_name} from rank {prev} is wrong"


# --------------------------------------------------------------------------- processes
def process_rank(rank: int, world: int, port: int, job: str, kwargs: dict[str, Any],
                 results: Any) -> None:
    """A rank in a process of its own: links and exchange through the store at ``port``;
    runs ``job`` and puts ``(rank, result or error text)`` on ``results``."""
    from ringcomm.bootstrap.store import StoreClient
    from ringcomm.transport.group import GroupTransport

    store = StoreClient(f"127.0.0.1:{port}", timeout=20)
    transport = None
    try:
        transport = GroupTransport(rank, world, store, hosts=["h"] * world, mode="ipc",
                                   shm=True, timeout=20)
        outcome = JOBS[job](rank, world, transport, StoreExchange(store, rank), **kwargs)
        results.put((rank, outcome))
    except BaseException as err:  # noqa: BLE001 - the test reads it
        results.put((rank, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        if transport is not None:
            transport.close()
        store.close()


def _job_messages_and_reductions(rank: int, world: int, transport: Transport, exchange: Any,
                                 *, late_closer: int) -> Any:
    me = Rank(transport, exchange, slots=2, slot_bytes=256)
    barrier_at = [0]

    def meet() -> None:  # a barrier through the store
        barrier_at[0] += 1
        key = f"meet{barrier_at[0]}"
        exchange.publish(key, b"1")
        for peer in range(world):
            exchange.read(key, peer, time.monotonic() + 20)

    sizes = [0, 4, 250, 256, 260, 1024, 8, 2056, 3]
    stream_of_messages(me, sizes, sender=0, receiver=1, seq=0, meet=meet)
    stream_of_messages(me, sizes, sender=world - 1, receiver=0, seq=1, meet=meet)
    ring_reductions(me, 300, "float32", "sum", 3, seq=2)
    ring_reductions(me, 300, "bfloat16", "avg", 2, seq=5)
    ring_reductions(me, 77, "int64", "max", 2, seq=7)
    if rank == late_closer:
        time.sleep(0.5)  # its peers close first: they must wait for it before they free
    return {"leaked": me.close(), "pid": os.getpid()}


def _job_killed(rank: int, world: int, transport: Transport, exchange: Any,
                *, victim: int, timeout: float) -> Any:
    me = Rank(transport, exchange, slots=2, slot_bytes=64, close_wait_s=2.0)
    ctx = context(0, np.dtype(np.uint8), timeout=timeout)
    if rank == victim:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    error = None
    try:
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        src, dst = me.put(message(rank, 0, 1024)), me.empty(1024)
        me.send(nxt, ctx, 0, src, 1024)  # 16 pieces through 2 slots: needs credits
        me.recv(prev, ctx, 0, dst, 1024)
        me.finish(ctx)
    except Exception as err:  # noqa: BLE001 - the test reads it
        error = err
    took = time.monotonic() - started
    closing = time.monotonic()
    leaked = me.close()
    return {"error": type(error).__name__ if error else None,
            "peer": getattr(error, "peer", None), "op": getattr(error, "op", None),
            "took": took, "close_took": time.monotonic() - closing, "leaked": leaked}


JOBS: dict[str, Callable[..., Any]] = {
    "messages_and_reductions": _job_messages_and_reductions,
    "killed": _job_killed,
}


def run_processes(world: int, job: str, limit_s: float, **kwargs: Any) -> dict[int, Any]:
    """``job`` on ``world`` spawned processes; each rank's outcome (a killed rank has none)."""
    from ringcomm.bootstrap.store import StoreServer

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    server = StoreServer("127.0.0.1", 0)
    port = int(server.address.rpartition(":")[2])
    procs = [ctx.Process(target=process_rank, args=(r, world, port, job, kwargs, results),
                         daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        outcomes: dict[int, Any] = {}
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            for p in procs:
                p.join(0.05)
            while not results.empty():
                rank, outcome = results.get()
                outcomes[rank] = outcome
        while not results.empty():
            rank, outcome = results.get()
            outcomes[rank] = outcome
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} did not finish within {limit_s} s"
        return outcomes
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        results.close()
        server.close()
