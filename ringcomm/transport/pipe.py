"""Named pipes (FIFOs) between ranks on one host: the messages of one ordered pair of ranks.

Why: a ZeroMQ message crosses three threads (the sender's I/O thread, the receiver's I/O
thread, then the receiving thread), and on a small machine each hand-over is a wake-up. A
pipe wakes the receiver straight from the sender's ``write``: a round trip measured here took
70-90 us against 350-380 us over ZeroMQ ``ipc://``. Between local ranks the pipe carries
every header, the small payloads inline, and the notices of payloads left in shared memory
(``shm_ring``), so one stream keeps them all in order.

A pipe also tells the reader when the writer is gone: once every write end is closed (the
process exited or died), a read returns end-of-file after the data already written. So a
dead local peer is noticed at once and its last messages are still read first.

Sends never block: a frame the pipe has no room for is queued and written by one
background thread per transport (``Flusher``) as the reader drains the pipe. Frames are
written whole, in order, by one writer per pipe.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import stat
import threading
import time
from collections import deque

PIPE_BYTES = 1 << 20  # asked of the kernel (fs.pipe-max-size allows 1 MiB by default)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_READ_BYTES = 1 << 16


def _widen(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)


class _FifoEnd:
    """The reading end of a FIFO this rank owns: made at ``path``, opened without blocking."""

    def __init__(self, path: str) -> None:
        os.mkfifo(path, 0o600)
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def unlink(self) -> None:
        """Remove the name once both ends are open; the pipe lives on until they close."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class PipeReader(_FifoEnd):
    """The receiving end of a peer's messages."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        _widen(self.fd)
        self._buf = bytearray()
        self._off = 0

    def take(self, n: int) -> bytes | None:
        """The next ``n`` bytes, or None if they have not all arrived yet (what has is kept).
        Raises EOFError once the writer is gone and everything it wrote has been read."""
        if not self._fill(n):
            return None
        out = bytes(self._buf[self._off:self._off + n])
        self.skip(n)
        return out

    def peek(self, n: int) -> bytes | None:
        """The next ``n`` bytes without consuming them, or None if they have not all arrived
        yet. Raises EOFError once the writer is gone before they did."""
        if not self._fill(n):
            return None
        return bytes(self._buf[self._off:self._off + n])

    def skip(self, n: int) -> None:
        """Consume ``n`` bytes that ``peek`` has shown."""
        self._off += n
        if self._off == len(self._buf):
            self._buf.clear()
            self._off = 0
        elif self._off >= _READ_BYTES:
            del self._buf[:self._off]
            self._off = 0

    def buffered(self, n: int) -> bytes:
        """Up to ``n`` bytes already read and not consumed (no system call)."""
        return bytes(self._buf[self._off:self._off + n])

    def has(self, n: int) -> bool:
        """Whether ``take(n)`` would return data now (or raise: the writer is gone). Reads
        what has arrived into the buffer without consuming any of it."""
        try:
            return self._fill(n)
        except EOFError:
            return True

    def _fill(self, n: int) -> bool:
        """Read what has arrived until ``n`` bytes are buffered; False if they are not all
        here yet, EOFError if the writer is gone before they are."""
        buf = self._buf
        while len(buf) - self._off < n:
            try:
                chunk = os.read(self.fd, max(_READ_BYTES, n - (len(buf) - self._off)))
            except BlockingIOError:
                return False
            if not chunk:
                raise EOFError(self.path)
            buf += chunk
        return True


class Doorbell(_FifoEnd):
    """A FIFO that wakes its owner, asleep in ``poll``: any peer ``ring``s it by writing a
    byte, and the owner ``drain``s it once awake. The bytes mean nothing, so a write that
    finds the pipe full (the owner has a byte waiting already) is dropped."""

    def drain(self) -> bool:
        """Read what was rung; False once every peer has closed its end (end-of-file:
        nothing will ring again)."""
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except BlockingIOError:
                return True
            if not chunk:
                return False


def fifo_refusal(path: str, info: os.stat_result) -> str | None:
    """Why the file ``info`` describes (``lstat``'s or ``fstat``'s) is not a FIFO of this
    user's, which is all a rank writes to by a name a peer gave it (None: it is one)."""
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link, not a FIFO"
    if not stat.S_ISFIFO(info.st_mode):
        return f"{path} is not a FIFO"
    if info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not this user ({os.getuid()})"
    return None


