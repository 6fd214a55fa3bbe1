"""Two-level allreduce (``hier``): reduce inside each host, allreduce among the hosts'
leaders, broadcast inside each host.

Why: between hosts a byte costs far more than between ranks of one host (tcp against
shared memory). A flat ring of ``n`` ranks on ``H`` hosts crosses host boundaries with
``2 (n-1)/n N`` bytes per rank, several ranks of a host at once over the same link; here
only one rank per host (its *leader*, the host's lowest rank) talks to other hosts, with
``2 (H-1)/H N`` bytes, and the rest moves over shared memory.

Vocabulary: ``hosts`` lists the ranks of each host (``Topology.hosts``), the hosts in the
order of their lowest rank; ``leaders`` are the lowest ranks. Three phases, each an
existing schedule run by a subgroup, its virtual ranks mapped to real ones::

    phase 1 (intra-host reduce):    chain reduce of the host's ranks into its leader
    phase 2 (inter-host allreduce): ring allreduce among the leaders
    phase 3 (intra-host broadcast): chain broadcast from the leader to the host's ranks

Two hosts of two ranks (0, 1 on host A; 2, 3 on host B)::

    phase 1:  1 -> 0 (reduce)            3 -> 2 (reduce)
    phase 2:  0 <-> 2 (ring of two leaders: reduce-scatter, all-gather)
    phase 3:  0 -> 1 (broadcast)         2 -> 3 (broadcast)

Messages between a pair keep their order across phases (a local pair meets in phases 1 and
3 only, a leader pair in phase 2 only), so the phases simply follow each other in every
rank's steps. A reduction completes once, in phase 2 (where ``avg`` divides by the world
size); with one host there is no phase 2 and it completes in phase 1.

Cost, ``N`` bytes, ``L`` ranks per host, ``H`` hosts, local and remote constants:
``(L - 2 + S) (a_l + s b_l)`` for each chain (``S`` segments of ``s`` bytes; about
``N b_l``), plus the leaders' ring ``2 (H-1) a_r + 2 (H-1)/H N b_r``: the remote bytes are
those of a ring of ``H`` ranks, not ``n``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from . import ring, rooted
from .schedule import Schedule, Step

Hosts = tuple[tuple[int, ...], ...]


def _mapped(schedule: Schedule, ranks: tuple[int, ...], phase: str,
            keep_final: bool) -> list[Step]:
    """The steps of ``schedule`` (a subgroup's virtual rank) with peers as real ranks."""
    out = []
    for s in schedule.steps:
        out.append(replace(
            s, peer=ranks[s.peer] if s.peer >= 0 else -1, to=ranks[s.to] if s.to >= 0 else -1,
            final=s.final and keep_final, phase=f"{phase} {s.phase}"))
    return out


@lru_cache(maxsize=512)
def allreduce(rank: int, world_size: int, count: int, segment: int,
              hosts: Hosts | None = None) -> Schedule:
    """``hosts=None``: all ranks on one host (a reduce and a broadcast)."""
    if hosts is None:
        hosts = (tuple(range(world_size)),)
    host = next(h for h in hosts if rank in h)
    local = host.index(rank)
    leaders = tuple(h[0] for h in hosts)
    several = len(hosts) > 1
    steps: list[Step] = []
    scratch = 0
    if len(host) > 1:
        reduce = rooted.reduce_chain(local, len(host), 0, count, segment)
        steps += _mapped(reduce, host, "intra-host", keep_final=not several)
        scratch = reduce.scratch
    if several and local == 0:
        inter = ring.allreduce(leaders.index(rank), len(hosts), count, segment)
        steps += _mapped(inter, leaders, "inter-host", keep_final=True)
        scratch = max(scratch, inter.scratch)
    if len(host) > 1:
        bcast = rooted.broadcast_chain(local, len(host), 0, count, segment)
        steps += _mapped(bcast, host, "intra-host", keep_final=False)
    return Schedule("allreduce", "hier", rank, world_size, tuple(steps), scratch)
