"""The few places the benchmarks call into ringcomm's algorithm choice and cost model.

Kept in one module so that when those interfaces change only this file follows. Predicted
times come from ``ringcomm.plan.cost.predict`` where it models the collective (allreduce); for
the others the same replay (``ringcomm.plan.cost.simulate``) runs on the schedules the
communicator builds for that call, with the same fitted profile and core sharing.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ringcomm.plan import cost
from ringcomm.plan.collectives import COLLECTIVES, Collective
from ringcomm.plan.select import Group, Selector
from ringcomm.plan.settings import Settings
from ringcomm.plan.topology import Topology
from ringcomm.schedules import ALLREDUCE, ON_BOARD


def collective(name: str) -> Collective:
    """The table of collectives' entry for ``name``: its buffers' sizes and blocks, its
    busbw factor and its numpy reference."""
    return COLLECTIVES[name]


def allreduce_algorithms(board: bool = False) -> list[str]:
    """Names of the allreduce algorithms the communicator can be forced to use; with
    ``board``, the shared board's too (ranks of one host only)."""
    return [*ALLREDUCE, *ON_BOARD] if board else list(ALLREDUCE)


def allreduce(comm: Any, x: Any, op: str, algorithm: str | None) -> Any:
    """``comm.allreduce`` with ``algorithm`` forced, or the cost model's choice for None."""
    return comm.allreduce(x, op=op, algorithm=algorithm)


def chosen_algorithm(comm: Any, nbytes: int, itemsize: int) -> str:
    """The allreduce algorithm ``comm`` picks by itself for this call (the shared board for
    what fits it, where the group has one; else the cost model's choice)."""
    return comm.allreduce_algorithm(nbytes, itemsize)


def predicted_seconds(collective: str, algorithm: str | None, world_size: int, nbytes: int,
                      itemsize: int, segment_bytes: int) -> float | None:
    """Cost-model time of one call; ``nbytes`` is the nccl-tests size (see ``sweep``).

    None where there is nothing to predict (an empty message, or the shared board's
    algorithms, which the model does not cover: a group with a board takes them by size, not
    by cost)."""
    if nbytes == 0:
        return None
    if collective == "allreduce":
        algorithm = algorithm or cost.choose("allreduce", world_size, nbytes, itemsize,
                                             segment_bytes=segment_bytes)
        if algorithm not in ALLREDUCE:
            return None
        return cost.predict("allreduce", algorithm, world_size, nbytes, itemsize,
                            segment_bytes=segment_bytes)
    return _replayed(collective, world_size, nbytes // itemsize, itemsize, segment_bytes)


def schedules_for(collective: str, n: int, count: int, itemsize: int, seg: int) -> list[Any]:
    """The schedules ``Communicator`` builds on every rank for a collective other than
    allreduce, root 0 (``count`` as nccl-tests has it, ``seg`` in elements)."""
    spec = COLLECTIVES.get(collective)
    if spec is None or collective == "allreduce":  # allreduce: the cost model's own replay
        raise ValueError(f"no schedule replay for collective {collective!r}")
    block = spec.block(count, n)
    algorithm = _selector(n, seg * itemsize).choose(collective, block * itemsize,
                                                    itemsize).algorithm
    return [spec.schedule(r, n, block, seg, algorithm=algorithm) for r in range(n)]


@lru_cache(maxsize=64)
def _selector(n: int, segment_bytes: int) -> Selector:
    """The choices of a group of ``n`` ranks over links (the cost model does not price the
    shared board), as the communicator's selector makes them."""
    return Selector(Group(n, False, Settings(), Topology.single_host(n), segment_bytes))


@lru_cache(maxsize=1024)
def _replayed(collective: str, n: int, count: int, itemsize: int, segment_bytes: int) -> float:
    """Replay the schedules ``Communicator`` builds for ``collective`` (count: nccl-tests)."""
    schedules = schedules_for(collective, n, count, itemsize, max(1, segment_bytes // itemsize))
    params = cost.load_profile().for_world(n)
    return cost.simulate(schedules, itemsize, params).time(params, cost.cores_per_rank(n))


def device_choice(comm: Any, collective: str, world_size: int, nbytes: int, itemsize: int,
                  algorithm: str | None = None) -> tuple[str | None, float | None]:
    """What a communicator made for device memory runs for a call on ``nbytes`` of its
    device memory (``engine:algorithm``; ``algorithm`` forced where given), and, for
    allreduce, the cost model's time for it with that engine's constants (tuned on a GPU,
    else the defaults), as the selector prices it: one rank per GPU's share of nothing, the
    host's cores left out (``share=1``)."""
    if nbytes == 0 or comm.device is None:
        return None, None
    choice = comm.selector.choose(collective, nbytes, itemsize, memory=comm.device.memory,
                                  forced=algorithm)
    chosen = f"{choice.engine}:{choice.algorithm}"
    if collective == "allreduce" and choice.algorithm == "nccl":
        return chosen, cost.nccl_own_allreduce(world_size, nbytes, itemsize,
                                               comm.settings.device_cost(choice.engine))
    if collective != "allreduce" or choice.algorithm not in ALLREDUCE:
        return chosen, None
    return chosen, cost.predict("allreduce", choice.algorithm, world_size, nbytes, itemsize,
                                segment_bytes=choice.segment_bytes,
                                params=comm.settings.device_cost(choice.engine), share=1.0,
                                hosts=comm.topology.hosts)
