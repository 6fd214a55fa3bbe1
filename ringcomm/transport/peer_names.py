"""Names read from a peer's link record: only the forms ringcomm makes, checked before use.

Why: a rank opens, writes and maps what its peers' records name (a folder of pipes and
doorbells, shared memory, ipc sockets), and those records come through the store, which
anyone may answer or write without a token. So nothing in a record is joined onto a path or
opened as it stands. A record is checked in two steps, and a failure is a ``RecordError``
naming the peer and the field, raised before anything the record names is opened:

- its *form*, when it is read (``Check``): every name is one a rank of this ringcomm makes
  (a token of ``shm_ring.new_token``'s form, a folder ``<...>/ringcomm-<uid>/<pid>-<pid
  namespace>-<random>`` written plainly, with no ``..``, ``.`` or doubled separator, an
  ``ipc://`` address of a socket in such a folder, a ``tcp://host:port``, a positive whole
  number of bytes), and shared memory is named only in its checked form
  (``shm_ring.shm_path``);
- what is *on disk*, when it is about to be used: both folders are this user's own, 0700,
  and not symbolic links (``lstat``), and a pipe or a doorbell is a FIFO of this user's
  (``lstat``, then opened with ``O_NOFOLLOW`` and checked again with ``fstat``:
  ``pipe.open_fifo``); a peer's shared memory is a regular file of this user's alone, of
  the size expected (``shm_ring.open_shared``).

A folder anywhere in the file system is accepted if it is this user's ringcomm folder there
(ranks of one host may have another ``TMPDIR`` each): nobody else can make a folder of this
user's, and nothing a rank opens there but FIFOs of this user's.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import PeerLostError, RecordError
from . import files, pipe, shm_ring

MAX_RING_BYTES = 1 << 40  # far above any ring a rank makes, far below what breaks a size
_IPC = re.compile(r"ipc://(/.+)/(\d{1,7})")
_TCP = re.compile(r"tcp://([A-Za-z0-9._%:\[\]-]{1,255}):(\d{1,5})")  # a host: names no file
_SHOWN = 120  # characters of a refused value that an error quotes


def folder_form(path: Any) -> str | None:
    """Why ``path`` is not written as ringcomm writes a transport's folder (None: it is)."""
    if not isinstance(path, str):
        return f"is a {type(path).__name__}, not a folder's path"
    if not os.path.isabs(path) or "\0" in path:
        return "is not an absolute path"
    if os.path.normpath(path) != path or ".." in path.split("/"):
        return "is not written as ringcomm writes a folder (with no '..', '.' or '//')"
    parent, name = os.path.split(path)
    if os.path.basename(parent) != f"ringcomm-{os.getuid()}":
        return f"is not in a ringcomm-{os.getuid()} folder (this user's)"
    if not files.valid_ipc_dir_name(name):
        return "is not named as ringcomm names a rank's folder (<pid>-<namespace>-<random>)"
    return None


