"""Collectives on the shared board, among the ranks of one host.

Every rank posts its vector on the board (``ringcomm.transport.board``) and takes what it
needs straight from the other ranks' posts: one copy in, one read of each part, and no
message, where a tree or a ring pays a message (a system call and a wake-up) per round.
In the one-shot ways below each rank reads all ``n`` parts, ``n`` times the bytes a ring
reads, which is why only small messages go those ways; a larger allreduce goes two-shot.

*Allreduce* (one-shot): every rank folds the parts in rank order, ``((x0 op x1) op x2)
...``, so every rank gets the same bits whatever the rounding. Ranks 0 and 1 start from
their own part and fold in the other of the two (the ops are commutative: ``x1 op x0`` is
``x0 op x1``); every other rank starts from a copy of rank 0's part and folds in the rest,
its own part from the board, where it is the same as in its buffer.

*Two-shot allreduce* (larger messages, which ``n`` reads of everything would make dear):
the vector goes in pieces of at most one post. For each piece every rank posts it (ranks 0
and 1 all of it but their own chunk, which their fold starts from in place), then reduces
its own share of it (a chunk) from everyone's post, folding in rank order as above, posts
that share of the result and takes every other rank's share: a reduce-scatter
and an all-gather through memory, each rank reading about ``2x`` the vector where the
one-shot reads ``n x``. Each element is reduced by one rank only, so every rank still gets the
same bits. (The one-shot and two-shot names are those of the custom all-reduce kernels that
do the same over NVLink.)

*Broadcast*: the root posts its vector, every other rank posts its header alone; each rank
takes the root's post (copying it in) and checks every other rank's header, so that ranks
that disagree about the root (or the size) find out in the op itself, where a root that only
sends over links cannot.

*All-gather*: every rank posts its block and takes every rank's post (its own too) into
its place in ``output``.

*Barrier*: every rank posts nothing and takes every other's post: none leaves before all
have arrived.
"""

from __future__ import annotations

from functools import lru_cache

from ..core.partition import Partition
from .schedule import Region, Schedule, StepList

DATA = "data"
SMALL_BYTES = 64 << 10  # broadcasts, all-gathers: up to this a rank posts its whole part


def one_shot_bytes(world_size: int) -> int:
    """Up to this many bytes an allreduce of ``world_size`` ranks reads everyone's post (one
    round); above, it goes two-shot (two rounds, each rank reading about twice the vector).
    Where every rank reads ``n`` parts the one-shot costs more with every rank, so the
    switch comes earlier in larger groups. Measured on two cores (float32; the two ways
    timed in turns): at 2 and 3 ranks the one-shot is ahead up to 512 KiB, at 4 up to 128
    KiB. Larger groups were not measured here; they keep the 64 KiB the board's small
    collectives use, where the one-shot's ``n`` reads are at most 64 KiB each."""
    return 512 << 10 if world_size <= 3 else 128 << 10 if world_size == 4 else 64 << 10


@lru_cache(maxsize=512)
def allreduce(rank: int, world_size: int, count: int) -> Schedule:
    """``data`` (``count`` elements) reduced across ranks through the board."""
    steps = StepList()
    data = Region(DATA, 0, count)
    steps.post(data, phase="post")
    if rank < 2:
        parts = [1 - rank, *range(2, world_size)][: world_size - 1]
    else:
        steps.take(0, data, phase="fold")
        parts = list(range(1, world_size))
    for i, peer in enumerate(parts):
        steps.take_reduce(peer, data, data, final=i == len(parts) - 1, phase="fold",
                          round=i + 1)
    return steps.build("allreduce", "board", rank, world_size)


def _chunk(chunks: Partition, rank: int) -> tuple[int, int]:
    """(offset, size) of the chunk of a piece ``rank`` reduces in a two-shot allreduce: rank
    0 the first, rank 1 the last, so that the two ranks whose own part opens their fold (see
    the module docstring) leave it out of their post by posting one range."""
    index = 0 if rank == 0 else chunks.parts - 1 if rank == 1 else rank - 1
    return chunks.offset(index), chunks.size(index)


