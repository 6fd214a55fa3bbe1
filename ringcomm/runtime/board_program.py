"""Running a board schedule: one post, then takes of the peers' posts.

A board op sends no message, so the link executor's machinery (pending sends, receive
order, per-peer message counts) has nothing to do; what is left is short enough that a
small op's whole time goes through here. ``BoardProgram`` boils a schedule down, once, to
what changes between its steps (which region this rank posts; which peer's post to take,
and whether to copy it into a region, reduce it into one, or only check its header; whether
that completes a reduction), and ``run`` does no more than that. The executor runs board
schedules through it, and so does the communicator's short way for a blocking allreduce.

Every region of a board schedule is the op's block (the element count every rank's header
carries) or empty, and a reduction is in place (``dst = dst (op) post``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from ..core.arrays import Buffer
from ..errors import CommTimeout
from ..schedules.schedule import Kind, Schedule
from ..transport.base import Transport
from .context import OpContext, TraceEvent

_COPY, _REDUCE, _CHECK = "copy", "reduce", "check"  # what a take does with a peer's post


class BoardProgram:
    """``schedule`` (one post, then takes), ready to run many times."""

    def __init__(self, schedule: Schedule) -> None:
        steps = schedule.steps
        if not schedule.on_board or steps[0].kind is not Kind.POST or any(
                s.kind is Kind.POST for s in steps[1:]):
            raise ValueError(f"{schedule.algorithm} {schedule.collective} is not a board "
                             "schedule (one post, then takes)")
        regions = [r for s in steps for r in (s.src, s.dst) if r is not None]
        count = max(r.count for r in regions)
        if any(r.count not in (0, count) for r in regions) or any(
                s.kind is Kind.TAKE_REDUCE and s.src != s.dst for s in steps):
            raise ValueError("every region of a board schedule is the op's block or empty, "
                             "and a reduction is in place")
        post = steps[0].src
        assert post is not None
        self.schedule = schedule
        self.count = count  # the op's block: every rank's header says so
        self.post = post if post.count else None  # what this rank gives, if anything
        self.takes = tuple(
            (s.peer, _CHECK if s.dst is None or not s.dst.count else
             _REDUCE if s.kind is Kind.TAKE_REDUCE else _COPY, s.final,
             s.dst.buf if s.dst is not None else "", s.dst.offset if s.dst is not None else 0)
            for s in steps[1:])
        self.roles = tuple(dict.fromkeys(r.buf for r in regions if r.count))  # buffers used

    def run(self, transport: Transport, buffers: Mapping[str, Buffer], header: bytes,
            ctx: OpContext, trace: list[TraceEvent] | None = None) -> None:
        """Post under ``header`` (this rank's, packed) what this rank gives, and take the
        peers' posts into ``buffers`` (by role; host memory, which ``region`` views)."""
        count, dtype, post = self.count, ctx.dtype, self.post
        started = time.perf_counter() if trace is not None else 0.0
        transport.post(header, buffers[post.buf].region(post.offset, count) if post else None,
                       ctx.deadline, ctx.name)
        if trace is not None:
            started = self._traced(trace, 0, started, transport.rank, ctx)
        for index, (peer, does, final, role, offset) in enumerate(self.takes, 1):
            payload = transport.take(peer, header, dtype, count, ctx.deadline, ctx.name)
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
                started = self._traced(trace, index, started, transport.rank, ctx)

    def _traced(self, trace: list[TraceEvent], index: int, started: float, rank: int,
                ctx: OpContext) -> float:
        now = time.perf_counter()
        trace.append(TraceEvent(rank, index, self.schedule.steps[index], started, now,
                                ctx.name, self.schedule.algorithm))
        return now


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
    if header is None:  # the op's whole block, whatever this rank posts of it
        rank = transport.rank
        header = ctx.desc.outgoing(rank, rank, 0, program.count * ctx.dtype.itemsize).pack()
    used = [buffers[role] for role in program.roles]
    for buf in used:
        buf.before_op()
    try:
        program.run(transport, buffers, header, ctx, trace)
    except CommTimeout as err:
        raise CommTimeout(
            f"{err.detail} ({schedule.algorithm} {schedule.collective} on the shared board). "
            "Check that every rank runs this op, or raise the timeout.",
            rank=transport.rank, op=ctx.name, peer=err.peer) from None
    for buf in used:
        buf.after_op()


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
