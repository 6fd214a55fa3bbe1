"""``explain``: one collective run for real, cut into rounds, checked and priced.

Everything the teaching views show (``ringcomm explain``'s text, its SVG, its page, its
terminal animation) is read from one ``Explanation``, which holds the run itself: every
rank's schedule, every step with the buffers after it, and the result each rank got.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ArgumentError
from ..plan.collectives import COLLECTIVES
from ..plan.cost import CostParams
from ..schedules.schedule import Schedule
from .costs import Costs, costs
from .record import DTYPE, Call, Hosts, RankRun, inputs, resolve, run
from .rounds import Round, rounds


@dataclass
class Explanation:
    call: Call
    runs: list[RankRun]
    rounds: list[Round]
    expected: list[np.ndarray | None]  # numpy's result for every rank (the oracle)
    costs: Costs

    @property
    def schedules(self) -> list[Schedule]:
        return [run.schedule for run in self.runs]

    @property
    def results(self) -> list[np.ndarray | None]:
        """What the collective left in each rank's result buffer."""
        return [run.result for run in self.runs]

    @property
    def correct(self) -> bool:
        return all((a is None and b is None) or (a is not None and b is not None
                                                 and np.array_equal(a, b))
                   for a, b in zip(self.results, self.expected, strict=True))

    @property
    def messages(self) -> int:
        return sum(len(r.transfers) for r in self.rounds)

    @property
    def roles(self) -> tuple[str, ...]:
        """The buffers shown, in order: the collective's own, then scratch where used."""
        seen: dict[str, None] = {}
        for rank_run in self.runs:
            for role in rank_run.before:
                seen.setdefault(role, None)
        order = ("data", "input", "output", "scratch")
        return tuple(r for r in order if r in seen)


def explain(collective: str = "allreduce", algorithm: str | None = None, world_size: int = 4,
            count: int | None = None, *, root: int = 0, op: str = "sum", segment: int = 0,
            hosts: Hosts | None = None, params: CostParams | None = None,
            source: str = "") -> Explanation:
    """Run ``collective`` with ``algorithm`` on ``world_size`` in-process ranks and explain
    it. ``count``: the elements of the vector (allreduce, broadcast, reduce) or of one
    rank's block (the collectives whose buffers hold a block per rank); default one element
    per rank, or two per block. ``hosts`` lays the ranks out on hosts (``hosts_of``);
    ``params`` prices it (default: this machine's profile)."""
    name = resolve(collective, algorithm)
    if hosts is not None:  # the layout says how many ranks there are
        world_size = sum(len(h) for h in hosts)
    if collective == "barrier":
        count = 0  # it moves no data: its messages are empty
    elif count is None:
        count = 2 if COLLECTIVES[collective].blocked else world_size
    if count < 0:
        raise ArgumentError(f"the count must not be negative, got {count}")
    if segment < 0:
        raise ArgumentError(f"the segment must not be negative, got {segment}")
    call = Call(collective, name, world_size, count, root, op, segment, hosts)
    runs = run(call)
    source_role = call.spec.source
    start = [ins.get(source_role) for ins in inputs(call)]
    expected = call.spec.reference(start, op, root)
    return Explanation(call, runs, rounds(call, runs), expected,
                       costs(call, [r.schedule for r in runs], DTYPE.itemsize, params, source))
