"""The table of collectives: one record per collective, read by everything that needs to
know what a collective is.

The communicator, ``ringcomm schedule``, the benchmark and the tests all ask the same
questions of a collective: which buffers does a rank hold and how large are they, which
schedule runs it, how many elements does each pair of ranks agree on, what is its bus
bandwidth factor, and what must the result be. Asked in four places, the answers drift
apart; here each collective answers them once (nccl-tests keeps a ``struct testColl`` per
collective for the same reason).

Counts follow nccl-tests. A collective's *count* is the number of elements of the larger
buffer one rank holds; its *block* is the count the schedule cuts and every pair of ranks
agrees on (the op descriptor's count): the whole vector for allreduce, broadcast and reduce,
one rank's share (``count // world``) for the collectives whose buffers hold one block per
rank. Buffers are named as the schedules' regions name them: ``data`` (read and written in
place), ``input`` and ``output``.

The bus bandwidth factor turns ``algbw = bytes / time`` into a figure comparable with the
links' bandwidth whatever the collective (``busbw = algbw * factor``, nccl-tests'
``PERFORMANCE.md``)::

    allreduce 2(n-1)/n    allgather, reduce_scatter, alltoall, gather, scatter (n-1)/n
    broadcast, reduce 1   barrier 0 (it moves no data)

``reference`` computes every rank's result with numpy alone, folding the ranks' inputs in
rank order: the oracle that tests and the benchmark check results against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..core.algorithms import (
    ALGORITHMS,
    ALLREDUCE_KERNELS,
    KERNEL_COLLECTIVES,
    KERNEL_DIRECT,
    NCCL_OWN,
)
from ..schedules import ALLREDUCE, allreduce_schedule, board, direct, ring, rooted
from ..schedules.schedule import Schedule
from ..transport.header import OpKind

Hosts = tuple[tuple[int, ...], ...]
# (rank, world, block, segment, *, root, hosts, send_counts, recv_counts) -> Schedule; each
# takes the keywords it needs and ignores the rest
Builder = Callable[..., Schedule]


@dataclass(frozen=True)
class Role:
    """One buffer of a collective on one rank."""

    name: str  # the schedules' region name: "data", "input" or "output"
    world_blocks: bool = False  # holds one block per rank, not a single block
    root_only: bool = False  # only the root holds it (gather's output, scatter's input)

    def elements(self, block: int, world: int) -> int:
        return block * world if self.world_blocks else block


@dataclass(frozen=True)
class Algorithm:
    """One way to run a collective: the schedule it builds, under the name the schedule and
    the wire give it."""

    name: str
    summary: str  # one line for people (``ringcomm schedule --help``)
    build: Builder

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(f"algorithm {self.name!r} has no row in the registry of "
                             "algorithms (ringcomm.core.algorithms): add one")

    @property
    def word(self) -> str:
        """The word ``ringcomm schedule`` appends to the collective's name: the algorithm's
        one name, as everywhere else (``broadcast_binomial``)."""
        return self.name


def _fold(op: str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``op`` over the arrays in rank order, in their dtype (``avg`` divides the sum once)."""
    total = arrays[0].copy()
    for a in arrays[1:]:
        _FOLDS[op](total, a, out=total)
    if op == "avg":
        total = (total / len(arrays)).astype(total.dtype)
    return total


_FOLDS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
          "max": np.maximum, "band": np.bitwise_and, "bor": np.bitwise_or,
          "bxor": np.bitwise_xor}

Inputs = Sequence["np.ndarray | None"]
Outputs = list["np.ndarray | None"]


def _every(inputs: Inputs) -> list[np.ndarray]:
    """``inputs`` of a collective that every rank feeds (all but scatter)."""
    arrays = [x for x in inputs if x is not None]
    if len(arrays) != len(inputs):
        raise ValueError("every rank needs an input for this collective; some have None")
    return arrays


