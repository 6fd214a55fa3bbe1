"""What an engine is: the thing that runs one rank's schedule of an op.

Engines sit side by side: the link executor (``links``: messages between pairs of ranks,
over the transport's links) and the board (``board``: posts and takes on the shared memory
of one host's ranks); device engines (CUDA IPC, NCCL) are more of the same. Each is one
module with one class behind this interface, so the communicator hands a call to whichever
engine the selector (``ringcomm.plan.select``) named, and a wrapper (a tracer, a fault
injector) stands in front of any of them the same way (``EngineWrapper``).

An engine says which memory it moves (``moves``); a buffer whose memory lives elsewhere is
staged by its kind before the engine sees it (``ringcomm.core.arrays``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from ..core.arrays import HOST_ONLY, Buffer
from ..schedules.schedule import Schedule
from .context import OpContext


class Engine(abc.ABC):
    """Runs one rank's schedules of the algorithms the registry gives it (``name``: the
    engine the registry of algorithms names, ``ringcomm.core.algorithms``)."""

    name = "engine"
    moves = HOST_ONLY
    # whether it plans from every rank's schedule of an op (``OpContext.schedule_of``): only
    # then does an op carry a way to build them
    plans_from_every_rank = False

    @abc.abstractmethod
    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        """Execute ``schedule`` on ``buffers`` (of ``ctx.dtype``, keyed by role); return once
        this rank's part is done and its buffers may be reused."""

    def plan_allreduce(self, schedule: Schedule, desc: Any, reduce: Any, itemsize: int) -> Any:
        """A plan for ``allreduce_now``: an engine's fast entry for a blocking allreduce,
        where it has one (the board); None where it has not."""
        return None

    def allreduce_now(self, plan: Any, data: Buffer, seq: int, deadline: float, name: str,
                      observe: Any = None) -> None:
        """Run a planned blocking allreduce (``plan_allreduce``) on ``data`` as op ``seq``,
        on the caller's thread from start to end."""
        raise NotImplementedError(f"the {self.name} engine has no fast entry")

    def describe(self) -> str:
        return self.name


class EngineWrapper(Engine):
    """An engine in front of another (``inner``): every call goes through unchanged unless
    a subclass overrides it. The base of what watches or changes every op of an engine."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.name = inner.name
        self.moves = inner.moves
        self.plans_from_every_rank = inner.plans_from_every_rank

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        self.inner.run(schedule, buffers, ctx)

    def plan_allreduce(self, schedule: Schedule, desc: Any, reduce: Any, itemsize: int) -> Any:
        return self.inner.plan_allreduce(schedule, desc, reduce, itemsize)

    def allreduce_now(self, plan: Any, data: Buffer, seq: int, deadline: float, name: str,
                      observe: Any = None) -> None:
        self.inner.allreduce_now(plan, data, seq, deadline, name, observe)

    def describe(self) -> str:
        return self.inner.describe()
