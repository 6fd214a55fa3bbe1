"""Tree allreduce: reduce up a binary tree, broadcast back down, pipelined in segments.

The tree is NCCL's in-order binary tree over ranks ``0 .. n-1``: a rank's level is its
lowest set bit, odd ranks are leaves, rank 0 is the root with one child (the highest power
of two below ``n``). World size 8::

                    0
                    |
                    4
                 /     \\
               2         6
              / \\       / \\
             1   3     5   7

Per segment: every rank adds its children's partial sums to its own data and sends the sum
to its parent; the root then holds the total and sends it back down, each rank forwarding
it to its children. Segments flow through the tree one behind the other, and the broadcast
of segment ``k - lag`` is interleaved with the reduction of segment ``k``, so both
directions of every link are busy at once.

Cost (alpha-beta-gamma, ``N`` bytes, ``S`` segments of ``s`` bytes, height
``h = ceil(log2 n)``): about ``2 (h + S) (alpha + 2 s beta) + (h + S) 2 s gamma``. An interior
rank receives ``2N`` and sends ``2N`` (twice what a ring rank moves, ``2 (n-1)/n N``), but
its latency grows with ``log n`` instead of ``n``: the tree wins for small messages on many
ranks, the ring for large ones. ``dbtree`` halves the tree's load by using two trees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from ..core.partition import segments
from .schedule import Region, Schedule, StepList

DATA = "data"

# One ``StepList`` call kept for later: (method name, positional arguments, labels).
StepCall = tuple[str, tuple[object, ...], dict[str, object]]


@dataclass(frozen=True)
class TreeLinks:
    """One rank's place in a tree: its parent (-1 at the root) and its children."""

    parent: int
    children: tuple[int, ...]


def binary_tree(rank: int, world_size: int) -> TreeLinks:
    """The in-order binary tree drawn in the module docstring."""
    n = world_size
    if n == 1:
        return TreeLinks(-1, ())
    top = 1 << (n - 1).bit_length()  # smallest power of two >= n
    if rank == 0:
        return TreeLinks(-1, (top >> 1,))
    low = rank & -rank  # the rank's level: its lowest set bit
    parent = (rank ^ low) | (low << 1)
    if parent >= n:
        parent = rank ^ low
    children = []
    if low > 1:
        children.append(rank - (low >> 1))
        step = low >> 1
        while step and rank + step >= n:
            step >>= 1
        if step:
            children.append(rank + step)
    return TreeLinks(parent, tuple(children))


def mirrored(tree_fn: Callable[[int, int], TreeLinks], rank: int,
             world_size: int) -> TreeLinks:
    """The second tree of a double binary tree: the first one over relabelled ranks, so that
    (for even ``n``) the leaves of one are the interior ranks of the other."""
    n = world_size
    if n % 2 == 0:
        def relabel(r: int) -> int:
            return n - 1 - r
        unlabel = relabel
    else:
        def relabel(r: int) -> int:
            return (r - 1) % n

        def unlabel(r: int) -> int:
            return (r + 1) % n
    links = tree_fn(relabel(rank), n)
    parent = unlabel(links.parent) if links.parent >= 0 else -1
    return TreeLinks(parent, tuple(unlabel(c) for c in links.children))


def tree_blocks(rank: int, links: TreeLinks, offset: int, count: int, segment: int,
                name: str) -> tuple[list[list[StepCall]], list[list[StepCall]]]:
    """The reduce-up and broadcast-down step groups of one tree, one group per segment.

    Each group is a list of ``(method, args, label)`` for a ``StepList``; keeping them as
    groups lets the caller interleave segments and trees in one global order.
    """
    up: list[list[StepCall]] = []
    down: list[list[StepCall]] = []
    root = links.parent < 0
    for k, (o, c) in enumerate(segments(offset, count, segment)):
        region = Region(DATA, o, c)
        label = dict(chunk=-1, segment=k)
        group: list[StepCall] = []
        for i, child in enumerate(links.children):
            last = i == len(links.children) - 1
            group.append(("recv_reduce", (child, region, region, root and last),
                          dict(phase=f"{name} reduce", **label)))
        if not root:
            group.append(("send", (links.parent, region), dict(phase=f"{name} reduce", **label)))
        up.append(group)
        group = []
        if not root:
            group.append(("recv", (links.parent, region), dict(phase=f"{name} broadcast", **label)))
        for child in links.children:
            group.append(("send", (child, region), dict(phase=f"{name} broadcast", **label)))
        down.append(group)
    return up, down


def interleave(steps: StepList,
               trees: list[tuple[list[list[StepCall]], list[list[StepCall]]]],
               lag: int) -> None:
    """Emit the groups of every tree in one order that all ranks share: at tick ``k``, the
    reductions of segment ``k`` then the broadcasts of segment ``k - lag``, tree by tree.
    Any shared order is deadlock-free (each link's messages keep their order); the lag lets
    segment ``k`` climb while ``k - lag`` descends."""
    ticks = max((len(up) for up, _ in trees), default=0)
    for k in range(ticks + lag):
        for up, _ in trees:
            if k < len(up):
                _emit(steps, up[k])
        for _, down in trees:
            if 0 <= k - lag < len(down):
                _emit(steps, down[k - lag])


def _emit(steps: StepList, group: list[StepCall]) -> None:
    for method, args, label in group:
        getattr(steps, method)(*args, **label)


def tree_lag(world_size: int) -> int:
    """Segments between a reduction and the broadcast it feeds: about a climb and a descent."""
    return 2 * max(1, (world_size - 1).bit_length())


@lru_cache(maxsize=512)
def allreduce(rank: int, world_size: int, count: int, segment: int) -> Schedule:
    """In-place allreduce of ``count`` elements of ``data`` over one binary tree."""
    steps = StepList()
    blocks = tree_blocks(rank, binary_tree(rank, world_size), 0, count, segment, "tree")
    interleave(steps, [blocks], tree_lag(world_size))
    return steps.build("allreduce", "tree", rank, world_size)
