"""The NCCL engine: ringcomm's schedules as NCCL group calls, and NCCL's own collectives as
one more algorithm (``nccl``), on device memory, with a deadline NCCL does not have.

A schedule runs as its plan (``ringcomm.schedules.nccl_groups``): group ``l`` of every rank
meets group ``l`` of its peers, receives to be reduced land in a temporary, and the
reductions and copies follow each group on the lane's stream. Stream order with the caller
is the device engine's (``stage_in``, ``stage_out``): the op waits on the caller's work, the
caller's stream waits on the op's.

What NCCL does not do, the engine does around it:

- **Agreement.** NCCL's calls carry no header, so before its work each rank sends every
  peer of the op a header (the op's descriptor) over the links and checks theirs: ranks
  that disagree about an op get ``DesyncError`` instead of a hang or a wrong sum.
- **A deadline.** NCCL has no timeout. The rank's worker thread watches the op: until its
  work is done it polls the device, and reads the links for an abort from a peer. At the
  deadline it aborts the communicator and raises ``CommTimeout`` naming the peers of the
  first group not done; the communicator's failure then tells every peer over the control
  plane, and each peer, reading it while it watches, aborts its own communicator and
  raises ``RemoteError`` naming this rank. An aborted communicator is never used again.
- **An explicit end.** ``close`` destroys the communicator once its work is done, or, after
  a failure, aborts it (CuPy's garbage collection would call the blocking destroy).

The unique id travels through the group's store (``open_channel``): rank 0 draws it and
publishes it, the others read it within the set-up's deadline; it lives as long as the
communicator, and a new group (a split) draws its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..core.algorithms import NCCL
from ..core.arrays import Buffer, DeviceBuffer
from ..core.device.nccl import NcclComm, NcclLibrary
from ..core.device.runtime import DeviceRuntime
from ..errors import CommAborted, CommError, CommTimeout
from ..schedules.nccl_groups import TEMP, Call, Plan, plans
from ..schedules.schedule import Region, Schedule
from ..transport.base import Transport
from .base import Engine
from .context import OpContext
from .device import (
    DeviceLane,
    hear_headers,
    held,
    stage_in,
    stage_out,
    tell_headers,
    watch,
)
from .device_channel import Exchange

__all__ = ["NcclChannel", "NcclEngine", "open_channel"]

log = logging.getLogger("ringcomm")

_ID_KEY = "nccl-id"
_PLANS_KEPT = 256


class NcclChannel:
    """One rank's NCCL communicator, as a lane owns it (``DeviceLane``): made once per
    group, ended once (``close`` or ``abandon``), never used after an abort."""

    name = NCCL

    def __init__(self, runtime: DeviceRuntime, library: NcclLibrary, comm: NcclComm) -> None:
        self.runtime = runtime
        self.library = library
        self.comm = comm
        self.ended = ""  # why it may not be used: "aborted: ...", "closed"
        self._lock = threading.Lock()

    def abort(self, why: str) -> None:
        """End the communicator now (its queued work ends without waiting for peers)."""
        with self._lock:
            if not self.ended:
                self.ended = f"aborted: {why}"
                self.comm.abort()

    def close(self, *, failed: bool = False) -> None:
        with self._lock:
            if not self.ended:
                self.ended = "closed"
                self.comm.destroy()

    def abandon(self) -> None:
        self.abort("the group closed after a failure")

    def describe(self) -> str:
        peers = [r for r in range(self.comm.world_size) if r != self.comm.rank]
        pairs = ", ".join(f"{self.comm.rank}<->{p}" for p in peers) or "none (one rank)"
        return f"nccl {self.library.version()} ({self.library.name}; every pair: {pairs})"


def open_channel(runtime: DeviceRuntime, library: NcclLibrary, exchange: Exchange,
                 rank: int, world_size: int, timeout: float) -> NcclChannel:
    """This rank's communicator, from the unique id rank 0 draws and publishes through
    ``exchange`` (the group's store); a ``CommTimeout`` naming rank 0 where its id does not
    come within ``timeout``, and one naming the set-up where the communicator is not made
    in time (a rank that never connects: NCCL would wait for ever)."""
    deadline = time.monotonic() + timeout
    if rank == 0:
        unique_id = library.unique_id()
        exchange.publish(_ID_KEY, unique_id)
    else:
        unique_id = exchange.read(_ID_KEY, 0, deadline)
    made: list[Any] = []

    def connect() -> None:
        try:
            made.append(library.connect(world_size, unique_id, rank))
        except BaseException as err:  # noqa: BLE001 - raised on the caller's thread
            made.append(err)

    worker = threading.Thread(target=connect, name=f"ringcomm-nccl-init-{rank}", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if not made:
        raise CommTimeout(f"the NCCL communicator was not made within {timeout:g} s: a rank "
                          "did not connect (NCCL waits for every rank); the attempt is left "
                          "behind", rank=rank, op="nccl set-up")
    if isinstance(made[0], BaseException):
        raise CommError(f"NCCL could not make the communicator: {made[0]}", rank=rank,
                        op="nccl set-up") from made[0]
    return NcclChannel(runtime, library, made[0])


class NcclEngine(Engine):
    """Runs ops on device memory through the lane's NCCL communicator (see the module
    docstring)."""

    name = NCCL
    plans_from_every_rank = True  # a message's level is fixed by both of its ends

    def __init__(self, lane: DeviceLane, transport: Transport) -> None:
        channel = lane.channel
        assert isinstance(channel, NcclChannel)
        self.lane = lane
        self.channel = channel
        self.comm = channel.comm
        self.runtime = lane.runtime
        self.transport = transport
        self.moves = frozenset({lane.runtime.memory})
        self.rank = transport.rank
        self.world_size = transport.world_size
        self._planned: dict[tuple[Any, ...], Plan] = {}  # by op shape: calls come back

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        if self.channel.ended:
            raise CommAborted(f"the NCCL communicator cannot be used: it was "
                              f"{self.channel.ended}; create a new communicator",
                              rank=self.rank, op=ctx.name)
        with held(self.lane) as (device, lifted):
            self._run(schedule, buffers, ctx, device, lifted)

    def _run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext,
             device: list[DeviceBuffer], lifted: list[tuple[str, Buffer, int]]) -> None:
        lane = self.lane
        pointers = stage_in(lane, buffers, self.name, device, lifted)
        if schedule.algorithm == NCCL:
            peers = [p for p in range(self.world_size) if p != self.rank]
            tell_headers(self.transport, peers, ctx)
            self._collective(schedule, buffers, pointers, ctx)
            marks = [(peers, self._mark())]
            written = {"output" if "output" in buffers else "data"}
        else:
            plan = self._plan(schedule, ctx)
            itemsize = ctx.dtype.itemsize
            if schedule.scratch and "scratch" not in pointers:
                pointers["scratch"] = lane.scratch("scratch", schedule.scratch * itemsize)
            if plan.temp:
                pointers[TEMP] = lane.scratch(TEMP, plan.temp * itemsize)
            peers = sorted({c.peer for g in plan.groups for c in g.calls})
            tell_headers(self.transport, peers, ctx)
            marks = self._enqueue(plan, pointers, ctx)
            written = {step.dst.buf for step in schedule.steps if step.dst is not None}
        self._hear(peers, ctx)
        self._watch(marks, peers, ctx)
        stage_out(lane, device, lifted, written)

    # ------------------------------------------------------------------ agreement
    def _hear(self, peers: list[int], ctx: OpContext) -> None:
        """Take every peer's header of the op: ``DesyncError`` where it disagrees (the
        communicator is aborted first: its queued work may wait for ever)."""
        try:
            hear_headers(self.transport, peers, ctx)
        except CommError as err:
            self.channel.abort(f"{type(err).__name__} while the op's headers were checked")
            raise

    # ------------------------------------------------------------------ work
    def _plan(self, schedule: Schedule, ctx: OpContext) -> Plan:
        build = ctx.schedule_of
        if build is None:
            raise ValueError("the NCCL engine plans from every rank's schedule: the op "
                             "must say how to build them (OpContext.schedule_of)")
        desc = ctx.desc
        key = (schedule.collective, schedule.algorithm, desc.count, desc.segment, desc.arg,
               ctx.dtype.itemsize, desc.send_counts, desc.recv_counts)
        plan = self._planned.get(key)
        if plan is None:  # every rank's schedule, for the levels both ends of a message share
            everyone = [schedule if r == self.rank else build(r)
                        for r in range(self.world_size)]
            plan = plans(everyone)[self.rank]
            if len(self._planned) >= _PLANS_KEPT:
                del self._planned[next(iter(self._planned))]
            self._planned[key] = plan
        return plan

    def _enqueue(self, plan: Plan, pointers: dict[str, int],
                 ctx: OpContext) -> list[tuple[list[int], Any]]:
        """Queue every group and its local work; after each group with calls, an event
        that says it is done, with the group's peers (what a timeout names)."""
        runtime, stream, comm = self.runtime, self.lane.stream, self.comm
        itemsize, dtype, reduce = ctx.dtype.itemsize, ctx.dtype, ctx.reduce

        def at(region: Region) -> int:
            return pointers[region.buf] + region.offset * itemsize

        marks: list[tuple[list[int], Any]] = []
        for group in plan.groups:
            if group.calls:
                comm.group_start()
                for c in group.calls:
                    nbytes = c.region.count * itemsize
                    if c.call is Call.SEND:
                        comm.send(at(c.region), nbytes, c.peer, stream)
                    else:
                        comm.recv(at(c.region), nbytes, c.peer, stream)
                comm.group_end()
                marks.append((sorted({c.peer for c in group.calls}), self._mark()))
            for w in group.then:
                if not w.dst.count:
                    continue
                if w.temp is None:
                    runtime.copy(at(w.dst), at(w.src), w.dst.count * itemsize, stream)
                    continue
                assert reduce is not None
                runtime.reduce(at(w.dst), at(w.src), at(w.temp), w.dst.count, dtype, reduce,
                               stream)
                if w.final and reduce.divides:
                    runtime.finish(at(w.dst), w.dst.count, dtype, reduce, self.world_size,
                                   stream)
        return marks

    def _collective(self, schedule: Schedule, buffers: Mapping[str, Buffer],
                    pointers: dict[str, int], ctx: OpContext) -> None:
        """NCCL's own call for the collective."""
        comm, stream, dtype = self.comm, self.lane.stream, ctx.dtype
        kind, reduce, root = schedule.collective, ctx.reduce, ctx.desc.arg
        if kind == "allreduce":
            assert reduce is not None
            comm.all_reduce(pointers["data"], pointers["data"], buffers["data"].count, dtype,
                            reduce, stream)
        elif kind == "broadcast":
            comm.broadcast(pointers["data"], pointers["data"], buffers["data"].count, dtype,
                           root, stream)
        elif kind == "reduce":
            assert reduce is not None
            # NCCL's reduce writes the root's buffer only; in place it leaves the others' as
            # they were, which is ringcomm's reduce
            comm.reduce(pointers["data"], pointers["data"], buffers["data"].count, dtype,
                        reduce, root, stream)
        elif kind == "reduce_scatter":
            assert reduce is not None
            comm.reduce_scatter(pointers["input"], pointers["output"],
                                buffers["output"].count, dtype, reduce, stream)
        elif kind == "allgather":
            comm.all_gather(pointers["input"], pointers["output"], buffers["input"].count,
                            dtype, stream)
        else:
            raise ValueError(f"NCCL has no call of its own for {kind}; its schedules run "
                             "as NCCL groups instead")

    def _mark(self) -> Any:
        event = self.runtime.new_event()
        self.runtime.record(event, self.lane.stream)
        return event

    # ------------------------------------------------------------------ the deadline
    def _watch(self, marks: list[tuple[list[int], Any]], peers: list[int],
               ctx: OpContext) -> None:
        """Until the op's work is done: poll the device, and read the links for a peer's
        abort. At the deadline, abort the communicator and raise ``CommTimeout`` naming the
        peers of the first group not done (``device.watch``)."""
        watch(self.runtime, self.transport, marks, peers, ctx, engine="NCCL",
              abort=self.channel.abort, device_error=self.comm.async_error)

    def describe(self) -> str:
        return f"{self.channel.describe()} on {self.runtime.name} ({self.runtime.memory})"
