"""The CUDA IPC channel: ranks of one host move device messages through each other's memory.

Why: between processes on one host (one GPU or several), a message need not leave the
device. Each rank allocates persistent staging slots once, exports them, and every peer
maps them once; a message is one device copy into the sender's slot and one copy (or a
reduction, which reads the peer's memory directly) out of it on the receiver's stream.
Only small notices travel on the links, so every message still carries the op's header
(desyncs are caught as on the links) and every host wait runs against the op's deadline.

Set-up (once per group, on every rank): one ``malloc`` holding, for each peer, ``slots``
outgoing slots of ``slot_bytes`` (this rank writes them, that peer reads them); one
interprocess ``ready`` event per outgoing slot and one ``done`` event per incoming slot.
The memory and events are exported once and published through the exchange with this
process's pid; each peer's are opened once, by this channel, which closes them at its own
close (CUDA gives a destroyed event's handle bytes to the process's next event, so nothing
opened outlives the channel, and nothing is kept by handle bytes beyond it). A peer in this
same process (the threads of ``run_group``) is not opened (CUDA forbids opening one's own
handle): its pointers and events are found in this process's table of exports, which holds
them only while their channel is open.

A message from p to q, piece by piece (a message larger than a slot travels in slot-sized
pieces, in order), with slot ``s`` = p's running count of pieces to q modulo ``slots``:

1. p, before reusing ``s``, takes q's credits until q has used the piece that last held
   ``s``, then makes its stream wait for ``done_q[s]`` (device side, no host block);
2. p copies the piece into ``s`` on its stream, records ``ready_p[s]``, and only then
   sends the notice (the op's header, a payload naming the slot and the bytes): a wait
   uses the latest record at the time of the call, so the record must come first;
3. q receives the notice (its header checked as on the links), makes its stream wait for
   ``ready_p[s]``, copies or reduces straight from p's slot into its destination,
   records ``done_q[s]``, and only then sends p a credit (a cumulative count).

Close, in the safe order: every rank lets its own device work on the slots finish, closes
what it opened (memory and events) and says so ("closed") through the exchange; then it
waits, bounded, for the "closed" of every peer that maps its memory (a peer that is gone
does not hold it), frees its memory and destroys its events.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.device.runtime import Allocation, DeviceRuntime, Event, Stream
from ..core.dtypes import ReduceOp
from ..errors import ArgumentError, CommTimeout, DesyncError
from ..transport.base import Transport
from ..transport.header import Header
from .context import OpContext
from .device_channel import DeviceChannel, Exchange
from .peer_memory import AFTER_FAILURE_S, EXPORTS, LEFT_FOR_EXIT, close_in_order

__all__ = ["IpcChannel"]

log = logging.getLogger("ringcomm")

# a notice's payload: the message's bytes, the piece's offset and bytes in it, the slot
_NOTICE = struct.Struct("<QQQI4x")
_NO_SLOT = 0xFFFFFFFF  # an empty message's notice: no slot, no credit
_HANDLES_KEY = "cuda-ipc/handles"
_CLOSED_KEY = "cuda-ipc/closed"
_ALIGN = 16  # slot sizes are multiples of every element size, so pieces split no element
_BRIEF_S = 0.002  # how long one host wait lasts while pieces wait for slots


@dataclass(slots=True)
class _Waiting:
    """A piece sent before its slot was free: its notice's header and numbers, and the
    spare block holding its bytes (None if empty)."""

    notice: Header
    nbytes: int
    offset: int
    size: int
    block: Allocation | None


def _brief(ctx: OpContext) -> float:
    """The deadline of one short host wait while pieces wait for slots (the op's own
    deadline if that comes first): between such waits the channel gives out free slots."""
    return min(ctx.deadline, time.monotonic() + _BRIEF_S)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


class IpcChannel(DeviceChannel):
    """Device messages between the ranks of one host through each other's exported slots
    (see the module docstring). Made once per group on every rank; ``close`` gives
    everything back."""

    name = "cuda-ipc"

    def __init__(self, runtime: DeviceRuntime, transport: Transport, exchange: Exchange,
                 rank: int, world_size: int, *, slots: int = 4, slot_bytes: int = 4 << 20,
                 timeout_s: float = 60.0, close_wait_s: float = 60.0) -> None:
        if slots < 1:
            raise ArgumentError(f"cuda-ipc slots must be at least 1 (got {slots})")
        if slot_bytes < _ALIGN or slot_bytes % _ALIGN:
            raise ArgumentError(f"cuda-ipc slot size must be a positive multiple of {_ALIGN} "
                                f"bytes (got {slot_bytes})")
        self.runtime = runtime
        self.transport = transport
        self.exchange = exchange
        self.rank = rank
        self.world_size = world_size
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.close_wait_s = close_wait_s
        self._closed = False
        peers = [q for q in range(world_size) if q != rank]
        self._peers = peers
        # pieces sent to / received from each peer, across ops, and the credits taken
        self._sent = [0] * world_size
        self._received = [0] * world_size
        self._credited = [0] * world_size
        # this rank's side: its memory, its ready events (per peer, per outgoing slot) and
        # done events (per peer, per incoming slot)
        self._memory: Allocation | None = None
        self._ready: dict[int, list[Event]] = {}
        self._done: dict[int, list[Event]] = {}
        self._exported: list[bytes] = []
        # the peers' side, as this rank sees it
        self._their_slots: dict[int, int] = {}  # base of the peer's slots for this rank
        self._their_ready: dict[int, list[Event]] = {}
        self._their_done: dict[int, list[Event]] = {}
        self._pids: dict[int, int] = {}
        # pieces sent before their slot was free, per peer, and spare blocks holding them
        self._waiting: dict[int, deque[_Waiting]] = {peer: deque() for peer in peers}
        self._spare: list[Allocation] = []
        self._blocks: list[Allocation] = []
        self._opened: list[int] = []  # pointers open_memory returned, closed at close
        self._opened_events: list[Event] = []  # events open_event returned, closed at close
        if peers:
            try:
                self._set_up(time.monotonic() + timeout_s)
            except BaseException:
                try:
                    self._give_back()
                except Exception as err:  # noqa: BLE001 - the set-up's error says more
                    log.warning("rank %d could not give back a half-made cuda-ipc channel: "
                                "%s", rank, err)
                raise

    # ---------------------------------------------------------------- set-up
    def _position(self, owner: int, reader: int) -> int:
        """Where ``reader``'s slots lie among ``owner``'s (owners skip themselves)."""
        return reader if reader < owner else reader - 1

    def _set_up(self, deadline: float) -> None:
        runtime, slots = self.runtime, self.slots
        memory = runtime.malloc(len(self._peers) * slots * self.slot_bytes)
        self._memory = memory
        record: dict[str, Any] = {"pid": os.getpid(), "ready": {}, "done": {}}
        handle = runtime.export_memory(memory)
        EXPORTS.add(handle, memory.ptr)
        self._exported.append(handle)
        record["memory"] = handle.hex()
        for peer in self._peers:
            for table, name in ((self._ready, "ready"), (self._done, "done")):
                events = table[peer] = [runtime.new_event(interprocess=True)
                                        for _ in range(slots)]
                handles = [runtime.export_event(event) for event in events]
                for event_handle, event in zip(handles, events, strict=True):
                    EXPORTS.add(event_handle, event)
                self._exported += handles
                record[name][str(peer)] = [h.hex() for h in handles]
        self.exchange.publish(_HANDLES_KEY, json.dumps(record).encode())
        me = str(self.rank)
        for peer in self._peers:
            theirs = json.loads(self.exchange.read(_HANDLES_KEY, peer, deadline))
            pid = self._pids[peer] = int(theirs["pid"])
            local = pid == os.getpid()
            memory_handle = bytes.fromhex(theirs["memory"])
            if local:
                base = EXPORTS.get(memory_handle)
            else:
                base = runtime.open_memory(memory_handle)
                self._opened.append(base)
            self._their_slots[peer] = base + (self._position(peer, self.rank) * slots
                                              * self.slot_bytes)
            for table, name in ((self._their_ready, "ready"), (self._their_done, "done")):
                handles = [bytes.fromhex(h) for h in theirs[name][me]]
                if local:
                    table[peer] = [EXPORTS.get(h) for h in handles]
                    continue
                table[peer] = []
                for h in handles:
                    event = runtime.open_event(h)
                    self._opened_events.append(event)
                    table[peer].append(event)

    def _my_slot(self, peer: int, slot: int) -> int:
        assert self._memory is not None
        return self._memory.ptr + ((self._position(self.rank, peer) * self.slots + slot)
                                   * self.slot_bytes)

    # ---------------------------------------------------------------- messages
    def _pieces(self, nbytes: int) -> list[tuple[int, int]]:
        """(offset, bytes) of each piece of an ``nbytes`` message: one, empty, for none."""
        step = self.slot_bytes
        return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)] \
            or [(0, 0)]

    def send(self, peer: int, header: Header, src: int, nbytes: int, stream: Stream,
             ctx: OpContext) -> None:
        """Each piece goes into its slot now if the slot is free; otherwise it is copied to
        a spare block (so ``src`` may change once this returns) and waits there for its
        slot, which a later call or ``finish`` gives it: a send never blocks, so ranks that
        all send before they receive (a ring) cannot hold each other up."""
        self._progress(stream, ctx)
        notice_header = header._replace(nbytes=_NOTICE.size)
        waiting = self._waiting[peer]
        for offset, size in self._pieces(nbytes):
            if not waiting and (not size or self._slot_free(peer, ctx)):
                self._post(peer, notice_header, nbytes, offset, size, src + offset, stream,
                           ctx)
                continue
            block = None
            if size:
                block = self._spare_block()
                self.runtime.copy(block.ptr, src + offset, size, stream)
            waiting.append(_Waiting(notice_header, nbytes, offset, size, block))

    def _post(self, peer: int, notice_header: Header, nbytes: int, offset: int, size: int,
              src: int, stream: Stream, ctx: OpContext) -> None:
        """Copy a piece into its slot (free: its credit is in hand), record ``ready``, then
        send its notice."""
        runtime, slot = self.runtime, _NO_SLOT
        if size:
            number = self._sent[peer]
            slot = number % self.slots
            if number >= self.slots:  # the slot's last piece has been read: wait for that
                runtime.wait_event(stream, self._their_done[peer][slot])
            runtime.copy(self._my_slot(peer, slot), src, size, stream)
            runtime.record(self._ready[peer][slot], stream)
            self._sent[peer] = number + 1
        notice = np.frombuffer(_NOTICE.pack(nbytes, offset, size, slot), np.uint8)
        self.transport.send(peer, notice_header, notice, ctx.name)

    def _slot_free(self, peer: int, ctx: OpContext, until: float | None = None) -> bool:
        """Whether the next piece to ``peer`` has a free slot: ``peer`` has read the piece
        that used it last (its credits, taken as they come; with ``until``, waited for on
        the host through the transport until then: ``CommTimeout`` past it)."""
        needed = self._sent[peer] - self.slots + 1
        transport = self.transport
        while self._credited[peer] < needed:
            credit = transport.poll_credit(peer, ctx.name) if until is None \
                else transport.recv_credit(peer, until, ctx.name)
            if credit is None:
                return False
            self._credited[peer] = max(self._credited[peer], credit)
        return True

    def _spare_block(self) -> Allocation:
        """A slot-sized block of device memory for a piece to wait in. A block is given out
        again as soon as its piece has been posted: every copy into a block and out of it
        is queued on the lane's one stream, so stream order alone keeps a reuse behind the
        last read (no event needed)."""
        if self._spare:
            return self._spare.pop()
        block = self.runtime.malloc(self.slot_bytes)
        self._blocks.append(block)
        return block

    def _flush(self, peer: int, stream: Stream, ctx: OpContext,
               until: float | None = None) -> None:
        """Give waiting pieces to ``peer`` their slots, in order, while slots are free
        (with ``until``: waiting for them until then)."""
        waiting = self._waiting[peer]
        while waiting:
            piece = waiting[0]
            if piece.size and not self._slot_free(peer, ctx, until):
                return
            waiting.popleft()
            src = 0
            if piece.block is not None:
                src = piece.block.ptr
            self._post(peer, piece.notice, piece.nbytes, piece.offset, piece.size, src,
                       stream, ctx)
            if piece.block is not None:  # its copy out is queued: later ones go after it
                self._spare.append(piece.block)

    def _progress(self, stream: Stream, ctx: OpContext) -> None:
        """Give waiting pieces the slots their peers have freed (never blocks)."""
        for peer, waiting in self._waiting.items():
            if waiting:
                self._flush(peer, stream, ctx)

    def _any_waiting(self) -> bool:
        return any(self._waiting.values())

    def finish(self, stream: Stream, ctx: OpContext) -> None:
        """Every waiting piece gets its slot before the op returns: a loop over the peers
        that takes their credits as they come, until the op's deadline."""
        while self._any_waiting():
            self._progress(stream, ctx)
            for peer, waiting in self._waiting.items():
                if waiting:
                    try:
                        self._flush(peer, stream, ctx, _brief(ctx))
                    except CommTimeout:
                        if time.monotonic() >= ctx.deadline:
                            raise
                    break

    def recv(self, peer: int, header: Header, dst: int, nbytes: int, stream: Stream,
             ctx: OpContext, *, reduce_with: int | None = None, op: ReduceOp | None = None,
             divide_by: int = 1) -> None:
        runtime, transport = self.runtime, self.transport
        expected = header._replace(nbytes=_NOTICE.size)
        dtype, itemsize = ctx.dtype, ctx.dtype.itemsize
        if reduce_with is not None and op is None:
            raise ValueError("a reducing receive needs its reduce op")
        self._progress(stream, ctx)
        for offset, size in self._pieces(nbytes):
            notice = self._notice(peer, expected, stream, ctx)
            number = self._received[peer]
            slot = number % self.slots if size else _NO_SLOT
            self._check_notice(peer, notice, (nbytes, offset, size, slot), ctx)
            if not size:
                continue
            theirs = self._their_slots[peer] + slot * self.slot_bytes
            runtime.wait_event(stream, self._their_ready[peer][slot])
            if reduce_with is None:
                runtime.copy(dst + offset, theirs, size, stream)
            else:
                assert op is not None
                runtime.reduce(dst + offset, reduce_with + offset, theirs, size // itemsize,
                               dtype, op, stream)
            runtime.record(self._done[peer][slot], stream)
            self._received[peer] = number + 1
            transport.send_credit(peer, number + 1, ctx.name)
        if reduce_with is not None and divide_by > 1 and nbytes:
            assert op is not None
            runtime.finish(dst, nbytes // itemsize, dtype, op, divide_by, stream)

    def _notice(self, peer: int, expected: Header, stream: Stream, ctx: OpContext) -> bytes:
        """The next notice from ``peer`` (its header checked); while this rank has pieces
        waiting for slots, it keeps giving them slots as credits come meanwhile (the peer
        may be waiting for them before it sends)."""
        transport = self.transport
        while self._any_waiting():
            try:
                got = transport.recv(peer, expected, _brief(ctx), ctx.name)
                break
            except CommTimeout:
                if time.monotonic() >= ctx.deadline:
                    raise
            self._progress(stream, ctx)
        else:
            got = transport.recv(peer, expected, ctx.deadline, ctx.name)
        notice = bytes(got)
        transport.release(peer)
        return notice

    def _check_notice(self, peer: int, notice: bytes, expected: tuple[int, int, int, int],
                      ctx: OpContext) -> None:
        got = _NOTICE.unpack(notice)
        if got == expected:
            return
        if got[0] != expected[0]:
            what = (f"rank {peer} sends a message of {got[0]} B, rank {self.rank} expects "
                    f"{expected[0]} B")
        else:
            what = (f"rank {peer}'s notice names {got[2]} B at offset {got[1]} in slot "
                    f"{got[3]}, rank {self.rank} expects {expected[2]} B at offset "
                    f"{expected[1]} in slot {expected[3]} (a message was lost)")
        raise DesyncError(f"ranks disagree about a device message: {what}", rank=self.rank,
                          op=ctx.name, peer=peer)

    # ---------------------------------------------------------------- the rest
    def describe(self) -> str:
        return f"cuda-ipc: {self.slots} slots x {_size(self.slot_bytes)} per peer"

    def close(self, *, failed: bool = False) -> None:
        """Importers close, then exporters free (see the module docstring). After a failure
        (``failed``) the peers may be stuck or gone: they are waited for briefly only, and
        what one may still map is left for the process's exit."""
        if self._closed:
            return
        self._closed = True
        if not self._peers:
            return
        wait_s = min(self.close_wait_s, AFTER_FAILURE_S) if failed else self.close_wait_s
        if not self._settle(time.monotonic() + wait_s):
            log.warning("rank %d's device work on its cuda-ipc slots did not finish within "
                        "%g s (a peer lost in the middle of an op?): its mappings and slots "
                        "are left for the process's exit to give back", self.rank, wait_s)
            self._leave_for_exit()
            return
        self._close_opened()
        pids = {peer: self._pids[peer] for peer in self._peers if peer in self._pids}
        if not close_in_order(self.exchange, _CLOSED_KEY, self.rank, pids, wait_s,
                              "cuda-ipc slots and events"):
            self._leave_for_exit()
            return
        self._give_back(keep_events=failed)

    def abandon(self) -> None:
        """After a failure, while device work may wait for a lost peer for ever: free and
        close nothing (a free would wait for that work), keep it all to the process's
        exit, and let the peers go at once."""
        if self._closed:
            return
        self._closed = True
        self._leave_for_exit()

    def _leave_for_exit(self) -> None:
        """Keep everything this channel made or opened referenced to the process's exit
        (dropping an event destroys it, and its handle would go to the next event while a
        peer may still wait on it), out of this process's table of exports."""
        EXPORTS.drop(self._exported)
        LEFT_FOR_EXIT.append((self._memory, self._blocks, self._ready, self._done,
                               self._opened, self._opened_events, self._their_ready,
                               self._their_done))
        self._exported, self._memory, self._blocks, self._spare = [], None, [], []
        self._ready, self._done, self._opened, self._opened_events = {}, {}, [], []
        self._their_ready, self._their_done, self._their_slots = {}, {}, {}

    def _settle(self, deadline: float) -> bool:
        """Let this rank's device work on the slots finish: its copies into its own slots
        (ready events) and its reads of the peers' slots (done events); the spare blocks
        are read only by copies into its own slots. False if it has not by ``deadline``
        (work that waits for a lost peer's event may never finish)."""
        events = [event for table in (self._ready, self._done)
                  for row in table.values() for event in row]
        while True:
            events = [event for event in events if not self.runtime.event_done(event)]
            if not events:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def _close_opened(self) -> None:
        """Close what this rank opened of its peers' (their slots and events)."""
        opened, self._opened = self._opened, []
        for ptr in opened:
            self.runtime.close_memory(ptr)
        events, self._opened_events = self._opened_events, []
        self._their_ready, self._their_done = {}, {}
        for event in events:
            self.runtime.close_event(event)

    def _give_back(self, *, keep_events: bool = False) -> None:
        """Close what is still open and free this rank's memory (the last step of close, or
        what a failed set-up made). ``keep_events``: after a failed op a peer's stream may
        still hold a wait on one of this rank's events that never ends, though the peer has
        closed its mappings; the events (small) are then kept to the process's exit rather
        than destroyed under that wait."""
        self._close_opened()
        EXPORTS.drop(self._exported)  # first: a channel set up meanwhile may get its handles
        self._exported = []
        memory, self._memory = self._memory, None
        if memory is not None:
            self.runtime.free(memory)
        blocks, self._blocks, self._spare = self._blocks, [], []
        for block in blocks:
            self.runtime.free(block)
        own = [event for table in (self._ready, self._done) for row in table.values()
               for event in row]
        self._ready, self._done = {}, {}
        self._their_ready, self._their_done, self._their_slots = {}, {}, {}
        if keep_events:
            LEFT_FOR_EXIT.append(own)
            return
        for event in own:  # the importers have closed theirs (or are gone)
            self.runtime.close_event(event)