class Check:
    """The checks of the record of rank ``peer``, as read by rank ``rank``: each returns the
    value it checked, or raises a ``RecordError`` naming the peer, the field and why."""

    def __init__(self, rank: int, peer: int) -> None:
        self.rank = rank
        self.peer = peer

    def refuse(self, field: str, value: Any, why: str) -> RecordError:
        shown = repr(value)
        if len(shown) > _SHOWN:
            shown = shown[:_SHOWN - 3] + "..."
        return RecordError(
            f"rank {self.peer}'s link record: {field} = {shown} {why}. No rank of ringcomm "
            "writes that, so whoever wrote it is not a rank of this group (a store this job "
            "did not start answers at its address, or someone rewrote its keys); nothing it "
            "names was opened. Give every rank RINGCOMM_AUTH_TOKEN, and let rank 0 serve the "
            "store (RINGCOMM_STORE=serve)", rank=self.rank, peer=self.peer)

    def gone(self, field: str, path: str) -> PeerLostError:
        """What a name of a well-formed record that is not on disk means: the peer removes
        its folder as it fails, so it left the set-up (nothing was opened)."""
        return PeerLostError(
            f"rank {self.peer}'s {field} names {path}, which is gone: rank {self.peer} left "
            "the set-up (a rank removes its folder as it fails or is killed) before this rank "
            "opened its links, and its own error says why; or whoever wrote its record named "
            "a folder that never was (nothing was opened)", rank=self.rank, peer=self.peer)

    def mapping(self, field: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.refuse(field, value, f"is a {type(value).__name__}, not an object")
        return value

    def token(self, field: str, value: Any) -> str:
        if not isinstance(value, str) or not shm_ring.valid_token(value):
            raise self.refuse(field, value, "is not a token of the form ringcomm makes "
                                            "(<pid>-<namespace>-<12 hex digits>)")
        return value

    def size(self, field: str, value: Any, most: int = MAX_RING_BYTES) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= most:
            raise self.refuse(field, value, f"is not a whole number of bytes from 1 to {most}")
        return value

    def folder(self, field: str, value: Any, owner: str | None = None) -> str:
        """A transport's folder; ``owner``: the ``<pid>-<namespace>`` its name must start
        with (the peer's, from its token)."""
        why = folder_form(value)
        if why is None and owner is not None \
                and not os.path.basename(value).startswith(f"{owner}-"):
            why = f"is not named for the process of its token ({owner})"
        if why is not None:
            raise self.refuse(field, value, why)
        return str(value)

    def endpoint(self, field: str, value: Any) -> str:
        """A ZeroMQ address: ``ipc://`` of a socket in a transport's folder, or
        ``tcp://host:port``."""
        if isinstance(value, str):
            ipc = _IPC.fullmatch(value)
            if ipc is not None:
                why = folder_form(ipc[1])
                if why is None:
                    return value
                raise self.refuse(field, value, f"names a folder that {why}")
            tcp = _TCP.fullmatch(value)
            if tcp is not None and 0 < int(tcp[2]) < 65536:
                return value
        raise self.refuse(field, value, "is not an address of the form ringcomm makes "
                                        "(ipc://<its folder>/<rank> or tcp://<host>:<port>)")

    def endpoints(self, field: str, value: Any, least: int = 1, most: int = 2) -> list[str]:
        if not isinstance(value, list) or not least <= len(value) <= most:
            raise self.refuse(field, value, f"is not a list of {least} to {most} addresses")
        return [self.endpoint(f"{field}[{i}]", e) for i, e in enumerate(value)]

    # ----------------------------------------------------------------- on disk
    def folder_on_disk(self, field: str, folder: str) -> None:
        """``folder`` (checked by ``folder``) and its ``ringcomm-<uid>`` parent are this
        user's own folders, 0700, not symbolic links."""
        for path in (os.path.dirname(folder), folder):
            try:
                why = files.folder_refusal(path, os.lstat(path))
            except FileNotFoundError:
                if path != folder:  # the user's ringcomm folder stays; a rank's own goes
                    raise self.refuse(field, folder, f"is refused: {path} does not exist"
                                      ) from None
                raise self.gone(field, path) from None
            except OSError as err:
                why = f"{path} cannot be looked at ({err.strerror})"
            if why is not None:
                raise self.refuse(field, folder, f"is refused: {why}")

    def fifo_on_disk(self, field: str, folder: str, name: str) -> str:
        """The path of the FIFO ``name`` in ``folder``, once the folder passes
        ``folder_on_disk`` and the name is a FIFO of this user's, not a link."""
        self.folder_on_disk(field, folder)
        path = os.path.join(folder, name)
        try:
            why = pipe.fifo_refusal(path, os.lstat(path))
        except FileNotFoundError:
            raise self.gone(field, path) from None
        except OSError as err:
            why = f"{path} cannot be looked at ({err.strerror})"
        if why is not None:
            raise self.refuse(field, folder, f"is refused: {why}")
        return path

    def endpoint_on_disk(self, field: str, endpoint: str) -> None:
        """An ``ipc://`` address (checked by ``endpoint``) is in a folder that passes
        ``folder_on_disk``; a ``tcp://`` one names no file."""
        ipc = _IPC.fullmatch(endpoint)
        if ipc is not None:
            self.folder_on_disk(field, ipc[1])
