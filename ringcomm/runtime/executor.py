"""The executor: runs one rank's schedule over a transport.

It walks the steps in order. Sends are queued and return at once, so while this rank
reduces segment ``k`` the link is already moving segment ``k + 1``; receives block until
their message arrives. Zero-copy sends leave the buffer in the link's hands until the
bytes are out, so before a step writes a region the executor waits for any pending send
that reads overlapping memory, and before the op returns it waits for all of them: the
caller may then reuse its buffers at once. Independent receives from several peers (an
all-to-all's blocks) are taken in the order their messages arrive.

Board steps (ranks of one host) post a region on the transport's shared board and take
peers' posts from it, in place: the header of a post is checked like a message's.

A fused receive-reduce-send asks the transport for the outgoing buffer first (shared
memory, where it has some) and reduces into it, so a partial sum is written once instead of
being written here and then copied out.

Every message gets a header built from the op's descriptor (collective, sequence number,
algorithm, dtype, reduce op, root, segment size, the pair's element count) that the
receiver checks against its own, and every receive runs against the op's one deadline.

Buffers are ``ringcomm.core.arrays.Buffer`` objects: the executor sends from and receives
into their host regions, copies and reduces through them, and calls their hooks before the
first step and after the last send is out, so it never asks what kind of array is behind
one (host memory, or a device array staged through the host).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..core.arrays import Buffer
from ..core.dtypes import ReduceOp
from ..errors import CommTimeout
from ..schedules.schedule import Kind, Region, Schedule, Step
from ..transport.base import SendHandle, Transport
from ..transport.header import Header, OpDescriptor


@dataclass(slots=True)  # made once per op
class OpContext:
    """One op as it runs: its descriptor (what goes into every header), its name for
    errors, its buffers' dtype and reduction, and its deadline."""

    desc: OpDescriptor
    name: str
    dtype: np.dtype
    deadline: float
    reduce: ReduceOp | None = None


@dataclass(slots=True)
class TraceEvent:
    """One executed step, for timelines: when it started and ended (``time.perf_counter``),
    in which op, run by which algorithm (so a trace shows every automatic choice)."""

    rank: int
    index: int
    step: Step
    start: float
    end: float
    op: str = ""
    algorithm: str = ""


class _PendingSends:
    """Zero-copy sends not yet out of our memory, with the byte ranges they read and the peer
    they go to. Waiting on one goes through the transport, so that a dead peer or an abort
    from another rank ends the wait instead of the op's timeout."""

    def __init__(self, transport: Transport, ctx: OpContext) -> None:
        self._items: deque[tuple[int, int, int, SendHandle]] = deque()
        self._transport = transport
        self._ctx = ctx

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, lo: int, hi: int, peer: int, handle: SendHandle) -> None:
        self._items.append((lo, hi, peer, handle))

    def wait_overlapping(self, lo: int, hi: int) -> None:
        items = self._items
        while items and items[0][3].done:
            items.popleft()
        for plo, phi, peer, handle in items:
            if plo < hi and lo < phi:
                self._wait(peer, handle)

    def wait_all(self) -> None:
        while self._items:
            _, _, peer, handle = self._items.popleft()
            self._wait(peer, handle)

    def _wait(self, peer: int, handle: SendHandle) -> None:
        if not handle.done:
            self._transport.wait_sent(peer, handle, self._ctx.deadline, self._ctx.name)


