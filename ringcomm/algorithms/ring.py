"""Ring algorithms: allreduce = reduce-scatter + all-gather, each over a ring of ranks.

Vocabulary: the data is cut into ``n`` *chunks*, one per rank (sizes differ by at most one
element, so any count works); each chunk is cut into *segments* of at most ``segment``
elements, the unit that travels. Rank ``r`` sends to ``right = r + 1`` and receives from
``left = r - 1`` (mod ``n``).

Ring allreduce, ``2(n - 1)`` rounds. In round ``t`` rank ``r`` sends chunk ``(r - t) mod n``
and receives chunk ``(r - t - 1) mod n``. For ``t < n - 1`` (reduce-scatter) it reduces what
it receives into its own copy of that chunk; after round ``n - 2`` it holds chunk
``r + 1`` fully reduced. For ``t >= n - 1`` (all-gather) it copies what it receives. The
chunk received in round ``t`` is the one sent in round ``t + 1``, so each segment is
forwarded as soon as it is reduced: the ring is a pipeline of segments. World size 4::

    round 0 (RS):  r0 sends c0 -> r1   r1 sends c1 -> r2   r2 sends c2 -> r3   r3 sends c3 -> r0
    round 1 (RS):  r0 sends c3 -> r1   r1 sends c0 -> r2   r2 sends c1 -> r3   r3 sends c2 -> r0
    round 2 (RS):  r0 sends c2 -> r1   ... after it r0 owns c1, r1 owns c2, r2 c3, r3 c0
    round 3 (AG):  r0 sends c1 -> r1   r1 sends c2 -> r2   r2 sends c3 -> r3   r3 sends c0 -> r0
    rounds 4, 5 (AG): the owned chunks travel on round the ring

Cost (alpha-beta-gamma, ``N`` bytes): ``2(n-1) alpha + 2 (n-1)/n N beta + (n-1)/n N gamma``,
bandwidth-optimal: each rank sends and receives ``2 (n-1)/n N`` bytes, hence nccl-tests'
busbw factor ``2 (n-1)/n``.
"""

from __future__ import annotations

from functools import lru_cache

from ..buffers import Partition, segments
from .schedule import Region, Schedule, StepList

DATA, INPUT, OUTPUT, SCRATCH = "data", "input", "output", "scratch"


@lru_cache(maxsize=512)
def allreduce(rank: int, world_size: int, count: int, segment: int) -> Schedule:
    """In-place ring allreduce of ``count`` elements of buffer ``data``."""
    n, steps = world_size, StepList()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = Partition(count, n)
    rounds = 2 * (n - 1)

    def segs(chunk: int) -> list[tuple[int, int]]:
        return segments(chunks.offset(chunk), chunks.size(chunk), segment)

    if rounds:
        for k, (o, c) in enumerate(segs(rank)):
            steps.send(right, Region(DATA, o, c), phase="reduce-scatter", chunk=rank, segment=k)
    for t in range(rounds):
        chunk = (rank - t - 1) % n
        phase = "reduce-scatter" if t < n - 1 else "all-gather"
        nxt = "reduce-scatter" if t + 1 < n - 1 else "all-gather"
        for k, (o, c) in enumerate(segs(chunk)):
            region = Region(DATA, o, c)
            label = dict(round=t, chunk=chunk, segment=k)
            if t < n - 1:
                steps.recv_reduce(left, region, region, final=(t == n - 2), phase=phase, **label)
            else:
                steps.recv(left, region, phase=phase, **label)
            if t + 1 < rounds:
                steps.send(right, region, phase=nxt, round=t + 1, chunk=chunk, segment=k)
    return steps.build("allreduce", "ring", rank, n)


@lru_cache(maxsize=512)
def reduce_scatter(rank: int, world_size: int, count: int, segment: int) -> Schedule:
    """Ring reduce-scatter: ``input`` holds ``n * count`` elements, rank ``r`` gets chunk ``r``.

    Out of place: ``input`` is only read. Partial sums travel through two scratch chunks used
    in turn, and the last round reduces straight into ``output``. In round ``t`` rank ``r``
    receives the partial of chunk ``(r - t - 2) mod n``, adds its own input of that chunk, and
    forwards the result in round ``t + 1``; after ``n - 1`` rounds chunk ``r`` is complete.
    """
    n, steps = world_size, StepList()
    right, left = (rank + 1) % n, (rank - 1) % n
    if n == 1:
        steps.copy(Region(INPUT, 0, count), Region(OUTPUT, 0, count), phase="local")
        return steps.build("reduce_scatter", "ring", rank, n)
    first = (rank - 1) % n
    for k, (o, c) in enumerate(segments(0, count, segment)):
        region = Region(INPUT, first * count + o, c)
        steps.send(right, region, phase="reduce-scatter", chunk=first, segment=k)
    for t in range(n - 1):
        chunk = (rank - t - 2) % n
        last = t == n - 2
        for k, (o, c) in enumerate(segments(0, count, segment)):
            dst = Region(OUTPUT, o, c) if last else Region(SCRATCH, (t % 2) * count + o, c)
            src = Region(INPUT, chunk * count + o, c)
            label = dict(phase="reduce-scatter", chunk=chunk, segment=k)
            steps.recv_reduce(left, dst, src, final=last, round=t, **label)
            if not last:
                steps.send(right, dst, round=t + 1, **label)
    return steps.build("reduce_scatter", "ring", rank, n, scratch=2 * count)


@lru_cache(maxsize=512)
def allgather(rank: int, world_size: int, sizes: tuple[int, ...], segment: int) -> Schedule:
    """Ring all-gather: rank ``i`` contributes ``sizes[i]`` elements; ``output`` holds them all.

    Round ``t``: rank ``r`` receives block ``(r - t - 1) mod n`` from the left and forwards
    it in round ``t + 1``; its own block goes out first, straight from ``input``.
    """
    n, steps = world_size, StepList()
    right, left = (rank + 1) % n, (rank - 1) % n
    offsets = [sum(sizes[:i]) for i in range(n)]
    steps.copy(Region(INPUT, 0, sizes[rank]), Region(OUTPUT, offsets[rank], sizes[rank]),
               phase="local", chunk=rank)
    if n > 1:
        for k, (o, c) in enumerate(segments(0, sizes[rank], segment)):
            steps.send(right, Region(INPUT, o, c), phase="all-gather", chunk=rank, segment=k)
    for t in range(n - 1):
        block = (rank - t - 1) % n
        for k, (o, c) in enumerate(segments(offsets[block], sizes[block], segment)):
            region = Region(OUTPUT, o, c)
            steps.recv(left, region, phase="all-gather", round=t, chunk=block, segment=k)
            if t + 1 < n - 1:
                steps.send(right, region, phase="all-gather", round=t + 1, chunk=block, segment=k)
    return steps.build("allgather", "ring", rank, n)
