"""The shared board: collectives among the ranks of one host, through memory they all map,
with no message at all.

Why: over links a small allreduce costs every rank one message per round (a header, a pipe
write, a wake-up, a read, a header check), ``log2 n`` rounds or more, and at a few bytes
that is all its time; a large one pays a message per segment and step. On the board each
rank copies its part into its own slot and reads the others' straight from theirs: no
system call while ranks keep pace, and what each rank reads it reads from the same posts,
so folds in rank order give every rank the same bits. MPICH's shared-memory collectives do
the same for the same reason.

The protocol, for the ``k``-th post of every rank (all ranks run the same board ops in the
same order, and an op makes the same number of posts on every rank, so their ``k`` agree):

- a rank writes its header (the op descriptor, as a message would carry it, with the post's
  number within the op as its ``index``; the same bytes on every rank, as the slot says
  who posted) and its payload into its slot ``k % 2``, then
  stores ``k`` as its ``posted`` count. Stores become visible in program order (x86's TSO,
  ``shm_ring.stores_in_order``), so a reader that sees ``posted >= k`` sees the slot filled;
- a reader waits until the poster's ``posted >= k``, compares the header with its own
  (one comparison of bytes; ``DesyncError`` naming both ranks and what differs otherwise)
  and reads the payload, or part of it, in place;
- each rank has two slots, so a rank may run one post ahead of the slowest: it writes slot
  ``k % 2`` again at post ``k + 2`` only once every peer has posted ``k + 1``, which each
  does only after it has finished reading post ``k``;
- a rank whose op fails after it posted *withdraws* its latest post: its header becomes an
  abort's (the payload stays, so a peer that is reading it reads it whole), and a peer that
  has not taken it yet raises instead of completing an op this rank did not.

An op may make several posts (a large allreduce posts each piece, then its share of the
result); a post may put its payload at an element of the slot other than the first, and a
take may read part of a post.

Waiting (spinning, then sleeping until a poster wakes the sleeper) belongs to the transport,
which also watches the links meanwhile for a lost peer, an abort or a message that shows
the ranks disagree; the board only says who has posted and who sleeps.

Layout: per rank a 64-byte line (``posted``, ``sleeping``), then two slots, each a 64-byte
line holding the header and ``SLOT_BYTES`` of payload: about 2 MiB a rank, reserved when
the board is made (so that a full ``/dev/shm`` shows at set-up, not as a fault mid-op).

The one-shot round of the smallest allreduces (``Board.round_whole``) has its fast case in
C as well (``_board_round.c``, built at install where there is a C compiler;
``RINGCOMM_BOARD_COMPILED=0`` turns it off): it is the one place where interpreting each
step costs more than the step, about a quarter of a small allreduce through torch.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import numpy as np

from ..core import config
from ..core.dtypes import ReduceOp, finish_reduction
from .header import CHECKSUM_AT, Header, OpKind
from .header import SIZE as HEADER_SIZE
from .shm_ring import fence, stores_in_order

SLOT_BYTES = 1 << 20  # the largest payload one post holds; larger ops post in pieces
_LINE = 64
_SLOT = _LINE + SLOT_BYTES
_RANK_BYTES = _LINE + 2 * _SLOT
_WORD = struct.Struct("<Q")


try:
    from . import _board_round as _compiled
except ImportError:  # installed where no C compiler was found: the round is Python's alone
    _compiled = None  # type: ignore[assignment]
if _compiled is not None and (_compiled.LINE, _compiled.SLOT_BYTES, _compiled.HEADER_SIZE) \
        != (_LINE, SLOT_BYTES, HEADER_SIZE):
    raise ImportError(f"{_compiled.__file__} was built for another board layout than "
                      "board.py's: rebuild it (pip install -e . in ringcomm's checkout)")

def compiled_round() -> str | None:
    """The file of the round's compiled fast case (``_board_round.c``), None where the
    install built none."""
    return None if _compiled is None else _compiled.__file__


# What a take of a whole post does with it (``WholeTake``): copy it over this rank's data,
# fold it in after the data's part (``data (op) post``), or before it (``post (op) data``:
# the post's rank comes before every rank the data holds so far). Every rank folds the parts
# in rank order so that all get the same bits: a fold is not always symmetric in its bits
# (numpy's complex product; which NaN a sum keeps).
COPY, FOLD, FOLD_BEFORE = 0, 1, 2
# a take of a whole post (``Board.round_whole``): (peer, ``COPY``, ``FOLD`` or
# ``FOLD_BEFORE``, whether that completes the reduction)
WholeTake = tuple[int, int, bool]


class RoundHooks(Protocol):
    """What ``Board.round_whole`` asks of the channel around it, only when it must: wait for
    a post, explain a header that differs, wake sleeping peers."""

    wakes_by_flag: bool  # a sleeper raises its flag (``doze``); else wake after every post
    quick_turns: int  # how often a wait yields the core before it is the channel's to do

    def _wait(self, peer: int, number: int, op: str, deadline: float, header: bytes) -> None: ...

    def _disagrees(self, peer: int, header: bytes, op: str) -> None: ...

    def _posted(self) -> None: ...


def fold_whole(data: np.ndarray, post: np.ndarray, does: int, final: bool,
               reduce: ReduceOp | None, world_size: int) -> None:
    """What a whole take (``WholeTake``) does with ``post``: reduce it into ``data``, after
    or before the data's part (the reduction's last finishing it: ``avg`` divides), or copy
    it over ``data``."""
    if does:
        assert reduce is not None
        if does == FOLD_BEFORE:
            reduce.ufunc(post, data, out=data)
        else:
            reduce.ufunc(data, post, out=data)
        if final and reduce.divides:
            finish_reduction(data, reduce, world_size)
    else:
        np.copyto(data, post)


def size(world_size: int) -> int:
    """Bytes of the board of ``world_size`` ranks."""
    return world_size * _RANK_BYTES


def wanted() -> bool:
    """Whether this rank offers to use a board: ``RINGCOMM_BOARD`` (default on), where
    stores become visible in order. A group uses one only if every rank offers."""
    return bool(config.value("board")) and stores_in_order()


class Board:
    """Rank ``rank``'s view of a board of ``world_size`` ranks in ``memory`` (a writable
    buffer of ``size(world_size)`` bytes: shared memory, or a bytearray for ranks that are
    threads of one process)."""

    def __init__(self, memory: Any, rank: int, world_size: int) -> None:
        if len(memory) < size(world_size):
            raise ValueError(f"a board of {world_size} ranks needs {size(world_size)} B, "
                             f"got {len(memory)} B")
        self._mem = memoryview(memory).cast("B")
        self._raw = memory  # slicing an mmap or a bytearray copies out bytes, cheaply
        self._bytes = np.frombuffer(memory, np.uint8)  # not of _mem: that one is released
        self.rank = rank
        self.world_size = world_size
        self.number = 0  # posts this rank has made: the one it is in
        self._mine = rank * _RANK_BYTES
        self._peers = [peer for peer in range(world_size) if peer != rank]
        self._typed: dict[tuple[np.dtype, int, int], tuple[list[np.ndarray], ...]] = {}
        # the round's fast case in C (``round_whole``), unless not built or turned off
        self._compiled = _compiled.round_whole if _compiled is not None \
            and config.value("board_compiled") else None

    def posted(self, peer: int) -> int:
        """How many posts ``peer`` has made."""
        return _WORD.unpack_from(self._mem, peer * _RANK_BYTES)[0]

    def behind(self) -> list[int]:
        """The peers that have not yet made this rank's last post: a new post would
        overwrite the slot they may still be reading."""
        number, posted = self.number, self.posted
        for peer in self._peers:  # the common case (none) without building a list
            if posted(peer) < number:
                return [p for p in self._peers if posted(p) < number]
        return []

    def post(self, header: bytes, payload: np.ndarray | None, at: int = 0) -> None:
        """Make the next post: ``header`` (packed) and ``payload`` (None for none) from
        element ``at`` of the slot on, then the count that shows them. Call once ``behind``
        is empty."""
        number = self.number + 1
        start = self._mine + _LINE + (number % 2) * _SLOT
        self._mem[start: start + HEADER_SIZE] = header
        if payload is not None:
            values = payload if payload.ndim == 1 else payload.reshape(-1)
            dtype, count = values.dtype, values.size
            views = self._typed.get((dtype, count, at)) or self._views(dtype, count, at)
            views[number % 2][self.rank][...] = values
        _WORD.pack_into(self._mem, self._mine, number)  # last: x86 keeps the store order
        self.number = number

    def round_whole(self, header: bytes, data: np.ndarray, takes: tuple[WholeTake, ...],
                    reduce: ReduceOp | None, deadline: float, op: str,
                    hooks: RoundHooks) -> None:
        """One post of all of ``data`` (1-d) with ``header``, then ``takes`` of whole posts of
        the same size, each reduced into ``data`` (the last of a reduction finishing it:
        ``avg`` divides) or copied over it: the one-shot allreduce, ``behind``, ``post``,
        ``posted``, ``matches`` and ``payload`` run together where the smallest calls spend
        their time, the board read straight from memory. ``hooks`` (the channel) is called
        only for a post not there yet, a header that differs (``_disagrees`` raises, or
        returns to take the post after all) and peers that sleep. The local ``step`` says
        where a failure left the round: 0 the post, ``k`` the ``k``-th take.

        Its fast case runs in C where that is built (``_board_round.c``): the same post,
        quick waits (``hooks.quick_turns`` yields of the core), header checks and folds of
        the commonest dtypes and ops, a few hundred nanoseconds where this takes a few
        microseconds. It stops at the first step that needs more (a peer still behind, a
        header that differs, a fold it does not do, a sleeping peer to wake) and says
        which: the rest is done here, as it is without C."""
        mem, unpack_from, peers = self._mem, _WORD.unpack_from, self._peers
        step, number = 0, self.number
        compiled = self._compiled
        done = -1 if compiled is None else compiled(
            self._bytes, self.rank, self.world_size, number, header, data, takes,
            -1 if reduce is None else reduce.code, hooks.quick_turns, hooks.wakes_by_flag)
        if done >= 0:  # posted in C (number + 1), and the takes before ``first`` done
            number = self.number = number + 1
            first = done >> 1
            if done & 1:
                hooks._posted()
            if first == len(takes):
                return
            parity = number % 2
            key = (data.dtype, data.size, 0)
            views = (self._typed.get(key) or self._views(data.dtype, data.size))[parity]
        else:
            first = 0
            for peer in peers:  # every peer has taken this rank's last post (``behind``)
                if unpack_from(mem, peer * _RANK_BYTES)[0] < number:
                    hooks._wait(peer, number, op, deadline, header)
            number += 1
            parity = number % 2
            start = self._mine + _LINE + parity * _SLOT
            mem[start: start + HEADER_SIZE] = header
            key = (data.dtype, data.size, 0)
            views = (self._typed.get(key) or self._views(data.dtype, data.size))[parity]
            views[self.rank][...] = data
            _WORD.pack_into(mem, self._mine, number)  # last: x86 keeps the store order
            self.number = number
            if hooks.wakes_by_flag:
                fence()  # the count is stored before any flag is read
                for peer in peers:
                    if unpack_from(mem, peer * _RANK_BYTES + 8)[0]:
                        hooks._posted()
                        break
            else:
                hooks._posted()
        raw, world_size = self._raw, self.world_size
        ufunc = None if reduce is None or reduce.divides else reduce.ufunc  # needs no finish
        for step, (peer, does, final) in enumerate(takes[first:], first + 1):  # noqa: B007
            line = peer * _RANK_BYTES
            if unpack_from(mem, line)[0] < number:
                hooks._wait(peer, number, op, deadline, header)
            at = line + _LINE + parity * _SLOT
            if raw[at: at + HEADER_SIZE] != header:
                hooks._disagrees(peer, header, op)
            if does == FOLD and ufunc is not None:  # ``fold_whole``'s commonest, without a call
                ufunc(data, views[peer], out=data)
            else:
                fold_whole(data, views[peer], does, final, reduce, world_size)

    def withdraw(self) -> None:
        """Withdraw this rank's latest post (its op failed): its header becomes an abort's,
        so no take accepts it; its payload and count stay as they are."""
        start = self._mine + _LINE + (self.number % 2) * _SLOT
        self._mem[start: start + HEADER_SIZE] = Header.control(OpKind.ABORT, 0,
                                                               self.rank).pack()

    def lose_post(self) -> None:
        """Count the next post as made without writing it or showing its count: what a post
        lost on the way looks like to its peers (``ringcomm.faults``' drop). The post after
        shows this one's count too, and the slot it would have filled still holds an older
        post, whose header no take accepts."""
        self.number += 1

    def slot(self, peer: int, number: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the payload part of the slot of ``peer``'s post
        ``number``, in place: for a checksum over a post, which may start anywhere in it."""
        start = self._slot(peer, number) + _LINE
        return self._mem[start: start + nbytes]

    def checksum(self, peer: int) -> int:
        """The checksum field of the header of ``peer``'s post numbered as this rank's
        latest (whatever the slot holds: a take compares the rest)."""
        return _WORD.unpack_from(self._mem, self._slot(peer) + CHECKSUM_AT.start)[0]

    def header(self, peer: int, number: int | None = None) -> Header:
        """The header of ``peer``'s post ``number`` (default: the number of this rank's
        latest post), once it has made it, with ``peer`` as its sender."""
        return Header.unpack_from(self._mem, self._slot(peer, number))._replace(sender=peer)

    def matches(self, peer: int, header: bytes) -> bool:
        """Whether ``peer``'s post numbered as this rank's latest carries ``header``
        (packed): one slice of bytes compared, where unpacking and comparing takes several
        times as long on every take."""
        at = peer * _RANK_BYTES + _LINE + (self.number % 2) * _SLOT
        return self._raw[at: at + HEADER_SIZE] == header

    def payload(self, peer: int, dtype: np.dtype, count: int, at: int = 0) -> np.ndarray:
        """``count`` elements of ``dtype`` from element ``at`` of ``peer``'s current post, in
        place (valid until this rank's next post, after which the peer may overwrite it)."""
        views = self._typed.get((dtype, count, at)) or self._views(dtype, count, at)
        return views[self.number % 2][peer]

    def _views(self, dtype: np.dtype, count: int, at: int = 0) -> tuple[list[np.ndarray], ...]:
        """Elements ``at:at + count`` of every rank's slot, as ``dtype``, for each parity of
        post numbers: made on first use (callers look in ``_typed`` first, the quick way)."""
        if (at + count) * dtype.itemsize > SLOT_BYTES:
            raise ValueError(f"a board post holds at most {SLOT_BYTES} B; elements "
                             f"{at}:{at + count} of {dtype} lie beyond it")
        if at:  # a part of the whole slot's views
            whole = SLOT_BYTES // dtype.itemsize
            slots = self._typed.get((dtype, whole, 0)) or self._views(dtype, whole)
            views = tuple([rank[at: at + count] for rank in parity] for parity in slots)
        else:
            nbytes = count * dtype.itemsize

            def of(parity: int) -> list[np.ndarray]:
                starts = (p * _RANK_BYTES + _LINE + parity * _SLOT + _LINE
                          for p in range(self.world_size))
                return [self._bytes[start: start + nbytes].view(dtype) for start in starts]

            views = (of(0), of(1))
        self._typed[(dtype, count, at)] = views
        while len(self._typed) > 256:  # many sizes: keep the latest
            del self._typed[next(iter(self._typed))]
        return views

    def _slot(self, peer: int, number: int | None = None) -> int:
        parity = (self.number if number is None else number) % 2
        return peer * _RANK_BYTES + _LINE + parity * _SLOT

    def sleeping(self, peer: int) -> bool:
        """Whether ``peer`` sleeps waiting for a post (a poster then wakes it). Read after a
        ``fence``: the poster's count is stored before this is loaded."""
        return bool(_WORD.unpack_from(self._mem, peer * _RANK_BYTES + 8)[0])

    def doze(self, sleeping: bool) -> None:
        """Say whether this rank is about to sleep. Raising the flag is followed by a fence,
        so that either the rank sees a post made meanwhile when it looks once more, or the
        poster sees the flag and wakes it."""
        _WORD.pack_into(self._mem, self._mine + 8, int(sleeping))
        if sleeping:
            fence()

    def close(self) -> None:
        """Let go of the memory (a closed board is not used again)."""
        self._bytes = self._raw = None  # type: ignore[assignment]
        self._typed.clear()
        self._mem.release()
