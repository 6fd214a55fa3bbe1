"""Calls of every collective, and the schedule each call runs on a rank, built the way the
communicator builds it (``ringcomm.runtime.ops``): for tests that compare what a seam saw
(a wrapper's counts, a timeline's bytes, a trace's engines) with what the schedules say.

``CALLS`` makes one call per collective from buffers named by the table's roles (as
torchft's tests keep ``_COLLECTIVE_TO_FUNC``); ``Call`` describes one call fully enough to
make its buffers on any rank, issue it and rebuild its schedule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.schedules import direct
from ringcomm.schedules.schedule import Kind, Schedule
from ringcomm.transport.board import SLOT_BYTES

# name -> call(comm, buffers by role, op, root, **keywords the method takes)
CALLS = {
    "allreduce": lambda comm, b, op, root, **kw: comm.allreduce(b["data"], op, **kw),
    "reduce_scatter": lambda comm, b, op, root, **kw: comm.reduce_scatter(
        b["output"], b["input"], op, **kw),
    "allgather": lambda comm, b, op, root, **kw: comm.allgather(b["output"], b["input"], **kw),
    "broadcast": lambda comm, b, op, root, **kw: comm.broadcast(b["data"], root, **kw),
    "reduce": lambda comm, b, op, root, **kw: comm.reduce(b["data"], root, op, **kw),
    "gather": lambda comm, b, op, root, **kw: comm.gather(b.get("output"), b["input"], root,
                                                         **kw),
    "scatter": lambda comm, b, op, root, **kw: comm.scatter(b["output"], b.get("input"), root,
                                                           **kw),
    "alltoall": lambda comm, b, op, root, **kw: comm.alltoall(b["output"], b["input"], **kw),
    "barrier": lambda comm, b, op, root, **kw: comm.barrier(**kw),
}

SENDS = (Kind.SEND, Kind.RECV_REDUCE_SEND)  # the steps that put a message on a link
RECEIVES = (Kind.RECV, Kind.RECV_REDUCE, Kind.RECV_REDUCE_SEND)  # that take one off it
TAKES = (Kind.TAKE, Kind.TAKE_REDUCE)


def contribution(rank: int, size: int, dtype: str) -> np.ndarray:
    return ((np.arange(size) * 7 + rank * 13) % 23 - 11).astype(dtype)


@dataclass(frozen=True)
class Call:
    """One call of a collective: ``block`` is the table's block (the count every pair
    agrees on); ``splits[src][dst]`` an all-to-all's uneven blocks; ``algorithm`` a forced
    allreduce algorithm."""

    collective: str
    block: int = 0
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    algorithm: str | None = None
    splits: tuple[tuple[int, ...], ...] | None = None
    async_op: bool = False

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def counts(self, rank: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """An all-to-all's (send counts, receive counts) on ``rank``; None for the others."""
        if self.collective != "alltoall":
            return None
        splits = self.splits or ((self.block,) * world,) * world
        return splits[rank], tuple(splits[src][rank] for src in range(world))

    def sizes(self, rank: int, world: int) -> dict[str, int]:
        """Elements of each buffer ``rank`` holds."""
        counts = self.counts(rank, world)
        if counts is not None:
            return {"input": sum(counts[0]), "output": sum(counts[1])}
        return COLLECTIVES[self.collective].sizes(self.block, world, rank=rank, root=self.root)

    def buffers(self, rank: int, world: int) -> dict[str, np.ndarray]:
        source = COLLECTIVES[self.collective].source
        return {role: contribution(rank, size, self.dtype) if role == source
                else np.full(size, 99, self.dtype)
                for role, size in self.sizes(rank, world).items()}

    def issue(self, comm: Any, buffers: dict[str, np.ndarray]) -> Any:
        """Make the call on ``comm`` (a ``Work`` where it is async)."""
        kw: dict[str, Any] = {"async_op": True} if self.async_op else {}
        if self.algorithm is not None:
            kw["algorithm"] = self.algorithm
        counts = self.counts(comm.rank, comm.world_size)
        if counts is not None and self.splits is not None:
            kw.update(in_splits=counts[0], out_splits=counts[1])
        return CALLS[self.collective](comm, buffers, self.op, self.root, **kw)

    def nbytes(self, rank: int, world: int) -> int:
        """The size the communicator asks the selector about (``Communicator``'s methods):
        one rank's input, the output for a scatter, nothing for a barrier."""
        role = {"scatter": "output", "barrier": None}.get(
            self.collective, COLLECTIVES[self.collective].source)
        return self.sizes(rank, world)[role] * self.itemsize if role else 0

    def schedule(self, rank: int, world: int, algorithm: str, segment_bytes: int,
                 hosts: Any = None) -> Schedule:
        """``rank``'s schedule of this call run by ``algorithm``, as ``OpRunner._run``
        builds it."""
        counts = self.counts(rank, world)
        return schedule_of(self.collective, rank, world, self.block, self.itemsize,
                           algorithm, segment_bytes, root=self.root, hosts=hosts,
                           send_counts=counts[0] if counts else None,
                           recv_counts=counts[1] if counts else None)


