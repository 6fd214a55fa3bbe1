"""What one op carries while an engine runs it (``OpContext``), what a step observer is told
of each step (``StepObserver``), and the record of one step a test keeps (``TraceEvent``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..core.dtypes import ReduceOp
from ..schedules.schedule import Step
from ..transport.header import OpDescriptor


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


# told of every step an engine runs, where someone watches (a tracer): the step's index in
# its schedule, the step, and when it started and ended (``time.perf_counter``); None costs
# nothing. The op, algorithm and engine are the watcher's to know (it wraps the engine).
StepObserver = Callable[[int, Step, float, float], None]


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
