"""No litter, even after a crash: what a transport leaves on the file system, and the sweep.

A transport's files are its ipc folder (``<tmp>/ringcomm-<uid>/<pid>-<pid namespace>-<random>``:
its named pipes, doorbells and ipc sockets; the folders 0700 and every file in them 0600, so
no other user can open, connect to or swap them) and the names of its shared-memory rings
(``shm_ring``). Each name is needed only until the other end has opened it: the folder goes
as soon as every peer of the host has (``settled``, at the end of set-up), and a ring's name
as soon as its reader has mapped it; open pipes, mapped memory and connected ipc sockets
work on without their names. So from then on a rank that dies, by SIGKILL or ``os._exit``
too, leaves nothing but the name of a ring it had just created and its reader had not yet
mapped.

What is still there when the transport ends (a set-up that failed, a ring never read) goes at
``close``, or from a finalizer when the transport is garbage-collected or still open at
interpreter exit (a program that never calls ``close`` or ``destroy_process_group``, or ends
in an exception); a name in /dev/shm goes only while it is still the file ringcomm made
under it (``shm_ring.remove_name``: a file another user put there is left). A process
that dies without running Python's exit hooks before that point (during set-up, say)
cannot remove it: the next transport set up on the host
(``sweep_litter``) removes the files whose owner pid, which their names carry, has ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile

import zmq

from ..errors import ArgumentError
from . import shm_ring

log = logging.getLogger("ringcomm")


def ipc_base() -> str:
    """The folder of this user's ipc folders: ``<tmp>/ringcomm-<uid>``."""
    return os.path.join(tempfile.gettempdir(), f"ringcomm-{os.getuid()}")


def folder_refusal(path: str, info: os.stat_result, mode: bool = True) -> str | None:
    """Why the file ``info`` (``lstat``'s) describes is not a folder of this user's alone
    (None: it is one): a symbolic link, not a folder, another user's, or (with ``mode``)
    one that others may enter (not 0700)."""
    if stat.S_ISLNK(info.st_mode):
        try:
            target = f" (to {os.readlink(path)})"
        except OSError:
            target = ""
        return f"{path} is a symbolic link{target}, not a folder of this user's"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a folder"
    if info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not this user ({os.getuid()})"
    if mode and stat.S_IMODE(info.st_mode) != 0o700:
        return f"{path} has mode {stat.S_IMODE(info.st_mode):o}, not 0700"
    return None


def private_folder(path: str) -> str:
    """Make ``path`` (if missing) a folder that only this user can enter (0700), and check
    that it is one: a real folder, not a symbolic link, owned by this user. Another user who
    made it first (in a shared temp dir) could otherwise swap the files ringcomm puts in it;
    that is an ``ArgumentError`` saying what to do (and the link or folder is left as it
    is). Returns ``path``."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    why = folder_refusal(path, info, mode=False)
    if why is not None:
        raise ArgumentError(f"{why}: ringcomm keeps its pipes and sockets there and will not "
                            "trust it; remove it, or point TMPDIR elsewhere")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def bind_private(sock: zmq.Socket, endpoint: str) -> None:
    """Bind ``sock`` to an ``ipc://`` ``endpoint`` and make its file this user's alone
    (0600), like the pipes beside it (ZeroMQ creates it as the umask says)."""
    sock.bind(endpoint)
    os.chmod(endpoint.removeprefix("ipc://"), 0o600)


# an ipc folder: tempfile.mkdtemp(prefix=f"{shm_ring.owner_tag()}-") in ipc_base()
_IPC_DIR_NAME = re.compile(r"(\d+)-([0-9a-f]+)-[a-z0-9_]+")


def valid_ipc_dir_name(name: str) -> bool:
    """Whether ``name`` is one that ringcomm gives a transport's ipc folder."""
    return _IPC_DIR_NAME.fullmatch(name) is not None


def sweep_ipc_dirs(base: str) -> list[str]:
    """Remove the ipc folders in ``base`` whose owner has ended (``shm_ring.owner_gone``):
    only folders named like ours, in a ``base`` that is this user's own folder."""
    removed: list[str] = []
    try:
        info = os.lstat(base)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return removed
        entries = os.scandir(base)
    except OSError:
        return removed
    with entries:
        for entry in entries:
            m = _IPC_DIR_NAME.fullmatch(entry.name)
            try:
                if m is None or not entry.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            if shm_ring.owner_gone(int(m[1]), m[2]):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def sweep_litter() -> list[str]:
    """Remove what transports of processes that have ended left on this host: ipc folders
    in ``ipc_base()`` and shared-memory rings in /dev/shm, each named with its owner's pid.
    Only names of ringcomm's own patterns are touched, and only where the owner has ended;
    a pid that an unrelated live process has taken over since just delays the sweep until
    that process ends too (see ``shm_ring.owner_gone``). Never raises; returns the paths
    removed. Every transport runs it as it starts."""
    try:
        removed = [os.path.join(shm_ring.SHM_DIR, name) for name in shm_ring.sweep()]
        removed += sweep_ipc_dirs(ipc_base())
    except Exception as err:  # noqa: BLE001 - a clean-up must never stop a set-up
        log.debug("sweeping files of ended processes failed: %s", err)
        return []
    if removed:
        log.info("removed %d files that ended ringcomm processes left behind: %s",
                 len(removed), ", ".join(removed))
    return removed


class TransportFiles:
    """What a transport has on the file system: its ipc folder (until ``settled``) and the
    names of the rings to and from its local peers. ``remove`` runs from ``close``, or from a
    ``weakref.finalize`` when the transport is garbage-collected or still open at interpreter
    exit (the finalizer's ``atexit``), whichever comes first, and only once. It holds no
    reference to the transport, so the finalizer does not keep the transport alive; it only
    unlinks and removes names (no socket, no thread), so it cannot hold up an exit."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.ipc_dir: str | None = None
        self.shm_paths: list[str] = []

    def settled(self) -> None:
        """Every peer has opened what is in the ipc folder: remove it now (what is open
        stays usable), so that not even a SIGKILL leaves it behind."""
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def remove(self) -> None:
        if os.getpid() != self.pid:  # a forked child exiting: the files are its parent's
            return
        for path in self.shm_paths:  # the rings' memory lives on while mapped
            shm_ring.remove_name(path)  # only what ringcomm made under the name
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
