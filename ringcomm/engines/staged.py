"""The host-staged device channel: device memory between ranks that cannot map each other's
(other hosts, or CUDA IPC switched off), over whatever link joins them.

A message goes device -> page-locked host memory -> the pair's existing link (pipe and
shared-memory ring, mailbox, tcp, in-memory) -> device:

- send: where the link lends a slot of its shared-memory ring (``transport.reserve``: ranks
  of one host, payloads above the mailbox's size), the region is copied from the device
  straight into that slot and the slot is sent; the ring is page-locked once
  (``host_register``), the first time it is used, so the copy runs at full speed with no
  bounce buffer, and while the peer reads slot ``k`` the next message is copied into slot
  ``k + 1``. Elsewhere (tcp, small payloads, a full ring) the region is copied into one
  of two bounce buffers kept per peer (made at the first such message, of the segment
  size, grown for a larger one, page-locked once) and the buffer goes to
  ``transport.send``; a bounce buffer is written again only once the send that read it is
  out (its ``SendHandle``), so while segment ``k`` is on the wire, segment ``k + 1`` is
  being copied into the other one. Either way the host waits for the device copy before
  the message goes;
- recv: ``transport.recv`` gives the payload in host memory (the ring's own, page-locked
  the first time, where the link has one); it is copied to the device (straight into the
  destination for a plain receive, else into a device staging allocation per peer), and the
  payload is released to the link only once that copy is done; the reduction then runs on
  the stream.

Every message carries the op's header through the transport, which checks it, watches for
aborts and lost peers, and keeps the op's deadline; wrappers in front of the links (a
tracer, the fault injector, a checksum) see these messages as any other.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from ..core.device.runtime import Allocation, DeviceRuntime, Stream
from ..core.dtypes import ReduceOp
from ..transport.base import SendHandle, Transport
from ..transport.header import Header
from .context import OpContext
from .device_channel import DeviceChannel

__all__ = ["StagedChannel"]

log = logging.getLogger("ringcomm")

_PAGE = 4096


class _Bounce:
    """One page-aligned, page-locked host buffer and the send that last read it."""

    __slots__ = ("memory", "view", "address", "handle")

    def __init__(self, nbytes: int, runtime: DeviceRuntime) -> None:
        size = -(-max(nbytes, 1) // _PAGE) * _PAGE
        self.memory = np.empty(size + _PAGE, np.uint8)
        start = -self.memory.ctypes.data % _PAGE
        self.view = self.memory[start: start + size]
        self.address = self.view.ctypes.data
        self.handle: SendHandle | None = None
        runtime.host_register(self.address, size)

    @property
    def nbytes(self) -> int:
        return self.view.nbytes


class StagedChannel(DeviceChannel):
    """Device messages staged through host memory over ``transport``'s links (see the
    module docstring); bounce buffers start at ``segment_bytes``."""

    name = "staged"

    def __init__(self, runtime: DeviceRuntime, transport: Transport, segment_bytes: int) -> None:
        self.runtime = runtime
        self.transport = transport
        self.segment_bytes = max(1, int(segment_bytes))
        world = transport.world_size
        self._bounces: list[list[_Bounce]] = [[] for _ in range(world)]
        self._turn = [0] * world  # which of a peer's two bounce buffers goes next
        self._staging: list[Allocation | None] = [None] * world
        self._copied = runtime.new_event()  # a device-to-host copy is done
        self._landed = runtime.new_event()  # a host-to-device copy is done
        self._pending: deque[tuple[int, SendHandle]] = deque()  # sends not yet out
        self._sent_to: set[int] = set()  # peers this op sent to (their delivery is checked)
        self._tried: list[set[tuple[int, int]]] = [set() for _ in range(world)]  # rings, by peer
        self._pinned: list[int] = []  # the addresses of those page-locked
        self._closed = False

    # ---------------------------------------------------------------- sending
    def send(self, peer: int, header: Header, src: int, nbytes: int, stream: Stream,
             ctx: OpContext) -> None:
        transport = self.transport
        self._sent_to.add(peer)
        if not nbytes:
            self._track(peer, transport.send(peer, header, None, ctx.name))
            return
        slot = transport.reserve(peer, nbytes)
        if slot is not None:  # straight into the ring's slot, page-locked on first use
            self._pin(peer)
            self._to_host(slot, src, stream)
            self._track(peer, transport.send_reserved(peer, header, ctx.name))
            return
        bounce = self._bounce(peer, nbytes, ctx)
        view = bounce.view[:nbytes]
        self._to_host(view, src, stream)
        bounce.handle = transport.send(peer, header, view, ctx.name)
        self._track(peer, bounce.handle)

    def _to_host(self, dst: np.ndarray, src: int, stream: Stream) -> None:
        """Copy ``dst.nbytes`` bytes from the device at ``src`` into ``dst``, the host waiting
        until they are there."""
        runtime = self.runtime
        runtime.to_host(dst, src, stream)
        runtime.record(self._copied, stream)
        runtime.event_synchronize(self._copied)  # the bytes are in host memory

    def _pin(self, peer: int) -> None:
        """Page-lock the shared memory of the link to ``peer`` that is mapped by now and
        not yet tried (each ring once: registration touches every page). One that cannot
        be locked is said so once and used as it is: slower copies, the same bytes."""
        regions = self.transport.host_memory(peer)
        tried = self._tried[peer]
        if len(regions) == len(tried):  # nothing newly mapped (the common case)
            return
        for region in regions:
            if region in tried:
                continue
            tried.add(region)
            try:
                self.runtime.host_register(*region)
            except Exception as err:  # noqa: BLE001 - unpinned memory still works
                log.warning("rank %d cannot page-lock the shared memory of its link to rank "
                            "%d (%s): device copies to and from it run unpinned",
                            self.transport.rank, peer, err)
                continue
            self._pinned.append(region[0])

    def _bounce(self, peer: int, nbytes: int, ctx: OpContext) -> _Bounce:
        """The next of ``peer``'s two bounce buffers, once the send that last read it is out
        (made, or made larger, here)."""
        pair = self._bounces[peer]
        turn = self._turn[peer]
        self._turn[peer] = 1 - turn
        if not pair:
            size = max(self.segment_bytes, nbytes)
            pair.extend(_Bounce(size, self.runtime) for _ in range(2))
        bounce = pair[turn]
        self._wait_out(peer, bounce, ctx)
        if bounce.nbytes < nbytes:
            self.runtime.host_unregister(bounce.address)
            bounce = pair[turn] = _Bounce(nbytes, self.runtime)
        return bounce

    def _wait_out(self, peer: int, bounce: _Bounce, ctx: OpContext) -> None:
        handle = bounce.handle
        if handle is not None and handle.reads_buffer and not handle.done:
            self.transport.wait_sent(peer, handle, ctx.deadline, ctx.name)
        bounce.handle = None

    def _track(self, peer: int, handle: SendHandle | None) -> None:
        if handle is not None:
            while self._pending and self._pending[0][1].done:
                self._pending.popleft()
            self._pending.append((peer, handle))

    # ---------------------------------------------------------------- receiving
    def recv(self, peer: int, header: Header, dst: int, nbytes: int, stream: Stream,
             ctx: OpContext, *, reduce_with: int | None = None, op: ReduceOp | None = None,
             divide_by: int = 1) -> None:
        transport, runtime = self.transport, self.runtime
        payload = transport.recv(peer, header, ctx.deadline, ctx.name)
        try:
            if nbytes:
                self._pin(peer)  # it may lie in the link's ring, mapped by now
                host = np.frombuffer(payload, np.uint8, count=nbytes)
                into = dst if reduce_with is None else self._staging_for(peer, nbytes, stream)
                runtime.from_host(into, host, stream)
                runtime.record(self._landed, stream)
                runtime.event_synchronize(self._landed)  # the payload may go back now
        finally:
            transport.release(peer)
        if reduce_with is not None and nbytes:
            assert op is not None
            dtype = ctx.dtype
            count = nbytes // dtype.itemsize
            runtime.reduce(dst, reduce_with, into, count, dtype, op, stream)
            if divide_by > 1:
                runtime.finish(dst, count, dtype, op, divide_by, stream)

    def _staging_for(self, peer: int, nbytes: int, stream: Stream) -> int:
        """Device memory for ``peer``'s incoming messages: one allocation per peer, reused by
        every message (the stream orders a message's copy after the previous one's
        reduction), grown for a larger message."""
        held = self._staging[peer]
        if held is None or held.nbytes < nbytes:
            if held is not None:  # free waits for the reductions that read it
                self.runtime.free(held)
                self._staging[peer] = None
            held = self._staging[peer] = self.runtime.malloc(max(nbytes, self.segment_bytes))
        return held.ptr

    # ---------------------------------------------------------------- the op's end
    def finish(self, stream: Stream, ctx: OpContext) -> None:
        """Wait until every send of the op is out of the bounce buffers, and (where a link
        needs it) that each peer sent to is still there to take them."""
        transport = self.transport
        while self._pending:
            peer, handle = self._pending[0]
            if not handle.done:
                transport.wait_sent(peer, handle, ctx.deadline, ctx.name)
            self._pending.popleft()
        for pair in self._bounces:
            for bounce in pair:
                bounce.handle = None
        if transport.checks_delivery:
            for peer in sorted(self._sent_to):
                transport.check_delivered(peer, ctx.name)
        self._sent_to.clear()

    def close(self, *, failed: bool = False) -> None:
        """Unregister the bounce buffers (only copies the host waited for read or wrote
        them) and free the device staging (``free`` waits for the work queued on it)."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        pinned, self._pinned = self._pinned, []
        for address in pinned:
            self.runtime.host_unregister(address)
        for pair in self._bounces:
            for bounce in pair:
                self.runtime.host_unregister(bounce.address)
            pair.clear()
        for peer, held in enumerate(self._staging):
            if held is not None:
                self.runtime.free(held)
                self._staging[peer] = None

    def abandon(self) -> None:
        """Device work still waits (for a lost peer): keep the bounce buffers, the staging
        and every registration (the rings' too: unregistering may wait for the device) to
        the process's end."""
        self._closed = True
        self._pending.clear()

    def describe(self) -> str:
        return "staged (device -> page-locked host -> link -> device)"
