"""The link engine: runs one rank's schedule over the transport's links.

It walks the steps in order. Sends are queued and return at once, so while this rank
reduces segment ``k`` the link is already moving segment ``k + 1``; receives block until
their message arrives. Zero-copy sends leave the buffer in the link's hands until the
bytes are out, so before a step writes a region the executor waits for any pending send
that reads overlapping memory, and before the op returns it waits for all of them: the
caller may then reuse its buffers at once. Independent receives from several peers (an
all-to-all's blocks) are taken in the order their messages arrive.

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
from collections.abc import Iterator, Mapping

import numpy as np

from ..core.arrays import Buffer
from ..errors import CommError, CommTimeout
from ..schedules.schedule import Kind, Region, Schedule, Step
from ..transport.base import SendHandle, Transport
from ..transport.header import Header
from .base import Engine
from .context import OpContext
from .progress import over_links, timed_out, waited_for

__all__ = ["LinkEngine"]


class LinkEngine(Engine):
    """Schedules of messages between pairs of ranks, over ``transport``'s links."""

    name = "links"

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        """Execute ``schedule`` on ``buffers`` (of ``ctx.dtype``, keyed by role)."""
        _run(schedule, buffers, self.transport, ctx)

    def describe(self) -> str:
        kinds = sorted({link.kind for link in self.transport.links if link is not None})
        return f"links ({', '.join(kinds) or 'none'})"


class _PendingSends:
    """Zero-copy sends not yet out of our memory, with the byte ranges they read and the peer
    they go to. Waiting on one goes through the transport, so that a dead peer or an abort
    from another rank ends the wait instead of the op's timeout. ``stalled`` says that such
    a wait failed (so the step it held up never started its receive)."""

    stalled = False  # set on the instance only when a wait fails

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
            try:
                self._transport.wait_sent(peer, handle, self._ctx.deadline, self._ctx.name)
            except CommError:
                self.stalled = True
                raise


def _run(
    schedule: Schedule,
    buffers: Mapping[str, Buffer],
    transport: Transport,
    ctx: OpContext,
) -> None:
    if schedule.on_board:
        raise ValueError(f"{schedule.algorithm} {schedule.collective} is a board schedule: "
                         "the board engine runs it")
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
    observe = ctx.observe
    for index in _step_order(steps, runs, transport) if runs else range(len(steps)):
        step = steps[index]
        started = time.perf_counter() if observe is not None else 0.0
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
        except CommError as err:  # where the op stood goes with the error (the hang report)
            progress = over_links(schedule, index,
                                  waited_for(err, -1 if kind is Kind.SEND else peer), sent,
                                  received, itemsize, receiving=not pending.stalled)
            if not isinstance(err, CommTimeout):
                err.progress = progress
                raise
            raise timed_out(err, progress, f"; the step was: {step.describe()} (step {index} "
                            f"of {len(steps)} of {schedule.algorithm} {schedule.collective})",
                            rank, ctx.name) from None
        if observe is not None:
            observe(index, step, started, time.perf_counter())
    try:
        pending.wait_all()
        if transport.checks_delivery:
            for peer, count in enumerate(sent):
                if count:
                    transport.check_delivered(peer, ctx.name)
    except CommError as err:
        progress = over_links(schedule, len(steps), waited_for(err, -1), sent, received,
                              itemsize, receiving=False)
        if not isinstance(err, CommTimeout):
            err.progress = progress
            raise
        raise timed_out(err, progress, f" (the last sends of {schedule.algorithm} "
                        f"{schedule.collective})", rank, ctx.name) from None
    for buf in buffers.values():
        buf.after_op()


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
