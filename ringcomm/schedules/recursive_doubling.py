"""Recursive doubling allreduce: ``log2 p`` exchanges of the whole vector, the fewest
messages of any allreduce, for the smallest sizes.

Every rank sends all its data to a partner and adds what it gets back, with partners
``v ^ 1``, ``v ^ 2``, ``v ^ 4``, ...: after round ``r`` a rank holds the sum over a group of
``2^(r+1)`` ranks, so after ``log2 p`` rounds every rank holds the total. Partners add the
same two partial sums, so every rank ends with bit-identical values. A world size that is
not a power of two folds first and unfolds last, exactly as halving-doubling does.

World size 4::

    round 0:  0<->1, 2<->3   0 and 1 hold x0+x1, 2 and 3 hold x2+x3
    round 1:  0<->2, 1<->3   everyone holds (x0+x1)+(x2+x3)

Cost (``N`` bytes, power-of-two ``n``): ``log2 n (alpha + N beta + N gamma)``: half the
latency of halving-doubling and a third of a tree's, but every round moves the whole
vector, so past a few KiB the ring and halving-doubling win. At world size 2 it is one
exchange where every other algorithm needs two.
"""

from __future__ import annotations

from functools import lru_cache

from .halving_doubling import exchange, fold, real_rank, unfold
from .schedule import Schedule, StepList


@lru_cache(maxsize=512)
def allreduce(rank: int, world_size: int, count: int, segment: int) -> Schedule:
    """In-place allreduce of ``count`` elements of ``data``."""
    n, steps = world_size, StepList()
    p = 1 << (n.bit_length() - 1)
    v = fold(steps, rank, n, count, segment)
    if v is None:
        return steps.build("allreduce", "rd", rank, n)
    d, rounds = 1, p.bit_length() - 1
    for r in range(rounds):
        partner = real_rank(v ^ d, n)
        exchange(steps, partner, (0, count), (0, count), segment, reduce=True,
                 final=(r == rounds - 1), label=dict(phase="doubling", round=r))
        d <<= 1
    unfold(steps, rank, n, count, segment)
    return steps.build("allreduce", "rd", rank, n)
