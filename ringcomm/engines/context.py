"""What one op carries while an engine runs it (``OpContext``), and what a step observer is
told of each step (``StepObserver``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..core.dtypes import ReduceOp
from ..schedules.schedule import Schedule, Step
from ..transport.header import OpDescriptor

# told of every step an engine runs, where someone watches (a tracer): the step's index in
# its schedule, the step, and when it started and ended (``time.perf_counter``); None costs
# nothing. The op, algorithm and engine are the watcher's to know (it wraps the engine).
StepObserver = Callable[[int, Step, float, float], None]


def also(first: StepObserver | None, then: StepObserver) -> StepObserver:
    """An observer that tells ``first`` (if any) then ``then``: two watchers of one op (a
    timeline and a step log) each see every step."""
    if first is None:
        return then

    def both(index: int, step: Step, start: float, end: float) -> None:
        first(index, step, start, end)
        then(index, step, start, end)
    return both


@dataclass(slots=True)  # made once per op
class OpContext:
    """One op as it runs: its descriptor (what goes into every header), its name for
    errors, its buffers' dtype and reduction, its deadline, and who watches its steps."""

    desc: OpDescriptor
    name: str
    dtype: np.dtype
    deadline: float
    reduce: ReduceOp | None = None
    observe: StepObserver | None = None
    # rank -> that rank's schedule of this op, for an engine that plans from all of them
    # (``Engine.plans_from_every_rank``: NCCL's groups pair every message's two ends)
    schedule_of: Callable[[int], Schedule] | None = None
