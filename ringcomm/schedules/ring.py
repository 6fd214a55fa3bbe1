"""Ring algorithms: allreduce = reduce-scatter + all-gather, each over a ring of ranks.

Vocabulary: rank ``r`` sends to ``right = r + 1`` and receives from ``left = r - 1``
(mod ``n``). A *segment* (at most ``segment`` elements) is the unit that travels. The data
is cut into *slices* of ``n`` segments; each slice is cut into ``n`` *chunks*, one per rank
(sizes differ by at most one element, so any count works).

Ring allreduce of one slice, ``2(n - 1)`` rounds. In round ``t`` rank ``r`` sends chunk
``(r - t) mod n`` and receives chunk ``(r - t - 1) mod n``. For ``t < n - 1``
(reduce-scatter) it reduces what it receives into its own copy of that chunk; after round
``n - 2`` it holds chunk ``r + 1`` fully reduced. For ``t >= n - 1`` (all-gather) it copies
what it receives. The chunk received in round ``t`` is the one sent in round ``t + 1``, so
each chunk is forwarded as soon as it is reduced. World size 4::

    round 0 (RS):  r0 sends c0 -> r1   r1 sends c1 -> r2   r2 sends c2 -> r3   r3 sends c3 -> r0
    round 1 (RS):  r0 sends c3 -> r1   r1 sends c0 -> r2   r2 sends c1 -> r3   r3 sends c2 -> r0
    round 2 (RS):  r0 sends c2 -> r1   ... after it r0 owns c1, r1 owns c2, r2 c3, r3 c0
    round 3 (AG):  r0 sends c1 -> r1   r1 sends c2 -> r2   r2 sends c3 -> r3   r3 sends c0 -> r0
    rounds 4, 5 (AG): the owned chunks travel on round the ring

Pipelining: slices enter the ring one behind the other, like cars on a road. Rank ``r``
works through *ticks*; at tick ``k`` it performs round ``k - stride * j`` of every slice
``j`` in flight (oldest first), and slice ``j`` starts at tick ``stride * j``. So while one
slice is being reduced, the next is already on the wire, and at most about
``rounds / stride`` slices (``PIPELINE_DEPTH``) are in flight: the memory a link holds is
bounded by a few segments, whatever the message size. Every rank uses the same order, so
the messages on each link arrive in exactly the order they are expected.

Partial sums (reduce-scatter rounds before the last) are never read again on the rank that
forwards them, so those receives are fused with the next send (``recv_reduce_send``): with
shared memory the sum is written straight into the outgoing message.

Cost (alpha-beta-gamma, ``N`` bytes, ``S`` slices): ``(2(n-1) + stride (S-1)) alpha +
2 (n-1)/n N beta + (n-1)/n N gamma``, bandwidth-optimal: each rank sends and receives
``2 (n-1)/n N`` bytes, hence nccl-tests' busbw factor ``2 (n-1)/n``.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

from ..core.partition import Partition
from .schedule import Region, Schedule, StepList

DATA, INPUT, OUTPUT, SCRATCH = "data", "input", "output", "scratch"
PIPELINE_DEPTH = 8  # slices in flight at most; bounds what a link must hold


def pipeline_order(slices: int, rounds: int) -> Iterator[tuple[int, int]]:
    """``(slice, round)`` pairs in the order a rank performs them; round ``-1`` is a slice's
    first send. Slice ``j`` round ``t`` happens at tick ``stride * j + t``; within a tick the
    oldest slice goes first, and a slice's first send opens its tick."""
    stride = max(1, -(-rounds // PIPELINE_DEPTH))
    for tick in range(stride * (slices - 1) + rounds):
        if tick % stride == 0 and tick // stride < slices:
            yield tick // stride, -1
        for t in range(min(rounds - 1, tick), -1, -1):
            j, behind = divmod(tick - t, stride)
            if not behind and j < slices:
                yield j, t


def _num_slices(count: int, per_slice: int) -> int:
    return -(-count // per_slice) if count > 0 else 0


@lru_cache(maxsize=512)
def allreduce(rank: int, world_size: int, count: int, segment: int) -> Schedule:
    """In-place ring allreduce of ``count`` elements of buffer ``data``."""
    n, steps = world_size, StepList()
    right, left = (rank + 1) % n, (rank - 1) % n
    rounds = 2 * (n - 1)
    per_slice = n * segment

    def chunk(j: int, c: int) -> Region:
        lo = j * per_slice
        part = Partition(min(per_slice, count - lo), n)
        return Region(DATA, lo + part.offset(c), part.size(c))

    def phase(t: int) -> str:
        return "reduce-scatter" if t < n - 1 else "all-gather"

    for j, t in pipeline_order(_num_slices(count, per_slice) if rounds else 0, rounds):
        if t < 0:
            region = chunk(j, rank)
            if region.count:
                steps.send(right, region, phase=phase(0), chunk=rank, segment=j)
            continue
        c = (rank - t - 1) % n
        region = chunk(j, c)
        if not region.count:
            continue
        label = dict(chunk=c, segment=j)
        if t < n - 2:  # a partial sum: the all-gather overwrites it here, so fuse
            steps.recv_reduce_send(left, right, region, region, phase=phase(t), round=t,
                                   **label)
            continue
        if t == n - 2:
            steps.recv_reduce(left, region, region, final=True, phase=phase(t), round=t,
                              **label)
        else:
            steps.recv(left, region, phase=phase(t), round=t, **label)
        if t + 1 < rounds:
            steps.send(right, region, phase=phase(t + 1), round=t + 1, **label)
    return steps.build("allreduce", "ring", rank, n)


@lru_cache(maxsize=512)
def reduce_scatter(rank: int, world_size: int, count: int, segment: int) -> Schedule:
    """Ring reduce-scatter: ``input`` holds ``n * count`` elements, rank ``r`` gets chunk ``r``.

    Out of place: ``input`` is only read. Slice ``j`` is segment ``j`` of every chunk. Partial
    sums travel through two scratch chunks used in turn, and the last round reduces straight
    into ``output``. In round ``t`` rank ``r`` receives the partial of chunk
    ``(r - t - 2) mod n``, adds its own input of that chunk, and forwards the result in round
    ``t + 1``; after ``n - 1`` rounds chunk ``r`` is complete.
    """
    n, steps = world_size, StepList()
    right, left = (rank + 1) % n, (rank - 1) % n
    if n == 1:
        steps.copy(Region(INPUT, 0, count), Region(OUTPUT, 0, count), phase="local")
        return steps.build("reduce_scatter", "ring", rank, n)
    first = (rank - 1) % n
    for j, t in pipeline_order(_num_slices(count, segment), n - 1):
        o = j * segment
        c = min(segment, count - o)
        label = dict(phase="reduce-scatter", segment=j)
        if t < 0:
            steps.send(right, Region(INPUT, first * count + o, c), chunk=first, **label)
            continue
        block = (rank - t - 2) % n
        last = t == n - 2
        src = Region(INPUT, block * count + o, c)
        if last:
            steps.recv_reduce(left, Region(OUTPUT, o, c), src, final=True, round=t,
                              chunk=block, **label)
        else:  # a partial sum, forwarded (fused where the transport can) and never read
            steps.recv_reduce_send(left, right, Region(SCRATCH, (t % 2) * count + o, c),
                                   src, round=t, chunk=block, **label)
    return steps.build("reduce_scatter", "ring", rank, n, scratch=2 * count)


@lru_cache(maxsize=512)
def allgather(rank: int, world_size: int, sizes: tuple[int, ...], segment: int) -> Schedule:
    """Ring all-gather: rank ``i`` contributes ``sizes[i]`` elements; ``output`` holds them all.

    Slice ``j`` is segment ``j`` of every block. Round ``t``: rank ``r`` receives block
    ``(r - t - 1) mod n`` from the left and forwards it in round ``t + 1``; its own block goes
    out first, straight from ``input``.
    """
    n, steps = world_size, StepList()
    right, left = (rank + 1) % n, (rank - 1) % n
    offsets = [sum(sizes[:i]) for i in range(n)]
    steps.copy(Region(INPUT, 0, sizes[rank]), Region(OUTPUT, offsets[rank], sizes[rank]),
               phase="local", chunk=rank)
    if n == 1:
        return steps.build("allgather", "ring", rank, n)

    def piece(block: int, j: int, buf: str) -> Region:
        o = j * segment
        base = offsets[block] if buf == OUTPUT else 0
        return Region(buf, base + o, max(0, min(segment, sizes[block] - o)))

    for j, t in pipeline_order(_num_slices(max(sizes), segment), n - 1):
        if t < 0:
            region = piece(rank, j, INPUT)
            if region.count:
                steps.send(right, region, phase="all-gather", chunk=rank, segment=j)
            continue
        block = (rank - t - 1) % n
        region = piece(block, j, OUTPUT)
        if not region.count:
            continue
        steps.recv(left, region, phase="all-gather", round=t, chunk=block, segment=j)
        if t + 1 < n - 1:
            steps.send(right, region, phase="all-gather", round=t + 1, chunk=block, segment=j)
    return steps.build("allgather", "ring", rank, n)
