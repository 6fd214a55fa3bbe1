"""The board engine: runs board schedules (posts, each followed by takes of the peers'
posts) on a group's shared board (``ringcomm.transport.board_channel``).

A board op sends no message, so the link engine's machinery (pending sends, receive order,
per-peer message counts) has nothing to do; what is left is short enough that a small op's
whole time goes through here. ``BoardProgram`` boils a schedule down, once, to what changes
between its steps (which region this rank posts; which peer's post to take, from which
element, and whether to copy it into a region, reduce it into one, or only check its
header; whether that completes a reduction), and ``run`` does no more than that.

The engine has a fast entry for the commonest call, a blocking allreduce
(``BoardEngine.allreduce_now``): its plan (program, packed header, reduction) is made once
per dtype, size and op (``plan_allreduce``), and the one-shot allreduce on host memory is
one call of the channel (``BoardChannel.round_whole``: the same post and takes, which the
board runs in one go, reading its memory directly; a wrapped channel through its own posts
and takes). The fast entry is part of the engine, so a wrapper in front of the engine sees
it as it sees ``run``; a run whose steps are observed (a timeline) takes the general
runner.

Every post of an op carries the op's header with the post's number within the op as its
``index``, so that ranks whose posts do not line up find out at the first take. A reduction
is in place (``dst = dst (op) post``). An op that fails after it posted withdraws its latest
post (``BoardChannel.withdraw``): a peer that enters the op later finds its part already
there, and must raise rather than complete an op this rank failed.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import CodeType

from ..core.arrays import Buffer, HostBuffer
from ..core.dtypes import ReduceOp
from ..errors import CommError, CommTimeout
from ..schedules.schedule import Kind, Region, Schedule
from ..transport.board import COPY, FOLD, FOLD_BEFORE, Board, WholeTake
from ..transport.board_channel import BoardChannel
from ..transport.header import OpDescriptor
from .base import Engine
from .context import OpContext, StepObserver
from .progress import OpProgress, frame_local, in_order, waited_for

# What a take does with a peer's post: copy it, fold it in after this rank's data or before
# it (``_REDUCE_BEFORE``: the peer's rank comes before every rank the data holds so far, as
# for rank 1's first fold, of rank 0's post: the parts are folded in rank order on every
# rank, which gives every rank the same bits), or only check its header.
_COPY, _REDUCE, _REDUCE_BEFORE, _CHECK = "copy", "reduce", "reduce before", "check"
_WHOLE = {_COPY: COPY, _REDUCE: FOLD, _REDUCE_BEFORE: FOLD_BEFORE}
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
        taken: set[Region] = set()  # regions a take has written: they hold a peer's part
        for step in steps:
            if step.kind is Kind.POST:
                assert step.src is not None
                rounds.append((step.src if step.src.count else None, step.at, ()))
                continue
            dst = step.dst
            does = _CHECK if dst is None or not dst.count else \
                _REDUCE if step.kind is Kind.TAKE_REDUCE else _COPY
            if does is _REDUCE and dst is not None and step.peer < schedule.rank \
                    and dst not in taken:
                assert not any(_overlap(dst, region) for region in taken), \
                    "a fold into part of a region a take wrote: which rank's part comes first?"
                does = _REDUCE_BEFORE  # the data holds this rank's part alone
            if dst is not None and does is not _CHECK:
                taken.add(dst)
            take = (step.peer, does, step.final, dst.buf if dst is not None else "",
                    dst.offset if dst is not None else 0, dst.count if dst is not None else 0,
                    step.at)
            post, at, takes = rounds[-1]
            rounds[-1] = (post, at, (*takes, take))
        self.rounds = tuple(rounds)
        self.roles = tuple(dict.fromkeys(r.buf for r in regions if r.count))  # buffers used
        # one post of a whole buffer whose takes copy or reduce all of it (the one-shot
        # allreduce): (peer, reduces, final) per take, for ``BoardChannel.round_whole``
        post, place, takes = rounds[0]
        self.whole: tuple[WholeTake, ...] | None = None
        if len(rounds) == 1 and post is not None and not post.offset and not place and all(
                does is not _CHECK and (role, offset, count, at) == (post.buf, 0, post.count, 0)
                for _, does, _, role, offset, count, at in takes):
            self.whole = tuple((peer, _WHOLE[does], final) for peer, does, final, *_ in takes)

    def run(self, channel: BoardChannel, buffers: Mapping[str, Buffer], header: bytes,
            ctx: OpContext) -> None:
        """Make this rank's posts (``header``, packed, is its first's; the later ones differ
        in their ``index``) and take the peers' posts into ``buffers`` (by role; host
        memory, which ``region`` views)."""
        dtype, deadline, name, observe = ctx.dtype, ctx.deadline, ctx.name, ctx.observe
        started = time.perf_counter() if observe is not None else 0.0
        step = 0
        for number, (post, place, takes) in enumerate(self.rounds):
            if number:
                header = header[:_INDEX.start] + _U32.pack(number) + header[_INDEX.stop:]
            channel.post(header, buffers[post.buf].region(post.offset, post.count)
                         if post is not None else None, deadline, name, place)
            if observe is not None:
                started = self._observed(observe, step, started)
            step += 1
            for peer, does, final, role, offset, count, at in takes:
                payload = channel.take(peer, header, dtype, count, deadline, name, at)
                if does is not _CHECK:
                    target = buffers[role]
                    into = target.region(offset, count)
                    if does is _REDUCE:
                        assert ctx.reduce is not None
                        target.reduce_into(into, into, payload, ctx.reduce,
                                           channel.world_size if final else 1)
                    elif does is _REDUCE_BEFORE:
                        assert ctx.reduce is not None
                        target.reduce_into(into, payload, into, ctx.reduce,
                                           channel.world_size if final else 1)
                    else:
                        target.copy(into, payload)
                if observe is not None:
                    started = self._observed(observe, step, started)
                step += 1

    def _observed(self, observe: StepObserver, index: int, started: float) -> float:
        now = time.perf_counter()
        observe(index, self.schedule.steps[index], started, now)
        return now


def _overlap(a: Region, b: Region) -> bool:
    """Whether regions ``a`` and ``b`` share an element."""
    return a.buf == b.buf and a.offset < b.offset + b.count and b.offset < a.offset + a.count


def board_header(desc: OpDescriptor, itemsize: int) -> bytes:
    """The header of the first post of the op ``desc`` describes, packed: the op's block as
    its size, and no sender (the slot says who posted), so that every rank posts the same
    bytes whatever each posts of the block, and a take compares them in one go."""
    return desc.outgoing(0, 0, 0, desc.count * itemsize).pack()


def run_board(
    program: BoardProgram,
    buffers: Mapping[str, Buffer],
    channel: BoardChannel,
    ctx: OpContext,
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
    since = channel.posts
    try:
        program.run(channel, buffers, header, ctx)
    except BaseException as err:
        channel.withdraw(since)
        if not isinstance(err, CommError):
            raise
        err.progress = _stood(err, program, (BoardProgram.run.__code__,), ctx.dtype.itemsize)
        if isinstance(err, CommTimeout):
            raise _on_board(err, schedule, channel.rank, ctx.name) from None
        raise
    for buf in used:
        buf.after_op()


def _on_board(err: CommTimeout, schedule: Schedule, rank: int, name: str) -> CommTimeout:
    """A board wait's timeout, saying which schedule ran out of time (and where it stood)."""
    timeout = CommTimeout(
        f"{err.detail} ({schedule.algorithm} {schedule.collective} on the shared board). "
        "Check that every rank runs this op, or raise the timeout.",
        rank=rank, op=name, peer=err.peer)
    timeout.progress = err.progress
    return timeout