def schedule_of(collective: str, rank: int, world: int, block: int, itemsize: int,
                algorithm: str, segment_bytes: int, *, root: int = 0, hosts: Any = None,
                send_counts: tuple[int, ...] | None = None,
                recv_counts: tuple[int, ...] | None = None) -> Schedule:
    """The schedule ``OpRunner._run`` runs: segments of ``segment_bytes // itemsize``
    elements, board posts of ``SLOT_BYTES // itemsize``."""
    return COLLECTIVES[collective].schedule(
        rank, world, block, max(1, segment_bytes // itemsize), root=root,
        algorithm=algorithm, hosts=hosts, send_counts=send_counts, recv_counts=recv_counts,
        piece=SLOT_BYTES // itemsize)


def sent_bytes(schedule: Schedule, itemsize: int) -> int:
    """What a rank puts out in ``schedule``: the bytes of its sends (fused ones included)
    and of its posts on the board."""
    return sum(step.src.count * itemsize for step in schedule.steps
               if step.kind in (*SENDS, Kind.POST) and step.src is not None)


@dataclass
class Tally:
    """Messages sent to and received from each peer, posts made, posts taken from each
    peer."""

    sent: Counter[int] = field(default_factory=Counter)
    received: Counter[int] = field(default_factory=Counter)
    posts: int = 0
    taken: Counter[int] = field(default_factory=Counter)

    def add(self, other: Tally) -> None:
        self.sent.update(other.sent)
        self.received.update(other.received)
        self.posts += other.posts
        self.taken.update(other.taken)

    def as_dict(self) -> dict[str, Any]:
        return {"sent": dict(self.sent), "received": dict(self.received),
                "posts": self.posts, "taken": dict(self.taken)}


def tally(schedule: Schedule) -> Tally:
    """What ``schedule`` says its rank sends, receives, posts and takes."""
    t = Tally()
    for step in schedule.steps:
        if step.kind is Kind.SEND:
            t.sent[step.peer] += 1
        elif step.kind is Kind.RECV_REDUCE_SEND:
            t.sent[step.to] += 1
        if step.kind in RECEIVES:
            t.received[step.peer] += 1
        if step.kind is Kind.POST:
            t.posts += 1
        elif step.kind in TAKES:
            t.taken[step.peer] += 1
    return t


def p2p_messages(sender: int, world: int, receiver: int, count: int, itemsize: int,
                 segment_bytes: int) -> int:
    """Messages of one point-to-point send (``direct.send``, as ``P2PEngine`` cuts it)."""
    return len(direct.send(sender, world, receiver, count,
                           max(1, segment_bytes // itemsize)).steps)
