"""A one-way byte ring in shared memory, for payloads between two ranks on one host.

Why: a socket moves every byte twice through the kernel (into it, out of it) and once more
out of ZeroMQ's receive buffer. Here the sender copies a payload into a ring that both
processes map, and the receiver reduces or copies straight out of it: one copy instead of
three, and no system call per 200 KiB of socket buffer. Notifications still travel as small
ZeroMQ messages, so ordering, timeouts, peer loss and aborts work as on any channel.

Layout: a 64-byte control block, then ``capacity`` bytes of data. The sender owns ``head``
(the ring position after its last payload; private to it), the receiver owns ``tail``
(stored in the control block: everything before it has been consumed; the sender moves
it only when the ring is drained, see below). Positions grow
without bound and are taken modulo ``capacity``. A payload never wraps: if it does not fit
before the end, the sender skips to the start, and the receiver, who frees up to the end
of each payload it consumes, frees the skipped bytes with it. A drained ring starts over at
the front the same way, so the memory a ring touches is what was ever in flight at once,
not its whole capacity: mapping a page for the first time costs several microseconds here,
and an all-to-all whose blocks kept landing on fresh pages ran 10x slower until the ring had
wrapped once.

The ring never blocks: ``reserve`` returns ``None`` when the payload does not fit, and the
caller sends that payload over the socket instead. Schedules bound what is in flight, so
with a ring of a few dozen segments that path is rare, but it keeps every schedule free of
deadlock whatever its shape.

Memory ordering: the sender writes the payload, then makes a system call (the ZeroMQ
notification); the receiver reads it after the notification arrives, and publishes ``tail``
only after it has finished reading.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

SHM_DIR = "/dev/shm"
_CONTROL = 64
_ALIGN = 64


def available() -> bool:
    """Shared memory rings need a tmpfs at /dev/shm (Linux)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            # reserve the pages now: a full tmpfs then fails here, not with SIGBUS later
            os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class RingWriter:
    """The sending end. Creates the shared file ``name`` in /dev/shm."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.path = os.path.join(SHM_DIR, name)
        self._mm = _map(self.path, _CONTROL + capacity, create=True)
        self._tail = np.frombuffer(self._mm, np.int64, 1, 0)
        self._data = np.frombuffer(self._mm, np.uint8, capacity, _CONTROL)
        self._head = 0

    def reserve(self, nbytes: int) -> tuple[int, np.ndarray] | None:
        """Room for ``nbytes``: its ring position and a writable view, or None if full."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        if size > self.capacity:
            return None
        start, pos, tail = self._head, self._head % self.capacity, int(self._tail[0])
        drained = start == tail
        # skip the end of the ring rather than wrap; a drained ring skips it too, to start
        # over at the front, whose pages both processes have mapped already
        if pos and (drained or pos + size > self.capacity):
            start += self.capacity - pos
            pos = 0
            if drained:
                # the skipped end is owed by nobody: the reader has released everything and
                # writes ``tail`` again only after it has read a payload sent after this one
                self._tail[0] = tail = start
        if start + size - tail > self.capacity:
            return None
        self._head = start + size
        return start, self._data[pos: pos + nbytes]

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        self._tail = self._data = None  # the mapping goes with the last view


class RingReader:
    """The receiving end: maps the writer's file and removes its name (nothing else needs
    it, so a crash later leaves nothing behind in /dev/shm)."""

    def __init__(self, name: str, capacity: int) -> None:
        path = os.path.join(SHM_DIR, name)
        self._mm = _map(path, _CONTROL + capacity, create=False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.capacity = capacity
        self._tail = np.frombuffer(self._mm, np.int64, 1, 0)
        self._data = np.frombuffer(self._mm, np.uint8, capacity, _CONTROL)

    def view(self, start: int, nbytes: int) -> np.ndarray:
        pos = start % self.capacity
        return self._data[pos: pos + nbytes]

    def release(self, start: int, nbytes: int) -> None:
        """Hand the payload at ``start`` (and any skipped bytes before it) back to the writer."""
        self._tail[0] = start + -(-nbytes // _ALIGN) * _ALIGN

    def close(self) -> None:
        self._tail = self._data = None
