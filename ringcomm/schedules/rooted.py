"""Rooted collectives: broadcast and reduce, as a pipelined chain or a binomial tree.

Positions are counted from the root: rank ``r`` sits at ``p = (r - root) mod n``.

*Chain* (large messages). Broadcast: ``p`` receives each segment from ``p - 1`` and forwards
it to ``p + 1`` at once, so after the pipe fills every link carries data at the same time.
Reduce runs the chain backwards: ``p`` receives the partial from ``p + 1``, adds its own
segment and passes the result to ``p - 1``; the root reduces into its data. Cost:
``(n - 2 + S) (alpha + s beta)`` for ``S`` segments of ``s`` bytes, about ``N beta`` for
large ``N``, independent of ``n``.

*Binomial tree* (small messages). Broadcast in ``ceil(log2 n)`` rounds: in round ``j`` every
rank that has the data sends it ``2^j`` positions on. Cost ``ceil(log2 n) (alpha + N beta)``.
Chosen for small messages, which are one segment; a larger one (asked for by name) goes
segment by segment, as every message does (a link admits a segment at most).

Non-root ranks' data is left untouched by reduce: partials travel through scratch.
"""

from __future__ import annotations

from functools import lru_cache

from ..core.partition import segments
from .schedule import Region, Schedule, StepList

DATA, SCRATCH = "data", "scratch"


@lru_cache(maxsize=512)
def broadcast_chain(rank: int, world_size: int, root: int, count: int, segment: int) -> Schedule:
    n, steps = world_size, StepList()
    p = (rank - root) % n
    prev, nxt = (rank - 1) % n, (rank + 1) % n
    for k, (o, c) in enumerate(segments(0, count, segment)):
        region = Region(DATA, o, c)
        if p > 0:
            steps.recv(prev, region, phase="broadcast", round=p - 1, segment=k)
        if p < n - 1:
            steps.send(nxt, region, phase="broadcast", round=p, segment=k)
    return steps.build("broadcast", "chain", rank, n)


@lru_cache(maxsize=512)
def broadcast_binomial(rank: int, world_size: int, root: int, count: int,
                       segment: int = 0) -> Schedule:
    """``segment`` elements per message (0: the whole vector in one)."""
    n, steps = world_size, StepList()
    p = (rank - root) % n
    parent_bit = 1 << (p.bit_length() - 1) if p > 0 else 0
    pieces = segments(0, count, segment) if segment > 0 and count > 0 else [(0, count)]
    for k, (o, c) in enumerate(pieces):
        region = Region(DATA, o, c)
        label = {} if len(pieces) == 1 else {"segment": k}
        mask = 1
        if p > 0:
            steps.recv((rank - parent_bit) % n, region, phase="broadcast",
                       round=parent_bit.bit_length() - 1, **label)
            mask = parent_bit << 1
        while p + mask < n:
            steps.send((rank + mask) % n, region, phase="broadcast",
                       round=mask.bit_length() - 1, **label)
            mask <<= 1
    return steps.build("broadcast", "binomial", rank, n)


@lru_cache(maxsize=512)
def reduce_chain(rank: int, world_size: int, root: int, count: int, segment: int) -> Schedule:
    n, steps = world_size, StepList()
    p = (rank - root) % n
    towards_root, away = (rank - 1) % n, (rank + 1) % n
    slot = min(segment, count)
    for k, (o, c) in enumerate(segments(0, count, segment)):
        mine = Region(DATA, o, c)
        label = dict(phase="reduce", round=n - 1 - p, segment=k)
        if p == n - 1 and n > 1:
            steps.send(towards_root, mine, **label)
        elif 0 < p < n - 1:
            partial = Region(SCRATCH, (k % 2) * slot, c)
            steps.recv_reduce(away, partial, mine, final=False, **label)
            steps.send(towards_root, partial, **label)
        elif p == 0 and n > 1:
            steps.recv_reduce(away, mine, mine, final=True, **label)
    return steps.build("reduce", "chain", rank, n, scratch=2 * slot)
