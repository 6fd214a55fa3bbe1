"""The device engine: runs one rank's schedule on device memory, over one device channel.

It walks a schedule's steps in order as the link engine does (``ringcomm.engines.links``):
the same messages, numbered and headed the same way, so a rank that disagrees about an op
gets a ``DesyncError`` and a timed-out op leaves the same hang report. What differs is where
the bytes are: buffers are device memory (``ringcomm.core.arrays.DeviceBuffer``), every copy
and reduction is queued on the engine's own stream, and how a message reaches its peer is
the channel's (``DeviceChannel``: CUDA IPC on one host, host staging anywhere).

Stream order, as torch's NCCL process group keeps it: before the first step the engine's
stream waits on every buffer's ``producer`` (an event recorded on the caller's stream when
the op was issued), so the op reads what the caller wrote; after the last step it records a
done event and makes every buffer's ``caller_stream`` wait on it, so the caller's later work
reads the result. The host never blocks on the device for that: a caller that reads the
result on its own stream is ordered after the op.

Scratch (a tree's partial sums) is device memory from ``runtime.malloc``, kept per engine
and grown to the largest need; a buffer in host memory handed to a device op (a numpy array
beside a device one) is copied to device scratch first and back afterwards if the op writes
it. Both are given back at ``close``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np

from ..core.arrays import HOST, Buffer, DeviceBuffer, keep_until_done
from ..core.device.runtime import Allocation, DeviceRuntime, Stream
from ..errors import CommError, CommTimeout, PeerLostError
from ..schedules.schedule import Kind, Schedule
from ..transport.base import Transport
from ..transport.link import Wait
from .base import Engine
from .context import OpContext
from .device_channel import DeviceChannel
from .progress import over_links, timed_out, waited_for

__all__ = ["DeviceEngine", "DeviceLane", "LaneOwner", "held", "stage_in", "stage_out"]

log = logging.getLogger("ringcomm")


class LaneOwner(Protocol):
    """What a lane runs over and closes last: a device channel (``DeviceChannel``), or an
    NCCL communicator (``ringcomm.engines.nccl.NcclChannel``)."""

    name: str
    runtime: DeviceRuntime

    def close(self, *, failed: bool = False) -> None: ...

    def abandon(self) -> None: ...

    def describe(self) -> str: ...


class DeviceLane:
    """What a device engine keeps between ops, made once per channel when the group is set
    up (engines are made again whenever wrappers change): the channel, the stream every op
    runs on, and device scratch by use (``"scratch"``, a lifted host
    buffer's role), one allocation each, grown to the largest need. Ops run one at a time
    on the one stream, so one allocation per use serves them all."""

    def __init__(self, channel: LaneOwner) -> None:
        self.channel = channel
        self.runtime = runtime = channel.runtime
        # the rank's device: its ops run with it current, on whichever thread (the worker's
        # starts on device 0, and CUDA launches kernels and records events only on streams
        # of the current device)
        self.device = runtime.current_device()
        self.stream = runtime.new_stream()
        self._held: dict[str, Allocation] = {}
        self._failed_ops: list[Any] = []  # what failed ops' queued work may still use
        self.ops = 0  # ops that ran to their end here: which engine really ran a call

    def scratch(self, use: str, nbytes: int) -> int:
        """A device pointer to at least ``nbytes`` bytes kept for ``use`` (a smaller one
        is freed: ``free`` waits for the work queued on it; cudaFree waits for the whole
        device, once per growth)."""
        held = self._held.get(use)
        if held is None or held.nbytes < nbytes:
            if held is not None:
                self.runtime.free(held)
                del self._held[use]
            held = self._held[use] = self.runtime.malloc(max(nbytes, 1))
        return held.ptr

    def keep_after_failure(self, *objects: Any) -> None:
        """Keep what a failed op's queued work may still read or write (the caller's arrays,
        host memory lifted to the device) until the lane closes: a failed op records no
        done event to wait on, and its stream may wait for a lost peer for ever."""
        self._failed_ops.extend(objects)

    def settles(self, seconds: float) -> bool:
        """Whether the work queued on the lane's stream finishes within ``seconds``: after a
        failure it may wait for a lost peer's event that never comes."""
        with on_device(self.runtime, self.device):
            return _settles(self.runtime, self.stream, seconds)

    def close(self, settled: bool = True, *, failed: bool = False) -> None:
        """Give the scratch back, then close the channel (its memory, mappings and
        registrations, in the safe order). ``settled=False`` (device work still waits, for a
        lost peer, here or on another lane): nothing is freed or unregistered, since a free
        waits for the device (cudaFree waits for every stream of it) and would wait for
        ever; the scratch and the channel's own staging stay allocated to the process's
        end, and the channel is told only to let its peers go."""
        runtime = self.runtime
        with on_device(runtime, self.device):
            self._close(settled, failed)

    def _close(self, settled: bool, failed: bool) -> None:
        runtime = self.runtime
        try:
            if settled:  # free waits for the queued work that uses it
                for held in self._held.values():
                    runtime.free(held)
                self._failed_ops.clear()
            else:  # the scratch and what failed ops used stay referenced, never reused
                log.warning("device work of the %s engine still waits (for a lost peer?): its "
                            "device memory stays allocated until the process ends",
                            self.channel.name)
                _ABANDONED.append((list(self._held.values()), self._failed_ops))
            self._held.clear()
        finally:
            if settled:
                self.channel.close(failed=failed)
            else:
                self.channel.abandon()


