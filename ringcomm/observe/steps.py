"""A wrapper that keeps every step every engine runs, in a list: for tests and teaching tools
that ask which steps ran, in which order, by which algorithm on which engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.arrays import Buffer
from ..engines.base import Engine, EngineWrapper
from ..engines.context import OpContext, StepObserver, also
from ..engines.wrapping import Wrapper
from ..schedules.schedule import Schedule, Step


@dataclass(slots=True)
class TraceEvent:
    """One executed step: when it started and ended (``time.perf_counter``), in which op,
    run by which algorithm on which engine (so a trace shows every automatic choice)."""

    rank: int
    index: int
    step: Step
    start: float
    end: float
    op: str = ""
    algorithm: str = ""
    engine: str = ""


class StepLog(Wrapper):
    """Appends a ``TraceEvent`` to ``events`` for every step of every op (ranks that are
    threads of one process may share one list: ``list.append`` is atomic)."""

    name = "steps"

    def __init__(self, events: list[TraceEvent]) -> None:
        self.events = events

    def engine(self, engine: Engine) -> Engine:
        return _Logged(engine, self.events.append)


class _Logged(EngineWrapper):
    def __init__(self, inner: Engine, append: Callable[[TraceEvent], None]) -> None:
        super().__init__(inner)
        self._append = append

    def _observer(self, rank: int, op: str, algorithm: str) -> StepObserver:
        append, engine = self._append, self.name

        def observe(index: int, step: Step, start: float, end: float) -> None:
            append(TraceEvent(rank, index, step, start, end, op, algorithm, engine))
        return observe

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        ctx.observe = also(ctx.observe, self._observer(schedule.rank, ctx.name,
                                                       schedule.algorithm))
        self.inner.run(schedule, buffers, ctx)

    def allreduce_now(self, plan: Any, data: Buffer, seq: int, deadline: float, name: str,
                      observe: Any = None) -> None:
        schedule = plan.program.schedule
        self.inner.allreduce_now(plan, data, seq, deadline, name,
                                 also(observe, self._observer(schedule.rank, name,
                                                              schedule.algorithm)))
