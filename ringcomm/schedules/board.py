"""Collectives on the shared board: for small messages among ranks of one host.

Every rank posts its vector on the board (``ringcomm.transport.board``) and takes what it
needs straight from the other ranks' posts: one copy in, one read of each part, and no
message, where a tree or a ring pays a message (a system call and a wake-up) per round.
Each rank reads all ``n`` parts, ``n`` times the bytes a ring reads, which is why only small
messages go this way.

*Allreduce*: every rank folds the parts in rank order, ``((x0 op x1) op x2) ...``, so every
rank gets the same bits whatever the rounding. Ranks 0 and 1 start from their own part and
fold in the other of the two (the ops are commutative: ``x1 op x0`` is ``x0 op x1``); every
other rank starts from a copy of rank 0's part and folds in the rest, its own part from the
board, where it is the same as in its buffer.

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

from .schedule import Region, Schedule, StepList

DATA = "data"


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
