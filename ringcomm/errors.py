"""Typed errors, so callers can tell a slow peer from a dead one from a programming mistake.

Every error raised by a running collective names the rank that raised it and the op
(kind and sequence number) it was running, and says what to do next.
"""

from __future__ import annotations

from collections.abc import Callable


class CommError(RuntimeError):
    """Base class of every ringcomm error.

    ``rank`` is the rank that raised it, ``op`` a short description of the collective
    (``"allreduce #12"``) and ``peer`` the other rank involved, when there is one.
    """

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


class RankKilled(BaseException):
    """A rank that is a thread of a process shared with its peers (``ringcomm.runtime.local``)
    was killed by an injected fault (``ringcomm.faults``): its thread stops at once, as a
    process would die, and its peers see it gone. Not a ``CommError`` (not even an
    ``Exception``), so that nothing handles it as an op that failed and tells the peers."""