def run_schedule(
    schedule: Schedule,
    buffers: dict[str, Buffer],
    transport: Transport,
    ctx: OpContext,
    trace: list[TraceEvent] | None = None,
) -> None:
    """Execute ``schedule`` on ``buffers`` (of ``ctx.dtype``, keyed by role)."""
    if schedule.on_board:
        program = board_program(schedule)
        run_board(program, buffers[program.buffer], transport, ctx, trace)
        return
    rank, world = transport.rank, transport.world_size
    itemsize = ctx.dtype.itemsize
    desc = ctx.desc
    for buf in buffers.values():
        buf.before_op()
    addresses: dict[str, int] = {}  # read when first needed: reading one takes a microsecond
    sent = [0] * world
    received = [0] * world
    pending = _PendingSends(transport, ctx)

    def view(region: Region) -> np.ndarray:
        return buffers[region.buf].region(region.offset, region.count)

    def start(region: Region) -> int:
        """The address of the region's first byte."""
        base = addresses.get(region.buf)
        if base is None:
            base = addresses[region.buf] = buffers[region.buf].address
        return base + region.offset * itemsize

    def claim(region: Region) -> np.ndarray:
        """The region's view, once no pending send still reads its memory."""
        if pending:
            lo = start(region)
            pending.wait_overlapping(lo, lo + region.count * itemsize)
        return view(region)

    def track(handle: SendHandle | None, region: Region, peer: int) -> None:
        """Keep a send's handle until it is out; it blocks writes to ``region`` meanwhile
        if it still reads it."""
        if handle is not None:
            lo = start(region)
            hi = lo + region.count * itemsize if handle.reads_buffer else lo
            pending.add(lo, hi, peer, handle)

    def expect(peer: int, count: int) -> Header:
        header = desc.incoming(peer, received[peer], count * itemsize)
        received[peer] += 1
        return header

    steps, runs = schedule.steps, schedule.receive_runs
    for index in _step_order(steps, runs, transport) if runs else range(len(steps)):
        step = steps[index]
        started = time.perf_counter() if trace is not None else 0.0
        kind, peer, src, dst = step.kind, step.peer, step.src, step.dst
        try:
            if kind is Kind.SEND:
                assert src is not None
                header = desc.outgoing(peer, rank, sent[peer], src.count * itemsize)
                sent[peer] += 1
                track(transport.send(peer, header, view(src) if src.count else None, ctx.name),
                      src, peer)
            elif kind is Kind.RECV:
                assert dst is not None
                into = claim(dst)
                transport.recv_into(peer, expect(peer, dst.count), into, ctx.deadline, ctx.name)
            elif kind is Kind.RECV_REDUCE:
                assert src is not None and dst is not None and ctx.reduce is not None
                into = claim(dst)
                payload = transport.recv(peer, expect(peer, dst.count), ctx.deadline,
                                         ctx.name)
                buffers[dst.buf].reduce_into(into, view(src), payload, ctx.reduce,
                                             world if step.final else 1)
                transport.release(peer)
            elif kind is Kind.RECV_REDUCE_SEND:
                assert src is not None and dst is not None and ctx.reduce is not None
                payload = transport.recv(peer, expect(peer, dst.count), ctx.deadline,
                                         ctx.name)
                to, nbytes = step.to, src.count * itemsize
                header = desc.outgoing(to, rank, sent[to], nbytes)
                sent[to] += 1
                slot = transport.reserve(to, nbytes)
                target = buffers[dst.buf]
                if slot is not None:  # the sum goes straight into the outgoing message
                    target.reduce_into(slot.view(ctx.dtype), view(src), payload, ctx.reduce)
                    transport.release(peer)
                    track(transport.send_reserved(to, header, ctx.name), dst, to)
                else:
                    into = claim(dst)
                    target.reduce_into(into, view(src), payload, ctx.reduce)
                    transport.release(peer)
                    track(transport.send(to, header, into, ctx.name), dst, to)
            else:
                assert kind is Kind.COPY and src is not None and dst is not None
                buffers[dst.buf].copy(claim(dst), view(src))
        except CommTimeout as err:
            raise CommTimeout(
                f"{err.detail}; the step was: {step.describe()} "
                f"(step {index} of {len(steps)} of {schedule.algorithm} "
                f"{schedule.collective}). Check that every rank runs this op, or raise the "
                "timeout.",
                rank=rank, op=ctx.name, peer=err.peer,
            ) from None
        if trace is not None:
            trace.append(TraceEvent(rank, index, step, started, time.perf_counter(), ctx.name,
                                    schedule.algorithm))
    try:
        pending.wait_all()
        if transport.checks_delivery:
            for peer, count in enumerate(sent):
                if count:
                    transport.check_delivered(peer, ctx.name)
    except CommTimeout as err:
        raise CommTimeout(
            f"{err.detail} (the last sends of {schedule.algorithm} {schedule.collective}). "
            "Check that every rank runs this op, or raise the timeout.",
            rank=rank, op=ctx.name, peer=err.peer,
        ) from None
    for buf in buffers.values():
        buf.after_op()


_COPY, _REDUCE, _CHECK = "copy", "reduce", "check"  # what a take does with a peer's post