def _root_input(inputs: Inputs, root: int) -> np.ndarray:
    """The root's input of a collective that only the root feeds (broadcast, scatter)."""
    x = inputs[root]
    if x is None:
        raise ValueError(f"the root (rank {root}) needs an input; it has None")
    return x


def _blocks(x: np.ndarray, world: int) -> list[np.ndarray]:
    if x.size % world:
        raise ValueError(f"{x.size} elements do not split into {world} equal blocks")
    return np.split(x, world)


def _allreduce(inputs: Inputs, op: str, root: int) -> Outputs:
    total = _fold(op, _every(inputs))
    return [total.copy() for _ in inputs]


def _reduce_scatter(inputs: Inputs, op: str, root: int) -> Outputs:
    return [block.copy() for block in _blocks(_fold(op, _every(inputs)), len(inputs))]


def _allgather(inputs: Inputs, op: str, root: int) -> Outputs:
    return [np.concatenate(_every(inputs)) for _ in inputs]


def _broadcast(inputs: Inputs, op: str, root: int) -> Outputs:
    return [_root_input(inputs, root).copy() for _ in inputs]


def _reduce(inputs: Inputs, op: str, root: int) -> Outputs:
    arrays = _every(inputs)
    total = _fold(op, arrays)
    return [total if r == root else x.copy() for r, x in enumerate(arrays)]


def _gather(inputs: Inputs, op: str, root: int) -> Outputs:
    return [np.concatenate(_every(inputs)) if r == root else None for r in range(len(inputs))]


def _scatter(inputs: Inputs, op: str, root: int) -> Outputs:
    return [block.copy() for block in _blocks(_root_input(inputs, root), len(inputs))]


def _alltoall(inputs: Inputs, op: str, root: int) -> Outputs:
    n = len(inputs)
    blocks = [_blocks(x, n) for x in _every(inputs)]
    return [np.concatenate([blocks[src][dst] for src in range(n)]) for dst in range(n)]


def _barrier(inputs: Inputs, op: str, root: int) -> Outputs:
    return [x.copy() for x in _every(inputs)]


