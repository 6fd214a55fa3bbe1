"""Algorithms generate schedules; they never send a byte. See ``schedule.py`` for the model."""

from . import dbtree, direct, halving_doubling, recursive_doubling, ring, rooted, tree
from .schedule import Kind, Region, Schedule, Step

# Every allreduce algorithm: name -> schedule(rank, world_size, count, segment).
ALLREDUCE = {
    "ring": ring.allreduce,
    "tree": tree.allreduce,
    "dbtree": dbtree.allreduce,
    "hd": halving_doubling.allreduce,
    "rd": recursive_doubling.allreduce,
}

__all__ = ["ALLREDUCE", "Kind", "Region", "Schedule", "Step", "dbtree", "direct",
           "halving_doubling", "recursive_doubling", "ring", "rooted", "tree"]
