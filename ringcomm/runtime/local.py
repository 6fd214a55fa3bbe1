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

from ..engines.exchange import Table, TableExchange
from ..engines.wrapping import Wrapper
from ..errors import CommError
from ..observe.steps import StepLog, TraceEvent
from ..plan.settings import Settings
from ..plan.topology import RankFacts, Topology
from ..transport.inmemory import InMemoryNetwork, InMemoryTransport
from .communicator import Communicator
from .devices import gpu_facts, named_runtime, runtime_name


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
    device: str | None = None,
    wrappers: Sequence[Wrapper] = (),
    gpus: Sequence[int] | None = None,
) -> list[Any]:
    """Run ``fn(comm)`` on every rank of an in-process group; return the results.

    With ``return_errors=True`` a rank's exception is returned in its slot instead of
    raised. ``trace``, if given, collects every executed step of every rank (``StepLog``).
    ``hosts`` (the ranks of each simulated host, e.g. ``[[0, 2], [1, 3]]``) gives the group
    a topology of several hosts, for the algorithms and choices that depend on it; by
    default all ranks share one.
    ``board=True`` gives the group a shared board, as ranks of one host get (then small
    allreduces and barriers run on it).
    ``device`` (``"fake"``, ``"cuda"``, ``"off"``, ``"auto"``; default ``RINGCOMM_DEVICE``)
    gives the group a device runtime and its device engines, as ``ringcomm.init(device=)``
    does; their set-up is collective, so the communicators are then made on the ranks'
    threads.
    ``wrappers`` stand in front of every rank's links and engines (the same objects on
    every rank, so one that keeps state tells the ranks apart).
    ``gpus`` (with ``device``): the device index of each rank (its current device while the
    communicator is made, and its ``gpu`` fact): ``[0, 1]`` puts two ranks on GPUs of their
    own, ``[0, 0]`` on one; by default every rank shares this thread's current device.
    """
    net = InMemoryNetwork(world_size, board=board and hosts is None)
    topology = None if hosts is None else simulated_hosts(world_size, hosts)
    def connector(rank: int) -> Callable[[tuple[int, ...], str], InMemoryTransport]:
        return lambda members, tag: net.subnetwork(tag, len(members)).transport(
            members.index(rank))

    wrapping = [*wrappers, *([StepLog(trace)] if trace is not None else [])]
    settings = Settings.local(segment_bytes=segment_bytes, device=device)
    if gpus is not None and (settings.device == "off" or len(gpus) != world_size
                             or hosts is not None):
        raise ValueError(f"gpus={list(gpus)}: one device index per rank of {world_size}, "
                         "with a device and without hosts")
    if topology is None and settings.device != "off":  # its ranks share this process's GPU
        facts = gpu_facts(settings.device)
        if gpus is None:
            topology = Topology((RankFacts.here(**facts),) * world_size)
        else:  # each rank on the device it names
            runtime = named_runtime(runtime_name(settings.device) or "")
            topology = Topology(tuple(
                RankFacts.here(**{**facts, "gpu": runtime.device_identity(index)})
                for index in gpus))
    table = Table()

    def make(r: int) -> Communicator:
        return Communicator(net.transport(r), timeout=timeout, settings=settings,
                            segment_bytes=segment_bytes, topology=topology,
                            connect=connector(r), wrappers=wrapping,
                            exchange=TableExchange(table, r))

    on_device = settings.device != "off"
    comms: list[Communicator | None] = [None if on_device else make(r)
                                        for r in range(world_size)]
    results: list[Any] = [None] * world_size

    def rank_main(r: int) -> None:
        try:
            comm = comms[r]
            if comm is None:  # the device set-up is collective: every rank at once
                if gpus is not None:
                    named_runtime(runtime_name(settings.device) or "").set_device(gpus[r])
                comm = comms[r] = make(r)
            results[r] = fn(comm)
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
    if on_device:  # a device channel's close is collective too: every rank at once
        closing = [threading.Thread(target=_close_into, args=(comm, results, r), daemon=True)
                   for r, comm in enumerate(comms) if comm is not None]
        for t in closing:
            t.start()
        for t in closing:
            t.join(timeout + 30.0)
    else:
        for r, comm in enumerate(comms):
            assert comm is not None
            _close_into(comm, results, r)
    if not return_errors:
        for res in results:
            if isinstance(res, BaseException):
                raise res
    return results


def _close_into(comm: Communicator, results: list[Any], r: int) -> None:
    """Close rank ``r``'s communicator; an error only close could see is the rank's result."""
    try:
        comm.close()
    except (CommError, RuntimeError) as err:  # a disagreement only close could see, or
        if not isinstance(results[r], BaseException):  # device memory it could not give
            results[r] = err                            # back: the rank's error