@dataclass(frozen=True, eq=False)
class Collective:
    """Everything about one collective that does not depend on a particular call."""

    name: str
    kind: OpKind  # as the op descriptor on the wire names it
    reduces: bool  # takes a reduce op
    rooted: bool  # takes a root
    roles: tuple[Role, ...]  # the buffers a rank holds
    algorithms: Mapping[str, Algorithm]  # the first is the collective's main one
    busbw_factor: Callable[[int], float]  # world size -> nccl-tests' bus bandwidth factor
    _reference: Callable[[Inputs, str, int], Outputs]

    @property
    def source(self) -> str:
        """The buffer a rank's contribution is read from."""
        return "data" if self.roles[0].name == "data" else "input"

    @property
    def result(self) -> str:
        """The buffer the result is written to."""
        return "data" if self.roles[0].name == "data" else "output"

    @property
    def blocked(self) -> bool:
        """Whether a rank's buffers are cut into one block per rank."""
        return any(role.world_blocks for role in self.roles)

    def role(self, name: str) -> Role:
        return next(role for role in self.roles if role.name == name)

    def block(self, count: int, world: int) -> int:
        """The block (schedule and descriptor count) for nccl-tests' ``count``: the
        elements of the larger buffer a rank holds."""
        return count // world if self.blocked else count

    def sizes(self, block: int, world: int, *, rank: int = 0, root: int = 0) -> dict[str, int]:
        """Elements of each buffer ``rank`` holds, for ``block``."""
        return {role.name: role.elements(block, world) for role in self.roles
                if not role.root_only or rank == root}

    def schedule(self, rank: int, world: int, block: int, segment: int, *, root: int = 0,
                 algorithm: str | None = None, hosts: Hosts | None = None,
                 send_counts: tuple[int, ...] | None = None,
                 recv_counts: tuple[int, ...] | None = None, piece: int = 0) -> Schedule:
        """``rank``'s steps for one call: ``block`` elements (see ``block``), ``segment``
        elements per message at most. ``algorithm`` picks one of ``algorithms``. ``hosts``
        reaches the host-aware algorithms; ``send_counts`` and
        ``recv_counts`` give an all-to-all's uneven splits; ``piece`` is how many elements
        one post on the shared board holds, for the algorithms that post in pieces (0: all
        of them in one post, for schedules that are printed or checked rather than run: a
        communicator passes its board's size). ``nccl`` (NCCL's own call, on the nccl engine)
        has no steps. Which algorithm a call runs is the selector's
        choice (``ringcomm.plan.select``); without one this is the main algorithm, and an
        allreduce, which has no main one, needs it."""
        name = algorithm
        if name == "nccl" and self.name in NCCL_OWN:  # one NCCL call: no steps of ours
            return Schedule(self.name, "nccl", rank, world, ())
        if (name in ALLREDUCE_KERNELS and self.name == "allreduce") or (
                name == KERNEL_DIRECT and self.name in KERNEL_COLLECTIVES):  # one kernel
            return Schedule(self.name, name, rank, world, ())  # per piece: no steps of ours
        if name is None:
            if self.name == "allreduce":
                raise ValueError("allreduce runs the algorithm its caller chose (the "
                                 "selector's, or a forced one): pass algorithm=")
            name = next(iter(self.algorithms))
        try:
            build = self.algorithms[name].build
        except KeyError:
            raise ValueError(f"{self.name} has no algorithm {name!r}; it has "
                             f"{', '.join(self.algorithms)}") from None
        return build(rank, world, block, segment, root=root, hosts=hosts,
                     send_counts=send_counts, recv_counts=recv_counts, piece=piece)

    def reference(self, inputs: Inputs, op: str = "sum", root: int = 0) -> Outputs:
        """Every rank's result, from every rank's ``source`` buffer (None where a rank
        holds none: a scatter's non-roots): the ``result`` buffer of each rank, None where
        a rank gets none (a gather's non-roots)."""
        return self._reference(inputs, op, root)


def _algorithms(*algorithms: Algorithm) -> Mapping[str, Algorithm]:
    return MappingProxyType({a.name: a for a in algorithms})


def _allreduce_algorithm(name: str, summary: str) -> Algorithm:
    return Algorithm(name, summary, lambda r, n, c, s, hosts, **_:
                     allreduce_schedule(name, r, n, c, s, hosts))


def _same(n: int) -> float:
    return 1.0


def _spread(n: int) -> float:
    return (n - 1) / n


_DATA = (Role("data"),)
# Not candidates of the cost model (``ALLREDUCE``): the communicator takes them for the
# sizes they serve, where its group has a board (``Communicator.allreduce_algorithm``).
_BOARD_ALLREDUCE = (
    Algorithm("board", "every rank posts its vector on the shared board and folds everyone's "
              "in rank order (one host, small messages)",
              lambda r, n, c, s, **_: board.allreduce(r, n, c)),
    Algorithm("twoshot", "on the shared board, piece by piece: each rank folds its chunk from "
              "everyone's post, then takes everyone's folded chunk (one host)",
              lambda r, n, c, s, piece, **_: board.allreduce_twoshot(r, n, c, piece)),
)

