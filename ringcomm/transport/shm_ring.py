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

Nothing left behind: a ring's name in /dev/shm is needed only until the receiver has mapped
it; the receiver then removes it (the memory lives on until both ends unmap it, which the
kernel does for a process that dies). A name still there at the end (the receiver never
read from the ring, or a process died first) is removed by either end's transport when it
closes, is garbage-collected or the interpreter exits, and, for a process killed before any
of that, by the next transport set up on the host (``sweep``): each name carries its
creator's pid (``ring_name``), and names whose creator has ended are removed.

Only ringcomm's own names, only ringcomm's own files: a name is opened only in /dev/shm and
only in the form ``ring_name`` makes (``shm_path``; the tokens in peers' names come from the
store, where a stranger may have written them), never through a symbolic link, and a peer's
file is mapped only if it is a regular file of this user's alone of exactly the size
expected. A name is removed only if it is still the file that was made or mapped under it
(``remove_made``, ``remove_mapped``), or, for a name of a peer's never mapped here, a file
of this user's that ringcomm could have made (``remove_name``): a file someone else put
under one of these names since (the names are in the store for anyone to read) is left.
"""

from __future__ import annotations

import errno
import mmap
import os
import platform
import re
import stat
import threading
import uuid

import numpy as np

SHM_DIR = "/dev/shm"
_CONTROL = 64
_ALIGN = 64
# ring_name(new_token(), a, b): "ringcomm-<pid>-<pid namespace>-<12 hex digits>-<a>to<b>"
_TOKEN = re.compile(r"(\d+)-([0-9a-f]+)-[0-9a-f]{12}")
_RING_NAME = re.compile(rf"ringcomm-{_TOKEN.pattern}-(?:\d+to\d+(?:-mbox)?|board)")
_PID_MAX = 1 << 22  # the most pid_max allows


def _pid_namespace() -> str:
    try:
        return f"{os.stat('/proc/self/ns/pid').st_ino:x}"
    except OSError:
        return "0"


def owner_tag() -> str:
    """``<pid>-<pid namespace>``: who made a file, in the names of ringcomm's files (rings
    here, ipc folders in the temp dir), so that ``owner_gone`` can tell when it is litter.
    Computed per call: a forked child is another owner."""
    return f"{os.getpid()}-{_pid_namespace()}"


def owner_gone(pid: int, namespace: str) -> bool:
    """Whether process ``pid`` of pid namespace ``namespace``, which made a file, has ended,
    so that nothing uses the file's name any more.

    Errs towards "alive", which only delays a clean-up: a pid of another pid namespace (a
    container that shares /dev/shm or the temp dir) means nothing here, a process of another
    user answers PermissionError, and a pid that an unrelated live process has taken over
    since keeps the file until that process ends too. A zombie (dead, not yet reaped by its
    parent) has ended: it holds no files and maps no memory."""
    if namespace != _pid_namespace() or not 0 < pid <= _PID_MAX or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: alive, another user's
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


def new_token() -> str:
    """A transport's token for the names of the rings it creates: its ``owner_tag`` and 12
    random hex digits."""
    return f"{owner_tag()}-{uuid.uuid4().hex[:12]}"


def valid_token(token: str) -> bool:
    """Whether ``token`` (a peer's, from the store) is one ``new_token`` makes: the names
    built from it are then plain names in /dev/shm, which a reader may remove."""
    return _TOKEN.fullmatch(token) is not None


def valid_name(name: str) -> bool:
    """Whether ``name`` is one that ringcomm makes in /dev/shm (a ring, a mailbox, a board)."""
    return isinstance(name, str) and _RING_NAME.fullmatch(name) is not None


def shm_path(name: str) -> str:
    """The path in /dev/shm of ``name``, one of ringcomm's names (``valid_name``); a
    ``ValueError`` for any other (a separator, ``..``, another form: never joined)."""
    if not valid_name(name):
        raise ValueError(f"{name!r} is not a name ringcomm makes in {SHM_DIR}")
    return os.path.join(SHM_DIR, name)


def ring_name(token: str, src: int, dst: int) -> str:
    """The name in /dev/shm of the ring from rank ``src`` to rank ``dst``, created by the
    transport of ``src`` whose ``new_token`` is ``token``."""
    return f"ringcomm-{token}-{src}to{dst}"


def sweep(folder: str = SHM_DIR) -> list[str]:
    """Remove the rings in ``folder`` of processes that ended without removing them (killed,
    or torn down by a signal Python does not handle): only names of ``ring_name``'s pattern,
    owned by this user, whose creator is gone (``owner_gone``). Returns the names removed."""
    removed: list[str] = []
    uid = os.getuid()
    try:
        entries = os.scandir(folder)
    except OSError:
        return removed
    with entries:
        for entry in entries:
            m = _RING_NAME.fullmatch(entry.name)
            if m is None:
                continue
            try:
                if (not entry.is_file(follow_symlinks=False)
                        or entry.stat(follow_symlinks=False).st_uid != uid):
                    continue
            except OSError:
                continue
            if owner_gone(int(m[1]), m[2]):
                try:
                    os.unlink(entry.path)
                except OSError:  # another transport swept it first
                    continue
                removed.append(entry.name)
    return removed


_fence_lock = threading.Lock()
_take, _give = _fence_lock.acquire, _fence_lock.release


def fence() -> None:
    """A full memory barrier: taking a lock is an atomic read-modify-write instruction. Put
    between a store and a load that another process orders the other way round (each side
    raises a flag, then reads the other's), so that one of the two always sees the other.
    (Taken and given back by its bound methods: a ``with`` costs twice as much, on every
    post of the smallest calls.)"""
    _take()
    _give()


def stores_in_order() -> bool:
    """Whether stores become visible to other processes in program order (x86's TSO): what
    a flag written after the data it covers needs (mailboxes, the shared board). Elsewhere
    the flag could be seen before the data."""
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def available() -> bool:
    """Shared memory rings need a tmpfs at /dev/shm (Linux)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


Identity = tuple[int, int]  # (st_dev, st_ino): which file a name stood for
_made: dict[str, Identity] = {}  # names this process created, and the files it made
_made_lock = threading.Lock()


def _identity(info: os.stat_result) -> Identity:
    return info.st_dev, info.st_ino


def _refusal(path: str, info: os.stat_result, size: int) -> str | None:
    """Why the file ``info`` describes is not a peer's shared memory of ``size`` bytes that
    ringcomm made (None: it may be)."""
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link, not a file ringcomm made"
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file, so not one ringcomm made"
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        return (f"{path} is not this user's alone (owner uid {info.st_uid}, mode "
                f"{info.st_mode & 0o777:o}), so it is not a ring ringcomm made")
    if info.st_size != size:
        return f"{path} has a size of {info.st_size} B where ringcomm made {size} B"
    return None


def open_shared(path: str, size: int, create: bool) -> tuple[mmap.mmap, Identity]:
    """Map ``size`` bytes of the shared-memory file at ``path`` read-write, and say which
    file it is. ``create``: make it (this user's alone, 0600; ``O_EXCL``: never one made
    before, nor a link), else a peer's, which must be a regular file of this user's alone of
    exactly ``size`` bytes, not a link (a ``PermissionError`` otherwise: nothing else is
    opened; ``FileNotFoundError`` where there is none)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    if not create:
        why = _refusal(path, os.lstat(path), size)  # looked at before anything is opened
        if why is not None:
            raise PermissionError(errno.EPERM, why)
    fd = os.open(path, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        info = os.fstat(fd)
        if create:
            with _made_lock:
                _made[path] = _identity(info)
            # reserve the pages now: a full tmpfs then fails here, not with SIGBUS later
            os.posix_fallocate(fd, 0, size)
        else:  # the very file looked at, still as it was
            why = _refusal(path, info, size)
            if why is not None:
                raise PermissionError(errno.EPERM, why)
        return mmap.mmap(fd, size), _identity(info)
    except BaseException:
        if create:  # a ring that could not be made leaves no name behind
            remove_made(path)
        raise
    finally:
        os.close(fd)


def map_shared(path: str, size: int, create: bool) -> mmap.mmap:
    """``open_shared``'s mapping alone."""
    return open_shared(path, size, create)[0]


def _remove_if(path: str, identity: Identity | None) -> bool:
    """Remove the name ``path`` if it stands for the file ``identity`` (None: for a file of
    this user's that ringcomm could have made, 0600 and not a link). Only a process of this
    user could replace a file of this user's in /dev/shm (its sticky bit), so what is looked
    at is what goes."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if identity is not None:
        if _identity(info) != identity:
            return False
    elif not (stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
              and stat.S_IMODE(info.st_mode) == 0o600):
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def remove_made(path: str) -> None:
    """Remove the name of a file this process created at ``path``, if the name still
    stands for it (a reader removes it once it has mapped the file, and someone may have
    put another file under the same name since)."""
    with _made_lock:
        identity = _made.pop(path, None)
    if identity is not None:
        _remove_if(path, identity)


def remove_mapped(path: str, identity: Identity) -> None:
    """Remove a peer's name at ``path`` once its file ``identity`` is mapped here, if the
    name still stands for that file."""
    _remove_if(path, identity)


def remove_name(path: str) -> None:
    """Remove a name of ringcomm's at ``path`` at a transport's end, if it is still what was
    made under it: a file this process made, if it is still that file; a name it did not
    make (a peer's ring it never mapped), only if it is a file of this user's that ringcomm
    could have made. A file of another user's (planted by whoever read the name from the
    store) is never removed, even by root."""
    with _made_lock:
        made = path in _made
    if made:
        remove_made(path)
    else:
        _remove_if(path, None)


class RingWriter:
    """The sending end. Creates the shared file ``name`` in /dev/shm; the reader removes the
    name once it has mapped the file (``close`` does if it has not), and nothing opens the
    name again: a writer is made once per peer, and a reader maps once."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.path = shm_path(name)
        self._mm = map_shared(self.path, _CONTROL + capacity, create=True)
        self._tail = np.frombuffer(self._mm, np.int64, 1, 0)
        self._data = np.frombuffer(self._mm, np.uint8, capacity, _CONTROL)
        self._head = 0
        # the payload area's address and bytes here: what a device channel page-locks
        self.region = (self._data.ctypes.data, capacity)

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
        remove_made(self.path)

    def close(self) -> None:
        self.unlink()
        # the mapping goes with the last view; a closed ring is not used again
        self._tail = self._data = None  # type: ignore[assignment]


class RingReader:
    """The receiving end: maps the writer's file and removes its name (nothing else needs
    it, so a crash later leaves nothing behind in /dev/shm)."""

    def __init__(self, name: str, capacity: int) -> None:
        path = shm_path(name)
        self._mm, identity = open_shared(path, _CONTROL + capacity, create=False)
        remove_mapped(path, identity)
        self.capacity = capacity
        self._tail = np.frombuffer(self._mm, np.int64, 1, 0)
        self._data = np.frombuffer(self._mm, np.uint8, capacity, _CONTROL)
        self.region = (self._data.ctypes.data, capacity)  # see RingWriter

    def view(self, start: int, nbytes: int) -> np.ndarray:
        pos = start % self.capacity
        return self._data[pos: pos + nbytes]

    def release(self, start: int, nbytes: int) -> None:
        """Hand the payload at ``start`` (and any skipped bytes before it) back to the writer."""
        self._tail[0] = start + -(-nbytes // _ALIGN) * _ALIGN

    def close(self) -> None:
        # the mapping goes with the last view; a closed ring is not used again
        self._tail = self._data = None  # type: ignore[assignment]
