"""Direct exchanges: gather, scatter, all-to-all, point-to-point, and the barrier.

These move each block straight from its owner to its destination, so there is nothing to
pipeline across ranks; large blocks are still cut into segments so that no single message
is huge (a huge receive faults in fresh pages on every call).

*All-to-all* uses the pairwise exchange: in round ``s = 1 .. n-1`` rank ``r`` sends block
``r + s`` to rank ``r + s`` and receives block ``r - s`` from rank ``r - s``; every rank
sends ``(n-1)/n`` of its data. Blocks may differ in size (``all_to_all_single`` splits).

*Barrier* is the dissemination barrier: in round ``j`` rank ``r`` signals ``r + 2^j`` and
waits for ``r - 2^j``; after ``ceil(log2 n)`` rounds every rank has heard, directly or not,
from every other.
"""

from __future__ import annotations

from functools import lru_cache

from ..core.partition import segments
from .schedule import Region, Schedule, StepList

INPUT, OUTPUT, DATA = "input", "output", "data"


def _send_block(steps: StepList, peer: int, buf: str, offset: int, count: int, seg: int,
                **label) -> None:
    for k, (o, c) in enumerate(segments(offset, count, seg)):
        steps.send(peer, Region(buf, o, c), segment=k, **label)


def _recv_block(steps: StepList, peer: int, buf: str, offset: int, count: int, seg: int,
                **label) -> None:
    for k, (o, c) in enumerate(segments(offset, count, seg)):
        steps.recv(peer, Region(buf, o, c), segment=k, **label)


@lru_cache(maxsize=512)
def gather(rank: int, world_size: int, root: int, count: int, segment: int) -> Schedule:
    """Every rank's ``input`` (``count`` elements) lands in block ``rank`` of root's ``output``."""
    steps = StepList()
    if rank != root:
        _send_block(steps, root, INPUT, 0, count, segment, phase="gather", chunk=rank)
    else:
        steps.copy(Region(INPUT, 0, count), Region(OUTPUT, root * count, count), phase="local")
        for peer in range(world_size):
            if peer != root:
                _recv_block(steps, peer, OUTPUT, peer * count, count, segment,
                            phase="gather", chunk=peer)
    return steps.build("gather", "direct", rank, world_size)


@lru_cache(maxsize=512)
def scatter(rank: int, world_size: int, root: int, count: int, segment: int) -> Schedule:
    """Block ``i`` of root's ``input`` lands in rank ``i``'s ``output`` (``count`` elements)."""
    steps = StepList()
    if rank == root:
        for peer in range(world_size):
            if peer != root:
                _send_block(steps, peer, INPUT, peer * count, count, segment,
                            phase="scatter", chunk=peer)
        steps.copy(Region(INPUT, root * count, count), Region(OUTPUT, 0, count), phase="local")
    else:
        _recv_block(steps, root, OUTPUT, 0, count, segment, phase="scatter", chunk=rank)
    return steps.build("scatter", "direct", rank, world_size)


@lru_cache(maxsize=512)
def alltoall(
    rank: int,
    world_size: int,
    send_counts: tuple[int, ...],
    recv_counts: tuple[int, ...],
    segment: int,
) -> Schedule:
    """Pairwise all-to-all: block ``i`` of ``input`` goes to rank ``i``; block ``j`` of
    ``output`` comes from rank ``j``. ``send_counts``/``recv_counts`` are this rank's splits."""
    n, steps = world_size, StepList()
    send_off = [sum(send_counts[:i]) for i in range(n)]
    recv_off = [sum(recv_counts[:i]) for i in range(n)]
    for s in range(1, n):
        dst = (rank + s) % n
        _send_block(steps, dst, INPUT, send_off[dst], send_counts[dst], segment,
                    phase="alltoall", round=s, chunk=dst)
    steps.copy(Region(INPUT, send_off[rank], send_counts[rank]),
               Region(OUTPUT, recv_off[rank], recv_counts[rank]), phase="local")
    for s in range(1, n):
        src = (rank - s) % n
        _recv_block(steps, src, OUTPUT, recv_off[src], recv_counts[src], segment,
                    phase="alltoall", round=s, chunk=rank)
    return steps.build("alltoall", "pairwise", rank, n)


@lru_cache(maxsize=64)
def barrier(rank: int, world_size: int) -> Schedule:
    steps, n, j = StepList(), world_size, 0
    while (1 << j) < n:
        dist = 1 << j
        steps.send((rank + dist) % n, Region(DATA, 0, 0), phase="barrier", round=j)
        steps.recv((rank - dist) % n, Region(DATA, 0, 0), phase="barrier", round=j)
        j += 1
    return steps.build("barrier", "dissemination", rank, n)


@lru_cache(maxsize=512)
def send(rank: int, world_size: int, peer: int, count: int, segment: int) -> Schedule:
    steps = StepList()
    _send_block(steps, peer, DATA, 0, count, segment, phase="send")
    if count == 0:
        steps.send(peer, Region(DATA, 0, 0), phase="send")
    return steps.build("send", "direct", rank, world_size)


@lru_cache(maxsize=512)
def recv(rank: int, world_size: int, peer: int, count: int, segment: int) -> Schedule:
    steps = StepList()
    _recv_block(steps, peer, DATA, 0, count, segment, phase="recv")
    if count == 0:
        steps.recv(peer, Region(DATA, 0, 0), phase="recv")
    return steps.build("recv", "direct", rank, world_size)
