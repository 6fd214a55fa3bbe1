"""What one op carries while it runs (``OpContext``), and what a trace records of each
step (``TraceEvent``): shared by the executor of link schedules and the board's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.dtypes import ReduceOp
from ..schedules.schedule import Step
from ..transport.header import OpDescriptor


@dataclass(slots=True)  # made once per op
class OpContext:
    """One op as it runs: its descriptor (what goes into every header), its name for
    errors, its buffers' dtype and reduction, and its deadline."""

    desc: OpDescriptor
    name: str
    dtype: np.dtype
    deadline: float
    reduce: ReduceOp | None = None


@dataclass(slots=True)
class TraceEvent:
    """One executed step, for timelines: when it started and ended (``time.perf_counter``),
    in which op, run by which algorithm (so a trace shows every automatic choice)."""

    rank: int
    index: int
    step: Step
    start: float
    end: float
    op: str = ""
    algorithm: str = ""
