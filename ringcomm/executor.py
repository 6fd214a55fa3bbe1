"""The executor: runs one rank's schedule over a transport.

It walks the steps in order. Sends are queued and return at once, so while this rank
reduces segment ``k`` the channel is already moving segment ``k + 1``; receives block until
their message arrives. Zero-copy sends leave the buffer in the channel's hands until the
bytes are out, so before a step writes a region the executor waits for any pending send
that reads overlapping memory, and before the op returns it waits for all of them: the
caller may then reuse its buffers at once.

Every message gets a header (op, sequence number, dtype, size, index) that the receiver
checks, and every receive runs against the op's one deadline.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from .algorithms.schedule import Kind, Region, Schedule, Step
from .buffers import ReduceOp, dtype_code, finish_reduction, reduce_into
from .channels.base import SendHandle, Transport
from .channels.header import Header
from .errors import CommTimeout


@dataclass
class OpContext:
    """What identifies one op on the wire, and how long it may take."""

    kind: int
    seq: int
    name: str
    dtype: np.dtype
    deadline: float
    reduce: ReduceOp | None = None
    arg: int = -1


@dataclass(slots=True)
class TraceEvent:
    """One executed step, for timelines: when it started and ended (``time.perf_counter``)."""

    rank: int
    index: int
    step: Step
    start: float
    end: float


class _PendingSends:
    """Zero-copy sends not yet out of our memory, with the byte ranges they read."""

    def __init__(self) -> None:
        self._items: deque[tuple[int, int, SendHandle]] = deque()

    def add(self, lo: int, hi: int, handle: SendHandle) -> None:
        self._items.append((lo, hi, handle))

    def wait_overlapping(self, lo: int, hi: int, deadline: float) -> None:
        items = self._items
        while items and items[0][2].done:
            items.popleft()
        for plo, phi, handle in items:
            if plo < hi and lo < phi:
                _wait(handle, deadline)

    def wait_all(self, deadline: float) -> None:
        while self._items:
            _wait(self._items.popleft()[2], deadline)


def _wait(handle: SendHandle, deadline: float) -> None:
    if not handle.done and not handle.wait(max(0.0, deadline - time.monotonic())):
        raise CommTimeout("a send did not leave this process in time (is the peer alive?)")


def run_schedule(
    schedule: Schedule,
    buffers: dict[str, np.ndarray],
    transport: Transport,
    ctx: OpContext,
    trace: list[TraceEvent] | None = None,
) -> None:
    """Execute ``schedule`` on ``buffers`` (flat arrays of ``ctx.dtype`` keyed by role)."""
    rank, world = transport.rank, transport.world_size
    itemsize = ctx.dtype.itemsize
    code = dtype_code(ctx.dtype)
    addresses = {name: arr.ctypes.data for name, arr in buffers.items()}
    sent = [0] * world
    received = [0] * world
    pending = _PendingSends()

    def view(region: Region) -> np.ndarray:
        return buffers[region.buf][region.offset: region.offset + region.count]

    def claim(region: Region) -> np.ndarray:
        """The region's view, once no pending send still reads its memory."""
        lo = addresses[region.buf] + region.offset * itemsize
        pending.wait_overlapping(lo, lo + region.count * itemsize, ctx.deadline)
        return view(region)

    def expect(peer: int, count: int) -> Header:
        header = Header(ctx.seq, count * itemsize, peer, received[peer], ctx.arg, ctx.kind, code)
        received[peer] += 1
        return header

    for index, step in enumerate(schedule.steps):
        started = time.perf_counter() if trace is not None else 0.0
        kind, peer = step.kind, step.peer
        try:
            if kind is Kind.SEND:
                src = step.src
                header = Header(ctx.seq, src.count * itemsize, rank, sent[peer], ctx.arg,
                                ctx.kind, code)
                sent[peer] += 1
                handle = transport.send(peer, header, view(src) if src.count else None)
                if handle is not None:
                    lo = addresses[src.buf] + src.offset * itemsize
                    pending.add(lo, lo + src.count * itemsize, handle)
            elif kind is Kind.RECV:
                dst = claim(step.dst)
                transport.recv_into(peer, expect(peer, step.dst.count), dst, ctx.deadline,
                                    ctx.name)
            elif kind is Kind.RECV_REDUCE:
                dst = claim(step.dst)
                payload = transport.recv(peer, expect(peer, step.dst.count), ctx.deadline,
                                         ctx.name)
                reduce_into(dst, view(step.src), payload, ctx.reduce)
                if step.final:
                    finish_reduction(dst, ctx.reduce, world)
            else:
                np.copyto(claim(step.dst), view(step.src))
        except CommTimeout as err:
            raise CommTimeout(
                f"{err.detail}; the step was: {step.describe()} "
                f"(step {index} of {len(schedule.steps)} of {schedule.algorithm} "
                f"{schedule.collective}). Check that every rank runs this op, or raise the "
                "timeout.",
                rank=rank, op=ctx.name, peer=err.peer,
            ) from None
        if trace is not None:
            trace.append(TraceEvent(rank, index, step, started, time.perf_counter()))
    pending.wait_all(ctx.deadline)