_TABLE = (
    Collective(
        "allreduce", OpKind.ALLREDUCE, reduces=True, rooted=False, roles=_DATA,
        algorithms=_algorithms(*(_allreduce_algorithm(name, ALGORITHMS[name].summary)
                                 for name in ALLREDUCE), *_BOARD_ALLREDUCE),
        busbw_factor=lambda n: 2 * (n - 1) / n, _reference=_allreduce),
    Collective(
        "reduce_scatter", OpKind.REDUCE_SCATTER, reduces=True, rooted=False,
        roles=(Role("input", world_blocks=True), Role("output")),
        algorithms=_algorithms(Algorithm(
            "ring", "ring reduce-scatter; rank r ends with chunk r (count per rank)",
            lambda r, n, c, s, **_: ring.reduce_scatter(r, n, c, s))),
        busbw_factor=_spread, _reference=_reduce_scatter),
    Collective(
        "allgather", OpKind.ALLGATHER, reduces=False, rooted=False,
        roles=(Role("input"), Role("output", world_blocks=True)),
        algorithms=_algorithms(
            Algorithm("ring", "ring all-gather (count per rank)",
                      lambda r, n, c, s, **_: ring.allgather(r, n, (c,) * n, s)),
            Algorithm("board", "every rank posts its block on the shared board and takes "
                      "everyone's (one host, small messages)",
                      lambda r, n, c, s, **_: board.allgather(r, n, c))),
        busbw_factor=_spread, _reference=_allgather),
    Collective(
        "broadcast", OpKind.BROADCAST, reduces=False, rooted=True, roles=_DATA,
        algorithms=_algorithms(
            Algorithm("chain", "pipelined chain from the root",
                      lambda r, n, c, s, root, **_:
                      rooted.broadcast_chain(r, n, root, c, s)),
            Algorithm("binomial", "binomial tree from the root (small messages)",
                      lambda r, n, c, s, root, **_:
                      rooted.broadcast_binomial(r, n, root, c, s)),
            Algorithm("board", "the root posts on the shared board, every rank takes it and "
                      "checks every header (one host, small messages)",
                      lambda r, n, c, s, root, **_: board.broadcast(r, n, root, c))),
        busbw_factor=_same, _reference=_broadcast),
    Collective(
        "reduce", OpKind.REDUCE, reduces=True, rooted=True, roles=_DATA,
        algorithms=_algorithms(Algorithm(
            "chain", "pipelined chain towards the root",
            lambda r, n, c, s, root, **_: rooted.reduce_chain(r, n, root, c, s))),
        busbw_factor=_same, _reference=_reduce),
    Collective(
        "gather", OpKind.GATHER, reduces=False, rooted=True,
        roles=(Role("input"), Role("output", world_blocks=True, root_only=True)),
        algorithms=_algorithms(Algorithm(
            "direct", "every rank sends its block to the root",
            lambda r, n, c, s, root, **_: direct.gather(r, n, root, c, s))),
        busbw_factor=_spread, _reference=_gather),
    Collective(
        "scatter", OpKind.SCATTER, reduces=False, rooted=True,
        roles=(Role("input", world_blocks=True, root_only=True), Role("output")),
        algorithms=_algorithms(Algorithm(
            "direct", "the root sends each rank its block",
            lambda r, n, c, s, root, **_: direct.scatter(r, n, root, c, s))),
        busbw_factor=_spread, _reference=_scatter),
    Collective(
        "alltoall", OpKind.ALLTOALL, reduces=False, rooted=False,
        roles=(Role("input", world_blocks=True), Role("output", world_blocks=True)),
        algorithms=_algorithms(Algorithm(
            "pairwise", "pairwise exchange, count elements per pair",
            lambda r, n, c, s, send_counts, recv_counts, **_: direct.alltoall(
                r, n, (c,) * n if send_counts is None else send_counts,
                (c,) * n if recv_counts is None else recv_counts, s))),
        busbw_factor=_spread, _reference=_alltoall),
    Collective(
        "barrier", OpKind.BARRIER, reduces=False, rooted=False, roles=_DATA,
        algorithms=_algorithms(
            Algorithm("dissemination", "dissemination barrier: log2(n) rounds of empty messages",
                      lambda r, n, c, s, **_: direct.barrier(r, n)),
            Algorithm("board", "every rank posts on the shared board and waits for every "
                      "other's post (one host)", lambda r, n, c, s, **_: board.barrier(r, n))),
        busbw_factor=lambda n: 0.0, _reference=_barrier),
)

# name -> record, in the order ``ringcomm schedule`` lists them
COLLECTIVES: Mapping[str, Collective] = MappingProxyType({c.name: c for c in _TABLE})
