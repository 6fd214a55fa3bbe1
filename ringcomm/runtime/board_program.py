"""Running a board schedule: posts, each followed by takes of the peers' posts.

A board op sends no message, so the link executor's machinery (pending sends, receive
order, per-peer message counts) has nothing to do; what is left is short enough that a
small op's whole time goes through here. ``BoardProgram`` boils a schedule down, once, to
what changes between its steps (which region this rank posts; which peer's post to take,
from which element, and whether to copy it into a region, reduce it into one, or only
check its header; whether that completes a reduction), and ``run`` does no more than that.
The executor runs board schedules through it, and so does the communicator's short way for
a blocking allreduce; for the one-shot allreduce on host memory, the commonest small call,
the short way takes ``run_whole``, the same posts and takes without the general runner's
lookups.

Every post of an op carries the op's header with the post's number within the op as its
``index``, so that ranks whose posts do not line up find out at the first take. A reduction
is in place (``dst = dst (op) post``).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping

import numpy as np

from ..core.arrays import Buffer
from ..core.dtypes import ReduceOp, finish_reduction
from ..errors import CommTimeout
from ..schedules.schedule import Kind, Region, Schedule
from ..transport.base import Transport
from ..transport.header import OpDescriptor
from .context import OpContext, TraceEvent

_COPY, _REDUCE, _CHECK = "copy", "reduce", "check"  # what a take does with a peer's post
_INDEX = slice(32, 36)  # the header's ``index`` field, packed
_U32 = struct.Struct("<I")

# a take: (peer, what it does, final, buffer role, offset, count, element of the post)
Take = tuple[int, str, bool, str, int, int, int]


class BoardProgram:
    """``schedule`` (posts, each followed by takes), ready to run many times."""

    def __init__(self, schedule: Schedule) -> None:
        steps = schedule.steps
        if not schedule.on_board or steps[0].kind is not Kind.POST:
            raise ValueError(f"{schedule.algorithm} {schedule.collective} is not a board "
                             "schedule (posts, each followed by takes)")
        if any(s.kind is Kind.TAKE_REDUCE and s.src != s.dst for s in steps):
            raise ValueError("a reduction on the board is in place")
        regions = [r for s in steps for r in (s.src, s.dst) if r is not None]
        self.schedule = schedule
        rounds: list[tuple[Region | None, int, tuple[Take, ...]]] = []
        for step in steps:
            if step.kind is Kind.POST:
                assert step.src is not None
                rounds.append((step.src if step.src.count else None, step.at, ()))
                continue
            dst = step.dst
            does = _CHECK if dst is None or not dst.count else \
                _REDUCE if step.kind is Kind.TAKE_REDUCE else _COPY
            take = (step.peer, does, step.final, dst.buf if dst is not None else "",
                    dst.offset if dst is not None else 0, dst.count if dst is not None else 0,
                    step.at)
            post, at, takes = rounds[-1]
            rounds[-1] = (post, at, (*takes, take))
        self.rounds = tuple(rounds)
        self.roles = tuple(dict.fromkeys(r.buf for r in regions if r.count))  # buffers used
        # one post of a whole buffer whose takes copy or reduce all of it (the one-shot
        # allreduce): (peer, reduces, final) per take, for ``run_whole``; else None
        post, place, takes = rounds[0]
        self.whole: tuple[tuple[int, bool, bool], ...] | None = None
        if len(rounds) == 1 and post is not None and not post.offset and not place and all(
                does is not _CHECK and (role, offset, count, at) == (post.buf, 0, post.count, 0)
                for _, does, _, role, offset, count, at in takes):
            self.whole = tuple((peer, does is _REDUCE, final)
                               for peer, does, final, *_ in takes)

    def run(self, transport: Transport, buffers: Mapping[str, Buffer], header: bytes,
            ctx: OpContext, trace: list[TraceEvent] | None = None) -> None:
        """Make this rank's posts (``header``, packed, is its first's; the later ones differ
        in their ``index``) and take the peers' posts into ``buffers`` (by role; host
        memory, which ``region`` views)."""
        dtype, deadline, name = ctx.dtype, ctx.deadline, ctx.name
        started = time.perf_counter() if trace is not None else 0.0
        step = 0
        for number, (post, place, takes) in enumerate(self.rounds):
            if number:
                header = header[:_INDEX.start] + _U32.pack(number) + header[_INDEX.stop:]
            transport.post(header, buffers[post.buf].region(post.offset, post.count)
                           if post is not None else None, deadline, name, place)
            if trace is not None:
                started = self._traced(trace, step, started, transport.rank, ctx)
            step += 1
            for peer, does, final, role, offset, count, at in takes:
                payload = transport.take(peer, header, dtype, count, deadline, name, at)
                if does is not _CHECK:
                    target = buffers[role]
                    into = target.region(offset, count)
                    if does is _REDUCE:
                        assert ctx.reduce is not None
                        target.reduce_into(into, into, payload, ctx.reduce,
                                           transport.world_size if final else 1)
                    else:
                        target.copy(into, payload)
                if trace is not None:
                    started = self._traced(trace, step, started, transport.rank, ctx)
                step += 1

    def run_whole(self, transport: Transport, data: np.ndarray, header: bytes,
                  deadline: float, name: str, reduce: ReduceOp | None) -> None:
        """``run`` for a program with ``whole`` takes, on ``data`` (all of the buffer, in
        host memory): the same posts and takes without the general bookkeeping, where the
        smallest calls spend most of their time."""
        assert self.whole is not None, "run_whole needs a program of whole takes"
        transport.post(header, data, deadline, name)
        dtype, count = data.dtype, data.size
        for peer, reduces, final in self.whole:
            payload = transport.take(peer, header, dtype, count, deadline, name)
            if reduces:
                assert reduce is not None
                reduce.ufunc(data, payload, out=data)
                if final and reduce.divides:
                    finish_reduction(data, reduce, transport.world_size)
            else:
                np.copyto(data, payload)

    def _traced(self, trace: list[TraceEvent], index: int, started: float, rank: int,
                ctx: OpContext) -> float:
        now = time.perf_counter()
        trace.append(TraceEvent(rank, index, self.schedule.steps[index], started, now,
                                ctx.name, self.schedule.algorithm))
        return now


def board_header(desc: OpDescriptor, itemsize: int) -> bytes:
    """The header of the first post of the op ``desc`` describes, packed: the op's block as
    its size, and no sender (the slot says who posted), so that every rank posts the same
    bytes whatever each posts of the block, and a take compares them in one go."""
    return desc.outgoing(0, 0, 0, desc.count * itemsize).pack()


def run_board(
    program: BoardProgram,
    buffers: Mapping[str, Buffer],
    transport: Transport,
    ctx: OpContext,
    trace: list[TraceEvent] | None = None,
    header: bytes | None = None,
) -> None:
    """Execute a board schedule's ``program`` on ``buffers``; ``header`` is this rank's
    post's, packed (default: made from ``ctx``'s descriptor)."""
    schedule = program.schedule
    if header is None:
        header = board_header(ctx.desc, ctx.dtype.itemsize)
    used = [buffers[role] for role in program.roles]
    for buf in used:
        buf.before_op()
    try:
        program.run(transport, buffers, header, ctx, trace)
    except CommTimeout as err:
        raise _on_board(err, schedule, transport.rank, ctx.name) from None
    for buf in used:
        buf.after_op()


def run_board_whole(program: BoardProgram, data: np.ndarray, transport: Transport,
                    header: bytes, deadline: float, name: str,
                    reduce: ReduceOp | None) -> None:
    """``run_board`` for a program with ``whole`` takes on ``data``, host memory that needs
    no staging (``BoardProgram.run_whole``)."""
    try:
        program.run_whole(transport, data, header, deadline, name, reduce)
    except CommTimeout as err:
        raise _on_board(err, program.schedule, transport.rank, name) from None


def _on_board(err: CommTimeout, schedule: Schedule, rank: int, name: str) -> CommTimeout:
    """A board wait's timeout, saying which schedule ran out of time."""
    return CommTimeout(
        f"{err.detail} ({schedule.algorithm} {schedule.collective} on the shared board). "
        "Check that every rank runs this op, or raise the timeout.",
        rank=rank, op=name, peer=err.peer)


_PROGRAMS: dict[int, tuple[Schedule, BoardProgram]] = {}  # id(schedule) -> (it, its program)


def board_program(schedule: Schedule) -> BoardProgram:
    """The program of a board schedule, made once per schedule (the builders cache their
    schedules; looked up by identity, as hashing a schedule walks all its steps)."""
    entry = _PROGRAMS.get(id(schedule))
    if entry is None or entry[0] is not schedule:
        if len(_PROGRAMS) >= 1024:
            _PROGRAMS.clear()
        entry = _PROGRAMS[id(schedule)] = (schedule, BoardProgram(schedule))
    return entry[1]