# what lanes closed with device work still waiting (for a lost peer) left behind: kept
# referenced to the process's end, so no allocator hands that memory out again
_ABANDONED: list[tuple[list[Allocation], list[Any]]] = []


def _settles(runtime: DeviceRuntime, stream: Stream, seconds: float) -> bool:
    """Whether the work queued on ``stream`` finishes within ``seconds`` (polled, never a
    blocking wait, which could last for ever)."""
    mark = runtime.new_event()
    runtime.record(mark, stream)
    give_up = time.monotonic() + seconds
    while not runtime.event_done(mark):
        if time.monotonic() > give_up:
            return False
        time.sleep(0.001)
    return True


class DeviceEngine(Engine):
    """Schedules of messages between pairs of ranks on device memory, over ``channel``
    (its name is the channel's: ``cuda-ipc``, ``staged``)."""

    def __init__(self, lane: DeviceLane, rank: int, world_size: int) -> None:
        assert isinstance(lane.channel, DeviceChannel), f"{lane.channel.name} is no channel"
        self.lane = lane
        self.channel = lane.channel
        self.name = lane.channel.name
        self.runtime = lane.runtime
        self.moves = frozenset({lane.runtime.memory})
        self.rank = rank
        self.world_size = world_size

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        """Execute ``schedule`` on ``buffers`` (device buffers of ``ctx.dtype`` by role; a
        host one is lifted to device scratch), ordered on the engine's stream."""
        if schedule.on_board:
            raise ValueError(f"{schedule.algorithm} {schedule.collective} is a board schedule: "
                             "the board engine runs it")
        with held(self.lane) as (device, lifted):
            self._run(schedule, buffers, ctx, device, lifted)

    def _run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext,
             device: list[DeviceBuffer], lifted: list[tuple[str, Buffer, int]]) -> None:
        lane = self.lane
        runtime, stream, channel = self.runtime, lane.stream, self.channel
        rank, world = self.rank, self.world_size
        itemsize = ctx.dtype.itemsize
        desc = ctx.desc
        pointers = stage_in(lane, buffers, self.name, device, lifted)
        if schedule.scratch and "scratch" not in pointers:
            pointers["scratch"] = lane.scratch("scratch", schedule.scratch * itemsize)
        sent = [0] * world
        received = [0] * world
        steps = schedule.steps
        observe = ctx.observe
        reduce = ctx.reduce
        for index, step in enumerate(steps):
            started = time.perf_counter() if observe is not None else 0.0
            kind, peer, src, dst = step.kind, step.peer, step.src, step.dst
            try:
                if kind is Kind.SEND:
                    assert src is not None
                    nbytes = src.count * itemsize
                    header = desc.outgoing(peer, rank, sent[peer], nbytes)
                    sent[peer] += 1
                    channel.send(peer, header, pointers[src.buf] + src.offset * itemsize,
                                 nbytes, stream, ctx)
                elif kind is Kind.RECV:
                    assert dst is not None
                    nbytes = dst.count * itemsize
                    header = desc.incoming(peer, received[peer], nbytes)
                    received[peer] += 1
                    channel.recv(peer, header, pointers[dst.buf] + dst.offset * itemsize,
                                 nbytes, stream, ctx)
                elif kind is Kind.RECV_REDUCE or kind is Kind.RECV_REDUCE_SEND:
                    assert src is not None and dst is not None and reduce is not None
                    nbytes = dst.count * itemsize
                    header = desc.incoming(peer, received[peer], nbytes)
                    received[peer] += 1
                    into = pointers[dst.buf] + dst.offset * itemsize
                    channel.recv(peer, header, into, nbytes, stream, ctx,
                                 reduce_with=pointers[src.buf] + src.offset * itemsize,
                                 op=reduce, divide_by=world if step.final else 1)
                    if kind is Kind.RECV_REDUCE_SEND:
                        to = step.to
                        header = desc.outgoing(to, rank, sent[to], nbytes)
                        sent[to] += 1
                        channel.send(to, header, into, nbytes, stream, ctx)
                else:
                    assert kind is Kind.COPY and src is not None and dst is not None
                    if dst.count:
                        runtime.copy(pointers[dst.buf] + dst.offset * itemsize,
                                     pointers[src.buf] + src.offset * itemsize,
                                     dst.count * itemsize, stream)
            except CommError as err:  # where the op stood goes with the error (hang report)
                sending = kind is Kind.SEND
                progress = over_links(schedule, index, waited_for(err, -1 if sending else peer),
                                      sent, received, itemsize, receiving=not sending,
                                      engine=self.name)
                if not isinstance(err, CommTimeout):
                    err.progress = progress
                    raise
                raise timed_out(err, progress, f"; the step was: {step.describe()} (step "
                                f"{index} of {len(steps)} of {schedule.algorithm} "
                                f"{schedule.collective})", rank, ctx.name) from None
            if observe is not None:
                observe(index, step, started, time.perf_counter())
        try:
            channel.finish(stream, ctx)
        except CommError as err:
            progress = over_links(schedule, len(steps), waited_for(err, -1), sent, received,
                                  itemsize, receiving=False, engine=self.name)
            if not isinstance(err, CommTimeout):
                err.progress = progress
                raise
            raise timed_out(err, progress, f" (the last sends of {schedule.algorithm} "
                            f"{schedule.collective})", rank, ctx.name) from None
        stage_out(lane, device, lifted, {step.dst.buf for step in steps if step.dst is not None})

    def describe(self) -> str:
        return f"{self.channel.describe()} on {self.runtime.name} ({self.runtime.memory})"


