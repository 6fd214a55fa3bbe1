"""What a collective costs, by the cost model the selector uses, beside the two ways a
newcomer would write an allreduce.

- *everyone to everyone*: each rank sends its whole vector to every other rank and adds
  what it receives: ``n - 1`` messages of ``N`` bytes from every rank;
- *a parameter server*: every worker sends its vector to one rank, which adds them and
  sends the sum back to each: that rank moves ``2 (n - 1) N`` bytes, the rest ``N`` each.

Both are written as schedules here only to be priced, by the same simulation that prices
the real algorithms (``ringcomm.plan.cost.simulate``): each message costs ``alpha``, each
byte moved ``beta``, each byte reduced ``gamma``, with a rank's steps one after another and
every receive waiting for its message. Ranks are given a core each, so the figures say
what the algorithm costs, not how many cores this machine has.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import cost
from ..plan.cost import CostParams
from ..schedules.schedule import Region, Schedule, StepList
from .record import Call

LARGE_BYTES = 64 << 20  # the size that shows each algorithm's bandwidth term
LARGE_ITEMSIZE = 4  # float32, as gradients mostly are


@dataclass(frozen=True)
class Line:
    """One way to run the collective: the busiest rank's messages and bytes sent at the
    explained size, and the predicted time there and at ``LARGE_BYTES``."""

    name: str
    messages: int
    sent_bytes: int
    time: float
    large_time: float


# what the costs say of their constants where no profile is found (docs/build_tutorial.py
# quotes explain's output with it)
DEFAULTS_SOURCE = "the model's defaults: no profile from `ringcomm tune` here"


@dataclass(frozen=True)
class Costs:
    params: CostParams
    source: str  # where the constants come from: a profile file, or the defaults
    per_rank: tuple[tuple[int, int], ...]  # (messages, bytes) each rank sent
    lines: tuple[Line, ...]


def costs(call: Call, schedules: list[Schedule], itemsize: int,
          params: CostParams | None = None, source: str = "") -> Costs:
    """The explained call's messages per rank and the model's times for it, its algorithm
    against the naive ways where the collective is an allreduce."""
    if params is None:
        profile = cost.load_profile()
        params, source = profile.for_world(call.world_size), profile.source
        if source == "defaults":
            source = DEFAULTS_SOURCE
    per_rank = tuple((m, e * itemsize) for m, e in (s.messages() for s in schedules))
    large = LARGE_BYTES // LARGE_ITEMSIZE
    big = [call.spec.schedule(r, call.world_size, large,
                              max(1, cost.DEFAULT_SEGMENT_BYTES // LARGE_ITEMSIZE),
                              root=call.root, algorithm=call.algorithm, hosts=call.hosts)
           for r in range(call.world_size)]
    lines = [_line(call, call.algorithm, schedules, big, itemsize, params)]
    if call.collective == "allreduce" and call.world_size > 1:
        for name, build in (("everyone to everyone", everyone_to_everyone),
                            ("parameter server (rank 0)", parameter_server)):
            small = [build(r, call.world_size, call.block) for r in range(call.world_size)]
            large_ones = [build(r, call.world_size, large) for r in range(call.world_size)]
            lines.append(_line(call, name, small, large_ones, itemsize, params))
    return Costs(params, source, per_rank, tuple(lines))


def _line(call: Call, name: str, small: list[Schedule], large: list[Schedule],
          itemsize: int, params: CostParams) -> Line:
    sent = [s.messages() for s in small]
    messages, elements = max(sent, key=lambda m: (m[1], m[0]))
    return Line(name, messages, elements * itemsize, _time(call, small, itemsize, params),
                _time(call, large, LARGE_ITEMSIZE, params))


def _time(call: Call, schedules: list[Schedule], itemsize: int, params: CostParams) -> float:
    host_of = None
    if call.hosts is not None and len(call.hosts) > 1:
        where = {rank: h for h, ranks in enumerate(call.hosts) for rank in ranks}
        host_of = tuple(where[r] for r in range(call.world_size))
    priced = cost.simulate(schedules, itemsize, params, cost.DEFAULT_REMOTE_PARAMS, host_of)
    return priced.time(params, 1.0, cost.DEFAULT_REMOTE_PARAMS)


def everyone_to_everyone(rank: int, world_size: int, count: int) -> Schedule:
    """Every rank sends all of ``data`` to every other and adds in every other's."""
    steps = StepList()
    whole = Region("data", 0, count)
    for peer in range(world_size):
        if peer != rank:
            steps.send(peer, whole, phase="everyone to everyone")
    for peer in range(world_size):
        if peer != rank:
            steps.recv_reduce(peer, whole, whole, final=False, phase="everyone to everyone")
    return steps.build("allreduce", "everyone to everyone", rank, world_size)


def parameter_server(rank: int, world_size: int, count: int) -> Schedule:
    """Rank 0 adds every worker's ``data`` and sends the sum back to each."""
    steps = StepList()
    whole = Region("data", 0, count)
    if rank == 0:
        for peer in range(1, world_size):
            steps.recv_reduce(peer, whole, whole, final=False, phase="push")
        for peer in range(1, world_size):
            steps.send(peer, whole, phase="pull")
    else:
        steps.send(0, whole, phase="push")
        steps.recv(0, whole, phase="pull")
    return steps.build("allreduce", "parameter server", rank, world_size)
