"""Algorithms generate schedules; they never send a byte. See ``schedule.py`` for the model."""

from ..core.algorithms import ALLREDUCE_ON_BOARD, ALLREDUCE_OVER_LINKS
from . import board, dbtree, direct, halving_doubling, hier, recursive_doubling, ring, rooted, tree
from .schedule import Kind, Region, Schedule, Step

_ALLREDUCE_BUILDERS = {
    "ring": ring.allreduce,
    "tree": tree.allreduce,
    "dbtree": dbtree.allreduce,
    "hd": halving_doubling.allreduce,
    "rd": recursive_doubling.allreduce,
    "hier": hier.allreduce,
}
# Every allreduce algorithm over links, in the registry's order (``ringcomm.core.algorithms``):
# name -> schedule(rank, world_size, count, segment). Those in HOST_AWARE also take the
# ranks of each host (``hosts=``; default: all on one host).
ALLREDUCE = {name: _ALLREDUCE_BUILDERS[name] for name in ALLREDUCE_OVER_LINKS}
HOST_AWARE = frozenset({"hier"})
# The allreduce algorithms of the shared board (ranks of one host): not priced by the cost
# model, taken by size where a group has a board (``board.one_shot_bytes``).
ON_BOARD = ALLREDUCE_ON_BOARD


def allreduce_schedule(name: str, rank: int, world_size: int, count: int, segment: int,
                       hosts: tuple[tuple[int, ...], ...] | None = None) -> Schedule:
    """The schedule of allreduce algorithm ``name`` for ``rank``; ``hosts`` (the ranks of
    each host) reaches the algorithms that use it."""
    if name in HOST_AWARE:
        return ALLREDUCE[name](rank, world_size, count, segment, hosts)
    return ALLREDUCE[name](rank, world_size, count, segment)


__all__ = ["ALLREDUCE", "HOST_AWARE", "ON_BOARD", "Kind", "Region", "Schedule", "Step",
           "allreduce_schedule", "board", "dbtree", "direct", "halving_doubling", "hier",
           "recursive_doubling", "ring", "rooted", "tree"]
