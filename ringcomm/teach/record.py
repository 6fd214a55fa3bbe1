"""Run one collective for real and keep every rank's buffers after every step.

The teaching views never draw a schedule of their own: they run the collective through the
communicator, over in-memory links (one thread per rank, ``run_group``), so the link
executor runs exactly the schedules it runs in production, and a wrapper in front of the
engine copies each rank's buffers after each of its steps. What is shown is what happened.

Inputs are small integers a reader can add by eye: rank ``r`` holds ``(r + 1) * (i + 1)``
at element ``i``, so after a sum every element ``i`` is ``(i + 1)`` times the sum of the
rank numbers plus one, and a partial sum says which ranks it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.algorithms import ALGORITHMS, LINKS
from ..core.arrays import Buffer
from ..engines.base import Engine, EngineWrapper
from ..engines.context import OpContext, also
from ..engines.wrapping import Wrapper
from ..errors import ArgumentError
from ..plan.collectives import COLLECTIVES, Collective
from ..runtime.communicator import Communicator
from ..runtime.local import run_group
from ..schedules.schedule import Schedule, Step

DTYPE = np.dtype(np.int64)  # exact sums of small integers, shown as they are
Hosts = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Executed:
    """One step as a rank ran it: its index in the schedule, and the rank's buffers after."""

    index: int
    step: Step
    after: dict[str, np.ndarray]


@dataclass
class RankRun:
    """One rank's part of the run: its schedule, its buffers before the first step, every
    step in the order it ran, and the collective's result on this rank; then the round
    of each step, once ``rounds`` has counted them."""

    rank: int
    schedule: Schedule
    before: dict[str, np.ndarray]
    steps: list[Executed] = field(default_factory=list)
    result: np.ndarray | None = None
    rounds: list[int] = field(default_factory=list)  # each step's round (``rounds``)


@dataclass(frozen=True)
class Call:
    """What to run: a collective with one of its algorithms, ``block`` elements (the count
    every pair agrees on: the vector of an allreduce, one rank's block of an allgather), on
    ``world_size`` ranks laid out on ``hosts``."""

    collective: str
    algorithm: str
    world_size: int
    block: int
    root: int = 0
    op: str = "sum"
    segment: int = 0  # elements per message; 0: whole chunks
    hosts: Hosts | None = None

    @property
    def spec(self) -> Collective:
        return COLLECTIVES[self.collective]


def resolve(collective: str, algorithm: str | None) -> str:
    """The name the table of collectives gives ``algorithm`` of ``collective``, or the
    collective's main algorithm over links (the ring for an allreduce)."""
    spec = COLLECTIVES.get(collective)
    if spec is None:
        raise ArgumentError(f"unknown collective {collective!r}; use one of "
                            f"{', '.join(COLLECTIVES)}")
    links = {name: a for name, a in spec.algorithms.items()
             if ALGORITHMS[name].engine == LINKS}  # what runs over links (not the board's)
    if algorithm is None:
        return "ring" if collective == "allreduce" else next(iter(links))
    for name, a in links.items():
        if algorithm in (name, a.word):
            return name
    raise ArgumentError(f"{collective} has no algorithm {algorithm!r} over links; use one of "
                        f"{', '.join(links)}")


def inputs(call: Call) -> list[dict[str, np.ndarray]]:
    """Every rank's buffers before the call: its contribution as ``(r + 1) * (i + 1)``, the
    buffers it writes zeroed; none that the rank does not hold (a gather's output off the
    root)."""
    spec = call.spec
    out = []
    for rank in range(call.world_size):
        sizes = spec.sizes(call.block, call.world_size, rank=rank, root=call.root)
        mine = {}
        for role, n in sizes.items():
            if role == spec.source and (spec.name not in ("broadcast", "scatter")
                                        or rank == call.root):
                mine[role] = (rank + 1) * np.arange(1, n + 1, dtype=DTYPE)
            else:
                mine[role] = np.zeros(n, DTYPE)
        out.append(mine)
    return out


def run(call: Call, *, timeout: float = 20.0) -> list[RankRun]:
    """Run ``call`` on an in-process group; every rank's record, in rank order."""
    if call.world_size < 1:
        raise ArgumentError(f"the world size must be at least 1, got {call.world_size}")
    if not 0 <= call.root < call.world_size:
        raise ArgumentError(f"root {call.root} is out of range for world size "
                            f"{call.world_size}")
    if call.algorithm == "hier" and call.hosts is None:
        raise ArgumentError("hier runs on several hosts: give their layout (--hosts HxR)")
    recorder = Recorder()
    start = inputs(call)
    segment = call.segment or max(call.block, 1)

    def one_rank(comm: Communicator) -> Any:
        with comm.wrapped(recorder):
            buffers = {role: a.copy() for role, a in start[comm.rank].items()}
            _CALLS[call.collective](comm, call, buffers)
        return buffers.get(call.spec.result)

    results = run_group(call.world_size, one_rank, timeout=timeout,
                        segment_bytes=segment * DTYPE.itemsize,
                        hosts=[list(h) for h in call.hosts] if call.hosts else None)
    runs = [recorder.runs[r] for r in range(call.world_size)]
    for r, result in enumerate(results):
        runs[r].result = result
    return runs


# how a rank calls each collective on the communicator, with its buffers by role
_CALLS: dict[str, Callable[[Communicator, Call, dict[str, np.ndarray]], None]] = {
    "allreduce": lambda c, call, b: c.allreduce(b["data"], call.op, algorithm=call.algorithm),
    "reduce_scatter": lambda c, call, b: c.reduce_scatter(b["output"], b["input"], call.op),
    "allgather": lambda c, call, b: c.allgather(b["output"], b["input"]),
    "broadcast": lambda c, call, b: c.broadcast(b["data"], call.root,
                                                algorithm=call.algorithm),
    "reduce": lambda c, call, b: c.reduce(b["data"], call.root, call.op),
    "gather": lambda c, call, b: c.gather(b.get("output"), b["input"], call.root),
    "scatter": lambda c, call, b: c.scatter(b["output"], b.get("input"), call.root),
    "alltoall": lambda c, call, b: c.alltoall(b["output"], b["input"]),
    "barrier": lambda c, call, b: c.barrier(),
}


class Recorder(Wrapper):
    """Keeps, for every rank, its schedule and a copy of its buffers after every step (of
    the one op each rank runs while it is installed)."""

    name = "explain"

    def __init__(self) -> None:
        self.runs: dict[int, RankRun] = {}

    def engine(self, engine: Engine) -> Engine:
        return _Recording(engine, self.runs)


class _Recording(EngineWrapper):
    def __init__(self, inner: Engine, runs: dict[int, RankRun]) -> None:
        super().__init__(inner)
        self._runs = runs

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        sizes = {role: buf.count for role, buf in buffers.items()}  # scratch: what it needs

        def copy() -> dict[str, np.ndarray]:
            return {role: buffers[role].region(0, n).copy() for role, n in sizes.items()}

        record = self._runs[schedule.rank] = RankRun(schedule.rank, schedule, copy())

        def observe(index: int, step: Step, start: float, end: float) -> None:
            record.steps.append(Executed(index, step, copy()))
        ctx.observe = also(ctx.observe, observe)
        self.inner.run(schedule, buffers, ctx)