_ROUNDS = (Board.round_whole.__code__, BoardChannel.round_whole.__code__)


def _stood(err: CommError, program: BoardProgram, runners: tuple[CodeType, ...],
           itemsize: int) -> OpProgress | None:
    """Where ``program`` stood when ``err`` left the first of ``runners`` it passed through
    (the code of ``BoardProgram.run``, or of the whole round's), for the hang report: the
    step it was on is that frame's ``step``, read on the way out, so the runners' loops
    carry no bookkeeping for it (unbound: it failed at its first post, step 0)."""
    step = None
    for runner in runners:
        step = frame_local(err, runner, "step")
        if step is not None:
            break
    return in_order("board", program.schedule, step if isinstance(step, int) else 0,
                    waited_for(err, -1), itemsize)


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


_SEQ = struct.Struct("<Q")  # a header's first field


@dataclass(frozen=True, slots=True)
class AllreducePlan:
    """A blocking allreduce on the board, ready to run again: everything about it but the
    buffer and the sequence number (``BoardEngine.allreduce_now``)."""

    program: BoardProgram
    reduce: ReduceOp
    desc: OpDescriptor  # of sequence number 0
    header: bytes  # the post's, packed, for sequence number 0
    after_seq: bytes = field(init=False)  # the header but its first field

    def __post_init__(self) -> None:
        object.__setattr__(self, "after_seq", self.header[_SEQ.size:])

    def header_of(self, seq: int) -> bytes:
        return _SEQ.pack(seq) + self.after_seq


class BoardEngine(Engine):
    """Board schedules on ``channel``, this rank's view of its group's shared board."""

    name = "board"

    def __init__(self, channel: BoardChannel) -> None:
        self.channel = channel

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        run_board(board_program(schedule), buffers, self.channel, ctx)

    def plan_allreduce(self, schedule: Schedule, desc: OpDescriptor, reduce: ReduceOp,
                       itemsize: int) -> AllreducePlan:
        """The plan of a blocking allreduce whose schedule (a board one) and descriptor (of
        sequence number 0) are these, for ``allreduce_now``."""
        return AllreducePlan(board_program(schedule), reduce, desc, board_header(desc, itemsize))

    def allreduce_now(self, plan: AllreducePlan, data: Buffer, seq: int, deadline: float,
                      name: str, observe: StepObserver | None = None) -> None:
        """Run ``plan`` on ``data`` as op number ``seq``, on this thread, start to end."""
        program, channel = plan.program, self.channel
        if program.whole is not None and observe is None and type(data) is HostBuffer:
            since = channel.posts
            try:
                channel.round_whole(_SEQ.pack(seq) + plan.after_seq, data.whole,
                                    program.whole, plan.reduce, deadline, name)
                return
            except BaseException as err:
                channel.withdraw(since)
                if not isinstance(err, CommError):
                    raise
                err.progress = _stood(err, program, _ROUNDS, data.dtype.itemsize)
                if isinstance(err, CommTimeout):
                    raise _on_board(err, program.schedule, channel.rank, name) from None
                raise
        run_board(program, {"data": data}, self.channel,
                  OpContext(plan.desc, name, data.dtype, deadline, plan.reduce, observe),
                  header=plan.header_of(seq))

    def describe(self) -> str:
        return self.channel.describe()
