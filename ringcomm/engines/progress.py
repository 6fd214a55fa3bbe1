"""Where an op stood when it failed: the step it waited in, the peer it waited for, and the
messages and bytes it had moved (``OpProgress``), for the hang report
(``ringcomm.runtime.hang_report``).

Why it is built only on the way out: an engine already holds all of it in its locals while
it runs (the step's index, how many messages went to and came from each peer), and the
schedule says what each of those messages was. So nothing is counted or stored while an op
runs; when a wait raises, the engine's ``except`` turns its locals into one of these and
hangs it on the error (``CommError.progress``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import CodeType
from typing import Any, ParamSpec

from ..errors import CommError, CommTimeout
from ..schedules.schedule import Kind, Schedule

log = logging.getLogger("ringcomm")
_P = ParamSpec("_P")

_RECEIVES = (Kind.RECV, Kind.RECV_REDUCE, Kind.RECV_REDUCE_SEND)
_TAKES = (Kind.TAKE, Kind.TAKE_REDUCE)


@dataclass(frozen=True, slots=True)
class OpProgress:
    """One rank's place in one op: ``step`` of ``steps`` (``step == steps``: after the last
    one, waiting for its sends to leave) of ``algorithm`` on ``engine``, doing ``doing``,
    waiting for ``peer``; ``sent``/``received`` messages (posts and takes on the board) and
    their bytes done so far in this op."""

    engine: str
    algorithm: str
    step: int
    steps: int
    doing: str
    peer: int | None
    sent: int = 0
    sent_bytes: int = 0
    received: int = 0
    received_bytes: int = 0

    def where(self) -> str:
        """``step 3 of 14 of ring allreduce (links engine)``."""
        return f"step {self.step} of {self.steps} of {self.algorithm} ({self.engine} engine)"

    def done(self) -> str:
        """What this op had moved: ``2 messages sent (8 B), 1 received (4 B)`` (on the board:
        ``1 post (4 B), 2 takes (8 B)``)."""
        if self.engine == "board":
            return (f"{_count(self.sent, 'post')} ({_size(self.sent_bytes)}), "
                    f"{_count(self.received, 'take')} ({_size(self.received_bytes)})")
        return (f"{_count(self.sent, 'message')} sent ({_size(self.sent_bytes)}), "
                f"{self.received} received ({_size(self.received_bytes)})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> OpProgress:
        """The inverse of ``to_dict`` (fields a newer version added are left out)."""
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in fields.items() if k in known})


def quietly(build: Callable[_P, OpProgress]) -> Callable[_P, OpProgress | None]:
    """``build``, except that a failure of its own gives None (logged) instead of an
    exception: it runs while an op's error is on its way out, and must not replace it."""
    @functools.wraps(build)
    def built(*args: _P.args, **kwargs: _P.kwargs) -> OpProgress | None:
        try:
            return build(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the op's own error matters, not this one
            log.debug("where the failed op stood could not be told", exc_info=True)
            return None
    return built


def frame_local(err: BaseException, code: CodeType | None, name: str) -> Any:
    """The value local ``name`` had when ``err`` left the frame running ``code`` (None if
    ``err`` did not pass through one, or the name was unbound): how an engine whose loop
    keeps its step in a local learns the step on the exception path only."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return tb.tb_frame.f_locals.get(name)
        tb = tb.tb_next
    return None


def waited_for(err: CommError, step_peer: int) -> int | None:
    """The rank a failed wait was for: a timeout names it; any other error (an abort from a
    third rank) names someone else, so the step's peer (``step_peer``; -1: none known)."""
    if isinstance(err, CommTimeout) and err.peer is not None:
        return err.peer
    return step_peer if step_peer >= 0 else None


def timed_out(err: CommTimeout, progress: OpProgress | None, where: str, rank: int,
              op: str) -> CommTimeout:
    """A wait's timeout, saying where in the schedule it ran out of time and what to do,
    with where the op stood (for the hang report): what every engine that walks a
    schedule raises when a wait of one of its steps runs out of time."""
    timeout = CommTimeout(f"{err.detail}{where}. Check that every rank runs this op, or "
                          "raise the timeout.", rank=rank, op=op, peer=err.peer)
    timeout.progress = progress
    return timeout


@quietly
def over_links(schedule: Schedule, index: int, peer: int | None, sent: Sequence[int],
               received: Sequence[int], itemsize: int, *, receiving: bool,
               engine: str = "links") -> OpProgress:
    """The link engine's place: at step ``index`` of ``schedule`` (``len(steps)``: waiting for
    the last sends), having started ``sent[p]`` sends to and ``received[p]`` receives from
    each rank ``p`` (on ``engine``: the links, or a device engine walking the same
    messages); ``receiving`` says whether the step that failed had started its
    receive (counted in ``received`` but not done); a send step that failed is counted in
    ``sent`` but did not go. Each peer's messages go in schedule order, so the first
    ``sent[p]`` sends to ``p`` in the schedule are the ones that went, whatever order
    independent receives were taken in."""
    steps = schedule.steps
    to_go, to_take = list(sent), list(received)
    step = steps[index] if index < len(steps) else None
    if step is not None and step.kind is Kind.SEND:
        to_go[step.peer] -= 1
    if receiving and step is not None and step.kind in _RECEIVES:
        to_take[step.peer] -= 1
    messages = nbytes = taken = taken_bytes = 0
    for s in steps:
        if s.kind is Kind.SEND or s.kind is Kind.RECV_REDUCE_SEND:
            dest = s.peer if s.kind is Kind.SEND else s.to
            region = s.src
            if to_go[dest] > 0 and region is not None:
                to_go[dest] -= 1
                messages += 1
                nbytes += region.count * itemsize
        if s.kind in _RECEIVES and to_take[s.peer] > 0 and s.dst is not None:
            to_take[s.peer] -= 1
            taken += 1
            taken_bytes += s.dst.count * itemsize
    doing = step.describe() if step is not None else \
        "waiting for its last sends to leave this process"
    return OpProgress(engine, f"{schedule.algorithm} {schedule.collective}", index,
                      len(steps), _squeeze(doing), peer, messages, nbytes, taken, taken_bytes)


@quietly
def in_order(engine: str, schedule: Schedule, index: int, peer: int | None,
             itemsize: int, doing: str | None = None) -> OpProgress:
    """The place of an engine that runs its steps in order (the board; point-to-point) at
    step ``index`` of ``schedule``: every step before it is done. Posts and sends count as
    sent, takes and receives as received; ``doing`` says what the wait was for where the
    step alone does not (default: the step, described)."""
    steps = schedule.steps
    sent = sent_bytes = got = got_bytes = 0
    for s in steps[:index]:
        if (s.kind is Kind.POST or s.kind is Kind.SEND) and s.src is not None:
            sent += 1
            sent_bytes += s.src.count * itemsize
        elif s.kind in _TAKES or s.kind in _RECEIVES:
            got += 1
            got_bytes += (s.dst.count if s.dst is not None else 0) * itemsize
    step = steps[index] if index < len(steps) else None
    if peer is None and step is not None and step.peer >= 0:
        peer = step.peer
    if doing is None:
        doing = step.describe() if step is not None else "after its last step"
    return OpProgress(engine, f"{schedule.algorithm} {schedule.collective}", index,
                      len(steps), _squeeze(doing), peer, sent, sent_bytes, got, got_bytes)


def _squeeze(text: str) -> str:
    """A step's description on one line with single spaces (``describe`` pads columns)."""
    return " ".join(text.split())


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def _size(nbytes: int) -> str:
    """``nbytes`` for people: ``4 B``, ``1.5 KiB``, ``16.0 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