class BoardProgram:
    """A board schedule made ready to run many times: its steps boiled down to what changes
    between them (whether this rank's post carries its values; which peer's post to take,
    and whether to copy it in, reduce it in, or only check its header; whether that
    completes the reduction). A small op's whole time goes through ``run``, so it does no
    more than that: it is the whole of a board op, for the executor and for the
    communicator's short way alike."""

    def __init__(self, schedule: Schedule) -> None:
        steps = schedule.steps
        if not schedule.on_board or steps[0].kind is not Kind.POST or any(
                s.kind is Kind.POST for s in steps[1:]):
            raise ValueError(f"{schedule.algorithm} {schedule.collective} is not a board "
                             "schedule (one post, then takes)")
        regions = [r for s in steps for r in (s.src, s.dst) if r is not None]
        count = max(r.count for r in regions)
        if any(r.buf != regions[0].buf or r.offset != 0 or r.count not in (0, count)
               for r in regions):
            raise ValueError("a board schedule works on one whole buffer (or none of it)")
        self.schedule = schedule
        self.buffer = regions[0].buf  # the role of the one buffer it reads and writes
        self.count = count  # the op's elements: every rank's header says so
        post = steps[0].src
        assert post is not None
        self.posts_values = post.count > 0
        self.takes = tuple(
            (s.peer, _CHECK if s.dst is None or not s.dst.count else
             _REDUCE if s.kind is Kind.TAKE_REDUCE else _COPY, s.final) for s in steps[1:])

    def run(self, transport: Transport, buffer: Buffer, header: bytes, ctx: OpContext,
            trace: list[TraceEvent] | None = None) -> None:
        """Post under ``header`` (this rank's, packed) ``buffer``'s values, where this rank
        has values to give, and take the peers' posts into it. ``buffer`` holds host memory
        (``region`` views it)."""
        count, dtype = self.count, ctx.dtype
        data = buffer.region(0, count)
        started = time.perf_counter() if trace is not None else 0.0
        transport.post(header, data if self.posts_values else None, ctx.deadline, ctx.name)
        if trace is not None:
            started = self._traced(trace, 0, started, transport.rank, ctx)
        for index, (peer, does, final) in enumerate(self.takes, 1):
            payload = transport.take(peer, header, dtype, count, ctx.deadline, ctx.name)
            if does is _REDUCE:
                assert ctx.reduce is not None
                buffer.reduce_into(data, data, payload, ctx.reduce,
                                   transport.world_size if final else 1)
            elif does is _COPY:
                buffer.copy(data, payload)
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
    buffer: Buffer,
    transport: Transport,
    ctx: OpContext,
    trace: list[TraceEvent] | None = None,
    header: bytes | None = None,
) -> None:
    """Execute a board schedule's ``program`` on ``buffer``; ``header`` is this rank's
    post's, packed (default: made from ``ctx``'s descriptor)."""
    schedule = program.schedule
    if header is None:  # the op's whole vector, whatever this rank posts of it
        rank = transport.rank
        header = ctx.desc.outgoing(rank, rank, 0, program.count * ctx.dtype.itemsize).pack()
    buffer.before_op()
    try:
        program.run(transport, buffer, header, ctx, trace)
    except CommTimeout as err:
        raise CommTimeout(
            f"{err.detail} ({schedule.algorithm} {schedule.collective} on the shared board). "
            "Check that every rank runs this op, or raise the timeout.",
            rank=transport.rank, op=ctx.name, peer=err.peer) from None
    buffer.after_op()


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


def _step_order(steps: tuple[Step, ...], runs: dict[int, int],
                transport: Transport) -> Iterator[int]:
    """Step indices in the order to run them: schedule order, except that within a run of
    independent receives (``Schedule.receive_runs``) the next one taken is from a peer whose
    message is already here, each peer's receives kept in their order. When none is here
    it waits in schedule order, as without runs. Consumed lazily, so every choice sees
    what arrived while the previous step ran."""
    index = 0
    while index < len(steps):
        end = runs.get(index)
        if end is None:
            yield index
            index += 1
            continue
        by_peer: dict[int, deque[int]] = {}
        for i in range(index, end):
            by_peer.setdefault(steps[i].peer, deque()).append(i)
        while by_peer:
            first = min(by_peer, key=lambda p: by_peer[p][0])
            others = (p for p in by_peer if p != first)
            peer = next((p for p in (first, *others) if transport.ready(p)), first)
            queue = by_peer[peer]
            yield queue.popleft()
            if not queue:
                del by_peer[peer]
        index = end