def open_fifo(path: str) -> int:
    """Open a peer's FIFO at ``path`` for writing, without blocking: only a FIFO of this
    user's, never through a symbolic link (``O_NOFOLLOW``), and checked again once open
    (``fstat``: the very file looked at). Anything else is a ``PermissionError`` (a link:
    ``ELOOP``) and is not opened."""
    why = fifo_refusal(path, os.lstat(path))
    if why is not None:
        raise PermissionError(errno.EPERM, why)
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        why = fifo_refusal(path, os.fstat(fd))
        if why is not None:
            raise PermissionError(errno.EPERM, why)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_doorbell(path: str) -> int:
    """A peer's doorbell at ``path``, for ``ring`` (it must be open at its owner's end);
    only a FIFO of this user's (``open_fifo``)."""
    return open_fifo(path)


def ring(fd: int) -> None:
    """Ring a doorbell opened with ``open_doorbell``; never blocks (a full pipe has rung
    already, a closed one has nobody left to wake)."""
    with contextlib.suppress(BlockingIOError, BrokenPipeError):
        os.write(fd, b"\0")


class PipeWriter:
    """The sending end of a peer's FIFO at ``path`` (``open_fifo``: a FIFO of this user's,
    not a link). ``write`` never blocks: what the pipe cannot take now goes to
    ``flusher``. Raises BrokenPipeError once the reader is gone."""

    def __init__(self, path: str, flusher: Flusher) -> None:
        self.fd = open_fifo(path)
        _widen(self.fd)
        self.lock = threading.Lock()
        self.queue: deque[memoryview] = deque()
        self.error: OSError | None = None
        self._flusher = flusher

    def write(self, frame: bytes | memoryview) -> None:
        with self.lock:
            if self.error is not None:
                raise BrokenPipeError(str(self.error))
            if not self.queue:
                try:
                    written = os.write(self.fd, frame)
                except BlockingIOError:
                    written = 0
                if written == len(frame):
                    return
                frame = memoryview(frame)[written:]
            self.queue.append(memoryview(frame))
        self._flusher.wake(self)

    def drain(self) -> bool:
        """Write what is queued until the pipe is full; True when nothing is left."""
        with self.lock:
            while self.queue:
                head = self.queue[0]
                try:
                    written = os.write(self.fd, head)
                except BlockingIOError:
                    return False
                except OSError as err:  # the reader is gone: nobody will read the rest
                    self.error = err
                    self.queue.clear()
                    return True
                if written == len(head):
                    self.queue.popleft()
                else:
                    self.queue[0] = head[written:]
            return True

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def close(self, timeout: float = 2.0) -> None:
        """Give queued frames up to ``timeout`` to leave (a live peer still reads them)."""
        end = time.monotonic() + timeout
        while self.pending and time.monotonic() < end:
            time.sleep(0.005)
        with contextlib.suppress(OSError):
            os.close(self.fd)


class Flusher:
    """One thread per transport that writes queued frames as their pipes drain. Started on
    first need: most runs never fill a pipe."""

    def __init__(self) -> None:
        self._waiting: set[PipeWriter] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False

    def wake(self, writer: PipeWriter) -> None:
        with self._cond:
            self._waiting.add(writer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ringcomm-pipes",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        poller = select.poll()
        while True:
            with self._cond:
                while not self._waiting and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                writers = list(self._waiting)
            for w in writers:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    poller.register(w.fd, select.POLLOUT)
            ready = {fd for fd, _ in poller.poll(50)}
            for w in writers:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    poller.unregister(w.fd)
                if (w.fd in ready or w.error is not None) and w.drain():
                    with self._cond, w.lock:  # a write may have queued more meanwhile
                        if not w.queue:
                            self._waiting.discard(w)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
