"""Double binary tree allreduce (NCCL's): two trees, each carrying half of the data.

In one binary tree the interior ranks move twice what a ring rank moves, while the leaves
(half of the ranks) sit idle. The second tree is the first over relabelled ranks
(``r -> n - 1 - r`` for even ``n``), which makes every leaf of one tree interior in the
other: each rank is interior in at most one tree (for odd ``n`` the second tree is the first
shifted by one, and rank 0 is the exception), so each rank moves about ``2N`` bytes in
total, like the ring, with the tree's ``log n`` latency. World size 4::

    tree A (first half)      tree B (second half)
          0                        3
          |                        |
          2                        1
         / \\                      / \\
        1   3                    2   0

Both trees are pipelined in segments and their steps interleaved in one order shared by all
ranks, so both run at once.

Cost (``N`` bytes, ``S`` segments per half, ``h = ceil(log2 n)``): about
``2 (h + S) (alpha + s beta) + ...``: each rank sends and receives about ``2N`` bytes and
reduces about ``N``: the ring's bandwidth with ``O(log n)`` latency.
"""

from __future__ import annotations

from functools import lru_cache

from .schedule import Schedule, StepList
from .tree import binary_tree, interleave, mirrored, tree_blocks, tree_lag


@lru_cache(maxsize=512)
def allreduce(rank: int, world_size: int, count: int, segment: int) -> Schedule:
    """In-place allreduce of ``count`` elements of ``data``: first half over tree A, second
    half over tree B."""
    steps = StepList()
    half = (count + 1) // 2
    trees = [
        tree_blocks(rank, binary_tree(rank, world_size), 0, half, segment, "tree A"),
        tree_blocks(rank, mirrored(binary_tree, rank, world_size), half, count - half,
                    segment, "tree B"),
    ]
    interleave(steps, trees, tree_lag(world_size))
    return steps.build("allreduce", "dbtree", rank, world_size)
