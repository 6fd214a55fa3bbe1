"""Shared-memory mailbox slots: small messages between two ranks of one host, no system call.

Why: a named pipe costs a ``write`` on one side and a ``read`` on the other for every
message, a quarter of a small allreduce's time here; and a receive that spins on a pipe
makes a system call on every turn. A mailbox is a short array of fixed-size slots in memory
both processes map: the sender copies a frame (a header, then a payload of up to
``PAYLOAD_BYTES``, or the position of a large payload in the shared-memory ring) into the
next slot and then stamps it with the frame's number; the receiver watches the stamp with a
plain memory read, and frees slots in order by publishing how many it has consumed.

Waking a receiver that sleeps: before it blocks in ``poll`` it raises ``sleeping`` and
checks the slot once more; a sender that finds ``sleeping`` raised after stamping a slot
writes a one-byte doorbell into the pipe, which wakes the ``poll``. Both sides put a full
memory barrier between their store and their load (a lock's atomic instruction), so one of
them always sees the other; and a receiver never sleeps longer than ``DOZE_S`` between
looks at the slot.

Ordering: stores become visible in program order only on x86 (TSO); elsewhere the stamp
could be seen before the frame it covers, so ``supported`` is False there and links use the
pipe alone.

Layout (created by the receiver, which owns it; the sender maps it once both ends are open
and removes its name): a 64-byte line of the receiver's (``consumed``, ``sleeping``), then
``SLOTS`` slots of ``SLOT_BYTES``: a stamp (frame number + 1; 0 never written), the frame's
tag and padding to 16 bytes, the header (``header.SIZE``), the payload.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np

from ..core import config
from . import shm_ring
from .header import SIZE as HEADER_SIZE
from .shm_ring import fence, stores_in_order

SLOTS = 16
PAYLOAD_BYTES = 8 << 10  # the largest payload a slot holds inline
_PREFIX = 16  # stamp u64, tag u8, padding
HEADER_END = _PREFIX + HEADER_SIZE  # where a slot's payload starts
SLOT_BYTES = HEADER_END + PAYLOAD_BYTES
_LINE = 64
SIZE = _LINE + SLOTS * SLOT_BYTES
DOZE_S = 0.02  # the longest a receiver sleeps without looking at its slot

supported = stores_in_order  # a stamp is written after the frame it covers


def wanted() -> bool:
    """Whether this rank takes small messages through mailboxes: ``RINGCOMM_MAILBOX``
    (default off), where ``supported``. Each rank decides for its own incoming messages;
    a sender uses a peer's mailbox where the peer made one, the pipe otherwise."""
    return bool(config.value("mailbox")) and supported()


def mailbox_name(ring_name: str) -> str:
    """The /dev/shm name of the mailbox beside the ring called ``ring_name`` (same pair,
    same owner pid, so the sweep of dead owners' rings finds it too)."""
    return f"{ring_name}-mbox"


_STAMP = struct.Struct("<q")


class _Mapped:
    """The mapping, read and written through struct and slices of a memoryview: a few
    hundred nanoseconds each, where numpy's views of a slot cost microseconds."""

    def __init__(self, mm: mmap.mmap) -> None:
        self._mm = mm
        self._mem = memoryview(mm)
        self._line = np.frombuffer(mm, np.int64, 2, 0)  # consumed, sleeping
        self._slots = np.frombuffer(mm, np.uint8, SLOTS * SLOT_BYTES, _LINE)

    def close(self) -> None:
        # the mapping goes with the last view; a closed mailbox is not used again
        self._mem.release()
        self._line = self._slots = None  # type: ignore[assignment]


class MailboxReader(_Mapped):
    """The receiving end: creates the mailbox at ``name`` (before the sender can map it)."""

    def __init__(self, name: str) -> None:
        self.path = shm_ring.shm_path(name)
        super().__init__(shm_ring.map_shared(self.path, SIZE, create=True))
        self.taken = 0  # frames taken from the mailbox (consumed or held)
        self._at = _LINE  # the next slot's offset

    def ready(self, frame: int) -> bool:
        """Whether the next slot holds frame number ``frame``."""
        return _STAMP.unpack_from(self._mm, self._at)[0] == frame + 1

    def take(self) -> tuple[bytes, bytes, int]:
        """The next slot's tag, header and the offset of its payload in ``payload``'s
        terms; valid until ``release``."""
        at = self._at
        tag = self._mm[at + 8: at + 9]
        header = self._mm[at + _PREFIX: at + HEADER_END]
        self.taken += 1
        self._at = _LINE + (self.taken % SLOTS) * SLOT_BYTES
        return tag, header, at - _LINE + HEADER_END

    def payload(self, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of a taken slot's payload (``offset`` from ``take``)."""
        return self._slots[offset: offset + nbytes]

    def release(self) -> None:
        """Hand every slot taken so far back to the sender."""
        self._line[0] = self.taken

    def doze(self, sleeping: bool) -> None:
        """Say whether this end is about to sleep (the sender then rings the pipe)."""
        self._line[1] = int(sleeping)
        if sleeping:
            fence()

    def unlink(self) -> None:
        shm_ring.remove_made(self.path)

    def close(self) -> None:
        self.unlink()
        super().close()


class MailboxWriter(_Mapped):
    """The sending end: maps the receiver's mailbox and removes its name (nothing opens it
    again, so a crash later leaves nothing behind)."""

    def __init__(self, name: str) -> None:
        path = shm_ring.shm_path(name)
        mapped, identity = shm_ring.open_shared(path, SIZE, create=False)
        super().__init__(mapped)
        shm_ring.remove_mapped(path, identity)
        self.sent = 0  # frames put in the mailbox

    def put(self, frame: int, tag: bytes, header: bytes, payload: Any) -> bool:
        """Copy a frame (``payload``: a buffer of at most ``PAYLOAD_BYTES``, or None) into
        the next slot and stamp it with ``frame``; False if no slot is free."""
        if self.sent - int(self._line[0]) >= SLOTS:
            return False
        at = _LINE + (self.sent % SLOTS) * SLOT_BYTES
        mem = self._mem
        mem[at + 8: at + 9] = tag
        mem[at + _PREFIX: at + HEADER_END] = header
        if payload is not None:
            data = memoryview(payload).cast("B")
            mem[at + HEADER_END: at + HEADER_END + len(data)] = data
        _STAMP.pack_into(self._mm, at, frame + 1)  # after the frame: x86 keeps store order
        self.sent += 1
        return True

    @property
    def delivered(self) -> bool:
        """Whether the receiver has taken every frame put here."""
        return int(self._line[0]) >= self.sent

    @property
    def sleeping(self) -> bool:
        """Whether the receiver sleeps (ring its doorbell); read after a full barrier."""
        fence()
        return bool(self._line[1])
