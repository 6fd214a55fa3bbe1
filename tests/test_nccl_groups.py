"""Schedules as NCCL group plans: for every collective and algorithm, the plans of all ranks
finish under NCCL's rule (a group ends when each of its calls meets its peer's call in a
group the peer has launched), and carried out with NCCL's semantics (a group's sends read
their memory when it starts, its receives land when it ends, then the local work in order)
they compute what the collective must."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.plan.topology import hosts_layout
from ringcomm.schedules.nccl_groups import TEMP, Call, Plan, deadlock, plans
from ringcomm.schedules.schedule import Region, Schedule

ALGORITHMS = [(c, a) for c, spec in COLLECTIVES.items() for a in spec.algorithms
              if a not in ("board", "twoshot", "hier")]
# (count, segment): one segment per chunk, several per chunk, odd sizes
SHAPES = [(3, 1), (4, 10**6), (7, 2)]


def carry_out(plans_: list[Plan], buffers: list[dict[str, np.ndarray]], op: str,
              world: int) -> None:
    """Run every rank's plan on ``buffers`` as NCCL would, group by group in lockstep (every
    rank's group ``l`` together: the plans align them)."""
    temps = [np.zeros(p.temp, np.int64) for p in plans_]
    fold = {"sum": np.add, "max": np.maximum}[op]

    def view(r: int, region: Region) -> np.ndarray:
        array = temps[r] if region.buf == TEMP else buffers[r][region.buf]
        return array[region.offset: region.offset + region.count]

    levels = sorted({g.level for p in plans_ for g in p.groups})
    sent: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)
    for level in levels:
        groups = {p.rank: g for p in plans_ for g in p.groups if g.level == level}
        for r, g in groups.items():  # a group's calls run at once: none may write what
            for i, a in enumerate(g.calls):  # another of them reads or writes
                for b in g.calls[i + 1:]:
                    if Call.RECV in (a.call, b.call):
                        assert not overlaps(a.region, b.region), \
                            f"rank {r}, level {level}: {a} and {b} race"
        for r, g in groups.items():  # the sends read their memory as the group starts
            for c in g.calls:
                if c.call is Call.SEND:
                    sent[(r, c.peer)].append(view(r, c.region).copy())
        for r, g in groups.items():  # the receives land
            for c in g.calls:
                if c.call is Call.RECV:
                    payload = sent[(c.peer, r)].pop(0)
                    assert payload.size == c.region.count
                    view(r, c.region)[:] = payload
        for r, g in groups.items():  # then the local work, in order
            for w in g.then:
                if w.temp is None:
                    view(r, w.dst)[:] = view(r, w.src)
                else:
                    view(r, w.dst)[:] = fold(view(r, w.src), view(r, w.temp))
    assert not any(sent.values()), "messages sent and never received"


def overlaps(a: Region, b: Region) -> bool:
    return a.buf == b.buf and a.offset < b.offset + b.count and b.offset < a.offset + a.count


def schedules(collective: str, algorithm: str, world: int, count: int, segment: int,
              hosts: tuple[tuple[int, ...], ...] | None = None) -> list[Schedule]:
    spec = COLLECTIVES[collective]
    return [spec.schedule(r, world, count, segment, root=world // 2, algorithm=algorithm,
                          hosts=hosts) for r in range(world)]


def check(collective: str, algorithm: str, world: int, count: int, segment: int,
          hosts: tuple[tuple[int, ...], ...] | None = None) -> None:
    spec = COLLECTIVES[collective]
    scheds = schedules(collective, algorithm, world, count, segment, hosts)
    made = plans(scheds)
    assert deadlock(made) == [], f"{collective}/{algorithm} at {world} waits for ever"
    assert sum(p.calls for p in made) == 2 * sum(s.messages()[0] for s in scheds)
    root = world // 2
    buffers = []
    for r in range(world):
        sizes = spec.sizes(count, world, rank=r, root=root)
        feeds = collective not in ("broadcast", "scatter") or r == root
        mine = {role: (r + 1) * np.arange(1, n + 1, dtype=np.int64)
                if role == spec.source and feeds else np.zeros(n, np.int64)
                for role, n in sizes.items()}
        if max(s.scratch for s in scheds):
            mine["scratch"] = np.zeros(max(s.scratch for s in scheds), np.int64)
        buffers.append(mine)
    inputs = [b.get(spec.source, None) for b in buffers]
    inputs = [None if x is None else x.copy() for x in inputs]
    carry_out(made, buffers, "sum", world)
    expected = spec.reference(inputs, "sum", root)
    for r in range(world):
        got = buffers[r].get(spec.result)
        if expected[r] is None:
            continue
        assert got is not None and np.array_equal(got, expected[r]), \
            f"{collective}/{algorithm} at {world}, rank {r}: {got} != {expected[r]}"