@lru_cache(maxsize=256)
def allreduce_twoshot(rank: int, world_size: int, count: int, piece: int) -> Schedule:
    """``data`` (``count`` elements) reduced across ranks through the board, ``piece``
    elements (what one post holds; 0: all of them) at a time: each rank reduces its chunk of
    a piece and everyone takes the reduced chunks."""
    if piece < 0:
        raise ValueError(f"a two-shot allreduce needs a piece size of 0 or more, got {piece}")
    piece = piece or max(count, 1)
    steps = StepList()
    others = [peer for peer in range(world_size) if peer != rank]
    # an empty vector still posts once and checks every header, as the one-shot does
    for piece_no, start in enumerate(range(0, count, piece) or [0]):
        size = min(piece, count - start)
        where = f" (piece {piece_no})" if count > piece else ""
        chunks = Partition(size, world_size)
        at, length = _chunk(chunks, rank)
        mine = Region(DATA, start + at, length)
        if rank == 0 and world_size > 1:  # its chunk opens the piece: post the rest
            steps.post(Region(DATA, start + length, size - length), at=length,
                       phase="post" + where)
        elif rank == 1:  # its chunk closes the piece
            steps.post(Region(DATA, start, size - length), phase="post" + where)
        else:
            steps.post(Region(DATA, start, size), phase="post" + where)
        if not length:  # nothing to reduce: check the others' posts all the same
            for peer in others:
                steps.take(peer, Region(DATA, start, 0), phase="fold" + where)
        elif rank < 2 and world_size > 1:  # fold into its own part, in place
            parts = [1 - rank, *range(2, world_size)]
            for i, peer in enumerate(parts):
                steps.take_reduce(peer, mine, mine, final=i == len(parts) - 1, at=at,
                                  phase="fold" + where, round=i + 1)
        else:  # start from rank 0's part; its own comes from its post, in its turn
            steps.take(0, mine, at=at, phase="fold" + where)
            for peer in range(1, world_size):
                steps.take_reduce(peer, mine, mine, final=peer == world_size - 1, at=at,
                                  phase="fold" + where, round=peer)
        steps.post(mine, phase="share" + where)
        for peer in others:
            their_at, their_length = _chunk(chunks, peer)
            steps.take(peer, Region(DATA, start + their_at, their_length),
                       phase="gather" + where)
    return steps.build("allreduce", "twoshot", rank, world_size)


@lru_cache(maxsize=512)
def broadcast(rank: int, world_size: int, root: int, count: int) -> Schedule:
    """Root's ``data`` (``count`` elements) into every rank's ``data`` through the board."""
    steps = StepList()
    data, nothing = Region(DATA, 0, count), Region(DATA, 0, 0)
    steps.post(data if rank == root else nothing, phase="post")
    for peer in range(world_size):
        if peer == root and rank != root:
            steps.take(peer, data, phase="copy")
        elif peer != rank:
            steps.take(peer, nothing, phase="check")
    return steps.build("broadcast", "board", rank, world_size)


@lru_cache(maxsize=512)
def allgather(rank: int, world_size: int, count: int) -> Schedule:
    """Every rank's ``input`` (``count`` elements) into block ``rank`` of every ``output``."""
    steps = StepList()
    steps.post(Region("input", 0, count), phase="post")
    for peer in range(world_size):
        steps.take(peer, Region("output", peer * count, count), phase="gather")
    return steps.build("allgather", "board", rank, world_size)


@lru_cache(maxsize=64)
def barrier(rank: int, world_size: int) -> Schedule:
    """Return once every rank has posted."""
    steps = StepList()
    nothing = Region(DATA, 0, 0)
    steps.post(nothing, phase="arrive")
    for peer in range(world_size):
        if peer != rank:
            steps.take(peer, nothing, phase="wait")
    return steps.build("barrier", "board", rank, world_size)
