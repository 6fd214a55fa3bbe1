"""Run a whole group inside one process: one thread per rank over in-memory links.

For tests, notebooks and teaching: ``run_group(4, fn)`` calls ``fn(comm)`` on four
communicators at once and returns their results in rank order. Errors are raised after all
ranks have stopped (the first rank's error first), so a failing rank cannot leave others
hanging past their timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CommError
from ..observe.steps import StepLog, TraceEvent
from ..plan.topology import RankFacts, Topology
from ..transport.inmemory import InMemoryNetwork, InMemoryTransport
from .communicator import Communicator


def simulated_hosts(world_size: int, hosts: Sequence[Sequence[int]]) -> Topology:
    """A topology in which the ranks of ``hosts[h]`` share host ``h`` (this process's cores
    each): for groups inside one process that stand for several machines."""
    placed = sorted(r for h in hosts for r in h)
    if placed != list(range(world_size)):
        raise ValueError(f"hosts {hosts} must place each of ranks 0..{world_size - 1} once")
    here = RankFacts.here()
    where = {r: h for h, ranks in enumerate(hosts) for r in ranks}
    return Topology(tuple(RankFacts(f"host{where[r]}", f"host{where[r]}", here.cpus, here.pid)
                          for r in range(world_size)))


def run_group(
    world_size: int,
    fn: Callable[[Communicator], Any],
    *,
    timeout: float = 30.0,
    segment_bytes: int | None = None,
    trace: list[TraceEvent] | None = None,
    return_errors: bool = False,
    hosts: Sequence[Sequence[int]] | None = None,
    board: bool = False,
) -> list[Any]:
    """Run ``fn(comm)`` on every rank of an in-process group; return the results.

    With ``return_errors=True`` a rank's exception is returned in its slot instead of
    raised. ``trace``, if given, collects every executed step of every rank (``StepLog``).
    ``hosts`` (the ranks of each simulated host, e.g. ``[[0, 2], [1, 3]]``) gives the group
    a topology of several hosts, for the algorithms and choices that depend on it; by
    default all ranks share one.
    ``board=True`` gives the group a shared board, as ranks of one host get (then small
    allreduces and barriers run on it).
    """
    net = InMemoryNetwork(world_size, board=board and hosts is None)
    topology = None if hosts is None else simulated_hosts(world_size, hosts)
    def connector(rank: int) -> Callable[[tuple[int, ...], str], InMemoryTransport]:
        return lambda members, tag: net.subnetwork(tag, len(members)).transport(
            members.index(rank))

    wrappers = [StepLog(trace)] if trace is not None else []
    comms = [
        Communicator(net.transport(r), timeout=timeout, segment_bytes=segment_bytes,
                     topology=topology, connect=connector(r), wrappers=wrappers)
        for r in range(world_size)
    ]
    results: list[Any] = [None] * world_size

    def rank_main(r: int) -> None:
        try:
            results[r] = fn(comms[r])
        except BaseException as err:  # noqa: BLE001 - reported below
            results[r] = err

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30.0)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a rank of the in-process group did not finish in {timeout + 30} s")
    for r, comm in enumerate(comms):
        try:
            comm.close()
        except CommError as err:  # a disagreement only close could see: the rank's error
            if not isinstance(results[r], BaseException):
                results[r] = err
    if not return_errors:
        for res in results:
            if isinstance(res, BaseException):
                raise res
    return results