@contextmanager
def on_device(runtime: DeviceRuntime, device: int) -> Iterator[None]:
    """``device`` current on the calling thread for the block, as it was afterwards."""
    before = runtime.current_device()
    if before == device:
        yield
        return
    runtime.set_device(device)
    try:
        yield
    finally:
        runtime.set_device(before)


@contextmanager
def held(lane: DeviceLane) -> Iterator[tuple[list[DeviceBuffer],
                                             list[tuple[str, Buffer, int]]]]:
    """One op's buffers as ``stage_in`` fills them in: the caller's device buffers (their
    producers and streams) and the host buffers lifted to the device, with the lane's
    device current meanwhile (an op may run on the worker thread). If the op fails, the
    lane keeps them to its close: a failed op records no done event, and its queued work
    may still use them."""
    device: list[DeviceBuffer] = []
    lifted: list[tuple[str, Buffer, int]] = []
    with on_device(lane.runtime, lane.device):
        try:
            yield device, lifted
        except BaseException:
            lane.keep_after_failure(*(buf.array for buf in device),
                                    *(buf for _, buf, _ in lifted))
            raise


def stage_in(lane: DeviceLane, buffers: Mapping[str, Buffer], engine: str,
             device: list[DeviceBuffer], lifted: list[tuple[str, Buffer, int]]) -> dict[str, int]:
    """The device pointer of every buffer of an op, by role, with the lane's stream ordered
    after the caller's work on it: a device buffer's own (its ``producer`` waited for, the
    buffer added to ``device``), a host buffer's copy in lane scratch (added to ``lifted``)."""
    runtime, stream = lane.runtime, lane.stream
    pointers: dict[str, int] = {}
    for role, buf in buffers.items():
        if buf.memory == HOST:
            ptr = lane.scratch(f"host:{role}", buf.nbytes)
            buf.before_op()
            if buf.count:
                runtime.from_host(ptr, buf.region(0, buf.count), stream)
            pointers[role] = ptr
            lifted.append((role, buf, ptr))
        elif buf.memory == runtime.memory and isinstance(buf, DeviceBuffer):
            runtime.wait_event(stream, buf.producer)
            pointers[role] = buf.pointer
            device.append(buf)
        else:
            raise ValueError(f"{buf.name} lives in {buf.memory} memory; the {engine} engine "
                             f"moves {runtime.memory} memory only")
    return pointers


