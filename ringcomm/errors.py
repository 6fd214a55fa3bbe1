"""Typed errors, so callers can tell a slow peer from a dead one from a programming mistake.

Every error raised by a running collective names the rank that raised it and the op
(kind and sequence number) it was running, and says what to do next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CommError(RuntimeError):
    """Base class of every ringcomm error.

    ``rank`` is the rank that raised it, ``op`` a short description of the collective
    (``"allreduce #12"``) and ``peer`` the other rank involved, when there is one.
    ``progress`` says where the op stood when it failed (an ``OpProgress`` of
    ``ringcomm.engines.progress``: step, peer waited for, messages done), and ``report`` is
    the hang report of an op that timed out (a ``HangReport`` of
    ``ringcomm.runtime.hang_report``; on rank 0, every rank's state and who is behind);
    both None where there is none.
    """

    progress: Any = None  # typed loosely: this module sits below the layers that make them
    report: Any = None

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        op: str | None = None,
        peer: int | None = None,
    ) -> None:
        self.rank = rank
        self.op = op
        self.peer = peer
        self.detail = message
        where = []
        if rank is not None:
            where.append(f"rank {rank}")
        if op is not None:
            where.append(op)
        prefix = f"[{', '.join(where)}] " if where else ""
        super().__init__(prefix + message)

    def __reduce__(self) -> tuple[Callable[..., CommError], tuple[object, ...]]:
        # keep the fields when an error crosses a process boundary
        return (_rebuild, (type(self), self.detail, self.rank, self.op, self.peer))


def _rebuild(cls: type[CommError], detail: str, rank: int | None, op: str | None,
             peer: int | None) -> CommError:
    return cls(detail, rank=rank, op=op, peer=peer)


class CommTimeout(CommError, TimeoutError):
    """An op did not finish within its timeout: a peer is slow, stuck, or calls a different op."""


class PeerLostError(CommError):
    """A peer's connection closed while this rank still needed it (the peer died or closed)."""


class DesyncError(CommError):
    """Ranks disagree about the op: different collectives, order, dtype, size or root."""


class RemoteError(CommError):
    """Another rank failed during the op and told this rank so; the message carries its error."""


class CommAborted(CommError):
    """The communicator was aborted by an earlier failure; create a new one to go on."""


class StoreError(CommError):
    """The rendezvous store failed: unreachable, gone, or refused a request."""


class StoreTimeout(StoreError, TimeoutError):
    """Keys did not appear in the store within the timeout."""


class ArgumentError(CommError, ValueError):
    """Bad input caught before anything was sent: wrong dtype, shape, op, rank or size."""


class ChecksumError(CommError):
    """A message or board post arrived with a payload whose checksum does not match: it was
    corrupted on the way (``RINGCOMM_CHECKSUM=1``). Names the link (from rank X to rank Y),
    the op and the message."""


class AuthError(CommError):
    """A store or a peer refused this rank's credentials, or this rank refused theirs: the
    ranks do not hold the same ``RINGCOMM_AUTH_TOKEN`` (or one of them has none)."""


class RecordError(AuthError):
    """A peer's link record, read from the store, names something a rank of this ringcomm
    never names: a folder that is not this user's own 0700 ringcomm folder, a name with a
    separator or ``..`` in it, a symbolic link, a pipe that is not a FIFO of this user, shared
    memory under a name of another form, an address of another shape, a size that is not a
    positive whole number. Ranks build every such name from a few fixed patterns, so a record
    that breaks one was written by someone else: whoever answers on the store's port (a
    store this job did not start) or rewrote a key of a store without a token. The rank
    refuses it before it opens anything the record names; the error names the peer whose
    record it was and the field (``kinds.local.dir``, ``board.name``...).

    An ``AuthError``, because it is the same refusal of a party this rank cannot trust, with
    the same cure: set ``RINGCOMM_AUTH_TOKEN`` on every rank, and have rank 0 serve the store
    (``RINGCOMM_STORE=serve`` refuses a store it did not start). Not a ``DesyncError`` (ranks
    of different versions are told apart by the record's version, checked first) and not
    an ``ArgumentError`` (the caller did nothing wrong); a retry does not help."""


class RankKilled(BaseException):
    """A rank that is a thread of a process shared with its peers (``ringcomm.runtime.local``)
    was killed by an injected fault (``ringcomm.faults``): its thread stops at once, as a
    process would die, and its peers see it gone. Not a ``CommError`` (not even an
    ``Exception``), so that nothing handles it as an op that failed and tells the peers."""