def every_shape(collective: str, algorithm: str, worlds: range | tuple[int, ...],
                shapes: list[tuple[int, int]]) -> None:
    for world in worlds:
        for count, segment in shapes:
            check(collective, algorithm, world, count * world if collective == "allreduce"
                  else count, segment)


@pytest.mark.parametrize(("collective", "algorithm"), ALGORITHMS)
def test_every_algorithm_as_nccl_groups(collective: str, algorithm: str) -> None:
    every_shape(collective, algorithm, (1, 2, 3, 4, 5, 8), [SHAPES[0], SHAPES[2]])


@pytest.mark.slow
@pytest.mark.parametrize(("collective", "algorithm"), ALGORITHMS)
def test_every_algorithm_as_nccl_groups_at_every_world_size(collective: str,
                                                            algorithm: str) -> None:
    every_shape(collective, algorithm, range(1, 17), SHAPES)


@pytest.mark.parametrize("layout", ["2x2", "3x2", "2x3"])
def test_hier_as_nccl_groups(layout: str) -> None:
    hosts = hosts_layout(layout)
    check("allreduce", "hier", sum(map(len, hosts)), 13, 2, hosts)


def test_a_ring_step_is_one_group_then_its_reduction() -> None:
    """The textbook's ring step: send a chunk on, receive the previous one, both in one
    group; the reduction of what came follows the group; the sum goes out in the next."""
    made = plans(schedules("allreduce", "ring", 3, 3, 1))
    first, second = made[0].groups[:2]
    assert [(c.call, c.peer) for c in first.calls] == [(Call.SEND, 1), (Call.RECV, 2)]
    assert first.then and first.then[0].temp == first.calls[1].region
    assert (second.calls[0].call, second.calls[0].peer) == (Call.SEND, 1)
    assert second.calls[0].region == first.then[0].dst  # the sum, after its reduction
    # every rank's group l holds the calls its peers' group l meets
    assert [g.level for g in made[0].groups] == [g.level for g in made[1].groups]


def test_plans_that_would_wait_for_ever_are_named() -> None:
    """Two ranks that each send first in a group of its own and receive in the next wait
    for ever under NCCL's rule; the replay says which."""
    from ringcomm.schedules.nccl_groups import P2P, Group

    whole = Region("data", 0, 4)
    made = [Plan(r, (Group(0, (P2P(Call.SEND, 1 - r, whole, 0),), ()),
                     Group(1, (P2P(Call.RECV, 1 - r, whole, 1),), ())), 0) for r in range(2)]
    assert deadlock(made) == [0, 1]


def test_a_copy_waits_for_the_send_that_reads_its_destination() -> None:
    """Rank 0 receives a block, sends it back on (a level later: it reads what the receive
    wrote), then copies another block over it: the copy must wait for that send's group."""
    from ringcomm.schedules.schedule import StepList

    block, other = Region("data", 0, 2), Region("data", 2, 2)
    zero, one = StepList(), StepList()
    zero.recv(1, block)
    zero.send(1, block)
    zero.copy(other, block)
    one.send(0, block)
    one.recv(0, block)
    scheds = [zero.build("allreduce", "ring", 0, 2), one.build("allreduce", "ring", 1, 2)]
    buffers = [{"data": np.array([1, 2, 3, 4])}, {"data": np.array([5, 6, 7, 8])}]
    carry_out(plans(scheds), buffers, "sum", 2)
    assert buffers[0]["data"].tolist() == [3, 4, 3, 4]
    assert buffers[1]["data"].tolist() == [5, 6, 7, 8]  # its own block, back unchanged


def test_an_in_place_swap_has_no_grouping() -> None:
    """Two ranks that send a block and receive the other's into the same memory: in one
    group the receive would overwrite what the send still reads, in two groups each waits
    for the other's second. No plan exists, and the planner says so rather than race."""
    from ringcomm.schedules.schedule import StepList

    block = Region("data", 0, 2)
    made = []
    for rank in range(2):
        steps = StepList()
        steps.send(1 - rank, block)
        steps.recv(1 - rank, block)
        made.append(steps.build("allreduce", "ring", rank, 2))
    with pytest.raises(ValueError, match="no NCCL grouping exists"):
        plans(made)