def stage_out(lane: DeviceLane, device: list[DeviceBuffer],
              lifted: list[tuple[str, Buffer, int]], written: set[str]) -> Any:
    """After an op's last work on the lane's stream: a done event the callers' streams wait
    on (the host does not), the callers' arrays kept alive until it, and what a buffer asks
    to queue after it (``DeviceBuffer.then``); the lifted host buffers the op wrote
    (``written`` roles) copied back, which the host waits for. Returns the done event."""
    runtime, stream = lane.runtime, lane.stream
    lane.ops += 1
    done = runtime.new_event()  # this op's own: a Work may wait on it after later ops
    runtime.record(done, stream)
    for mine in device:
        runtime.wait_event(mine.caller_stream, done)
        mine.done = done
        if mine.then is not None:  # the caller's own work after the op, on its stream (it
            mine.done = mine.then(mine)  # keeps what that work and the op's use alive)
        else:  # the caller's array outlives the work queued on it, even if dropped
            keep_until_done(runtime, done, 0, mine.array)
    if lifted:  # host memory: the host reads it, so the host waits for it
        for role, host, ptr in lifted:
            if role in written and host.count:  # a region is contiguous host memory
                runtime.to_host(host.region(0, host.count), ptr, stream)
        runtime.synchronize(stream)
        for _, host, _ in lifted:
            host.after_op()
    return done



def tell_headers(transport: Transport, peers: list[int], ctx: OpContext,
                 note: np.ndarray | None = None) -> None:
    """Send every peer of an op this rank's header of it: what engines whose data moves
    without the host (NCCL, the kernel path) check ops by (``hear_headers``), with a small
    ``note`` of the engine's own where it has one (the same size on every rank)."""
    nbytes = 0 if note is None else note.nbytes
    for peer in peers:
        transport.send(peer, ctx.desc.outgoing(peer, transport.rank, 0, nbytes), note,
                       ctx.name)


def hear_headers(transport: Transport, peers: list[int], ctx: OpContext,
                 note_bytes: int = 0) -> list[bytes]:
    """Take every peer's header of the op (``tell_headers``): a ``DesyncError`` naming both
    ranks where one differs from this rank's, before any device work of the op is queued.
    Returns each peer's note (``note_bytes`` long), in the order of ``peers``."""
    notes = []
    for peer in peers:
        got = transport.recv(peer, ctx.desc.incoming(peer, 0, note_bytes), ctx.deadline,
                             ctx.name)
        if note_bytes:
            notes.append(bytes(got))
        transport.release(peer)
    return notes


_WATCH_POLL_S = 0.0002  # how often a watched op looks at the device and the links
_LEFT_GRACE_S = 1.0  # how long a watched op's device work may still finish after a peer left


def watch(runtime: DeviceRuntime, transport: Transport, marks: list[tuple[list[int], Any]],
          peers: list[int], ctx: OpContext, *, engine: str, abort: Callable[[str], None],
          device_error: Callable[[], str | None] | None = None,
          waiting_on: Callable[[list[int]], list[int]] | None = None) -> None:
    """Until an op's device work is done (each mark: the peers its work waits on, and an
    event recorded after it), for engines whose device work waits on peers' device work
    with no timeout of its own (NCCL, the kernel path): poll the device, and read the links
    for a peer's abort (``abort`` is told, then the peer's error raised). A peer whose links
    closed may have finished its part of the op and left (its last bytes already delivered
    to this rank's device work): the work gets ``_LEFT_GRACE_S`` more to finish before that
    counts as a failure. At the deadline: ``abort``, then ``CommTimeout`` naming the peers
    the first unfinished mark waits on (``waiting_on`` may narrow them from what the device
    says, before the abort)."""
    waits = {peer: Wait(ctx.name, ctx.deadline, ctx.desc.incoming(peer, 0, 0))
             for peer in peers}
    pending = list(marks)
    while pending:
        if runtime.event_done(pending[0][1]):
            pending.pop(0)
            continue
        try:
            for peer, wait in waits.items():
                transport.screen(peer, wait)
        except CommError as err:  # a peer failed and told us, or left: our work may wait for it
            if isinstance(err, PeerLostError) and _finishes(
                    runtime, pending, min(ctx.deadline, time.monotonic() + _LEFT_GRACE_S)):
                return
            abort(f"rank {getattr(err, 'peer', '?')} failed")
            raise
        error = device_error() if device_error is not None else None
        if error is not None:
            abort(error)
            raise CommError(f"{engine} failed: {error}", rank=transport.rank, op=ctx.name)
        if time.monotonic() >= ctx.deadline:
            waiting = pending[0][0]
            if waiting_on is not None:
                waiting = waiting_on(waiting)
            abort(f"{ctx.name} passed its deadline")
            raise CommTimeout(f"{ctx.name} did not finish in time on the {engine} engine: its "
                              f"work still waits on rank(s) {waiting}; the communicator is "
                              "aborted", rank=transport.rank, op=ctx.name,
                              peer=waiting[0] if waiting else None)
        time.sleep(_WATCH_POLL_S)


def _finishes(runtime: DeviceRuntime, marks: list[tuple[list[int], Any]],
              deadline: float) -> bool:
    """Whether every mark's event completes by ``deadline`` (polled)."""
    while True:
        if all(runtime.event_done(event) for _, event in marks):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_WATCH_POLL_S)
