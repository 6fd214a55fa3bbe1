"""Recursive halving-doubling allreduce (Rabenseifner): reduce-scatter by halving, then
all-gather by doubling, in ``2 log2 p`` steps.

Let ``p`` be the largest power of two ``<= n`` and ``extra = n - p``. The data is cut into
``p`` blocks (sizes differ by at most one element).

1. *Fold* (only if ``n`` is not a power of two): for ``i < extra``, rank ``2i + 1`` sends all
   its data to rank ``2i``, which adds it and stands for both; the others take part as they
   are. The ``p`` taking part are renumbered ``0 .. p-1`` (``v``).
2. *Halving*: for ``d = p/2, p/4, .., 1``, ``v`` and its partner ``v ^ d`` split the range of
   blocks they share in two; each sends the half the other keeps and adds the half it
   receives. After ``log2 p`` steps ``v`` holds block ``v`` fully reduced.
3. *Doubling*: the same exchanges in reverse order, copying instead of adding, until every
   rank holds every block.
4. *Unfold*: rank ``2i`` sends the result to rank ``2i + 1``.

World size 4, blocks b0..b3::

    halving d=2:  0<->2, 1<->3   0 keeps b0 b1, 2 keeps b2 b3 (1 keeps b0 b1, 3 keeps b2 b3)
    halving d=1:  0<->1, 2<->3   0 keeps b0, 1 keeps b1, 2 keeps b2, 3 keeps b3
    doubling d=1, then d=2: the same pairs swap what they hold

Cost (``N`` bytes, power-of-two ``n``): ``2 log2 n alpha + 2 (n-1)/n N beta +
(n-1)/n N gamma``: the ring's bandwidth with ``log n`` latency; a fold adds ``2 (alpha + N
beta)``. Messages are cut into segments so none is huge.
"""

from __future__ import annotations

from functools import lru_cache

from ..core.partition import Partition, segments
from .schedule import Region, Schedule, StepList

DATA = "data"


EXCHANGE_WINDOW = 8  # segments sent ahead of the first receive; bounds what a link holds


def exchange(steps: StepList, partner: int, send: tuple[int, int], keep: tuple[int, int],
             segment: int, *, reduce: bool, final: bool, label: dict) -> None:
    """Send the element range ``send`` to ``partner`` and receive its data for ``keep``.

    Segments go ``EXCHANGE_WINDOW`` ahead of the receives, then one more after each receive:
    both partners run the same order, so neither waits on a segment the other has not sent,
    and the link never holds more than the window (a whole half of a large message sent
    at once would overflow shared memory onto the slower socket). ``send`` and ``keep`` may
    be the same range (recursive doubling): segment ``k`` is sent before it is reduced into."""
    sends = [Region(DATA, o, c) for o, c in segments(send[0], send[1] - send[0], segment)]
    keeps = [Region(DATA, o, c) for o, c in segments(keep[0], keep[1] - keep[0], segment)]
    for k, region in enumerate(sends[:EXCHANGE_WINDOW]):
        steps.send(partner, region, segment=k, **label)
    for k, region in enumerate(keeps):
        if reduce:
            steps.recv_reduce(partner, region, region, final=final, segment=k, **label)
        else:
            steps.recv(partner, region, segment=k, **label)
        ahead = k + EXCHANGE_WINDOW
        if ahead < len(sends):
            steps.send(partner, sends[ahead], segment=ahead, **label)
    for k in range(len(keeps) + EXCHANGE_WINDOW, len(sends)):
        steps.send(partner, sends[k], segment=k, **label)


def fold(steps: StepList, rank: int, n: int, count: int, segment: int) -> int | None:
    """Step 1 for any ``n``: fold the ranks beyond the largest power of two ``p <= n`` into
    their even neighbours. Returns this rank's number ``v`` among the ``p`` taking part, or
    None for a folded-away rank (whose schedule, send then wait for the result, is done)."""
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    if rank >= 2 * extra:
        return rank - extra
    if rank % 2:
        for k, (o, c) in enumerate(segments(0, count, segment)):
            steps.send(rank - 1, Region(DATA, o, c), phase="fold", segment=k)
        for k, (o, c) in enumerate(segments(0, count, segment)):
            steps.recv(rank - 1, Region(DATA, o, c), phase="unfold", segment=k)
        return None
    for k, (o, c) in enumerate(segments(0, count, segment)):
        region = Region(DATA, o, c)
        steps.recv_reduce(rank + 1, region, region, final=False, phase="fold", segment=k)
    return rank // 2


def unfold(steps: StepList, rank: int, n: int, count: int, segment: int) -> None:
    """The last step: a rank that stood for a folded neighbour sends it the result."""
    extra = n - (1 << (n.bit_length() - 1))
    if rank < 2 * extra:
        for k, (o, c) in enumerate(segments(0, count, segment)):
            steps.send(rank + 1, Region(DATA, o, c), phase="unfold", segment=k)


def real_rank(v: int, n: int) -> int:
    """The rank behind number ``v`` of the ranks that remain after ``fold``."""
    extra = n - (1 << (n.bit_length() - 1))
    return 2 * v if v < extra else v + extra


@lru_cache(maxsize=512)
def allreduce(rank: int, world_size: int, count: int, segment: int) -> Schedule:
    """In-place allreduce of ``count`` elements of ``data``."""
    n, steps = world_size, StepList()
    p = 1 << (n.bit_length() - 1)
    v = fold(steps, rank, n, count, segment)
    if v is None:
        return steps.build("allreduce", "hd", rank, n)

    def real(u: int) -> int:
        return real_rank(u, n)

    blocks = Partition(count, p)

    def span(lo: int, hi: int) -> tuple[int, int]:  # element range of blocks [lo, hi)
        return blocks.offset(lo), blocks.offset(lo) + sum(blocks.size(b) for b in range(lo, hi))

    lo, hi = 0, p
    history = []
    d = p >> 1
    while d:
        partner = v ^ d
        mid = (lo + hi) // 2
        mine, theirs = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
        history.append((partner, mine, theirs))
        exchange(steps, real(partner), span(*theirs), span(*mine), segment, reduce=True,
                  final=(d == 1), label=dict(phase="halving", round=len(history) - 1))
        lo, hi = mine
        d >>= 1
    for step, (partner, mine, theirs) in enumerate(reversed(history)):
        exchange(steps, real(partner), span(*mine), span(*theirs), segment, reduce=False,
                  final=False, label=dict(phase="doubling", round=step))
    unfold(steps, rank, n, count, segment)
    return steps.build("allreduce", "hd", rank, n)
