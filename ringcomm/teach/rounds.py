"""From a recorded run to rounds: which message went where when, and every rank's buffers
after each round.

A schedule is a list of steps per rank, with no clock. Rounds are the clock a reader needs,
counted as a synchronous machine would: a message a rank sends after taking in round ``k``'s
data travels in round ``k + 1``, and a rank takes in a message in the round it travelled or,
when it was busy taking a later one, in that later round. So rounds follow the data, not
the labels algorithms give their steps: a tree's levels, a ring's steps, a pipeline's
segments each come out as rounds, the same way for every algorithm.

Each message is one ``Transfer`` (sends and receives matched in order per pair, as the
links deliver them); local copies are ``LocalCopy``. A rank's buffers after round ``k`` are
its buffers after the last step that wrote them in a round up to ``k``, which is well
defined because the rounds of a rank's writing steps never go down.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..schedules.schedule import Kind, Region
from .record import Call, RankRun

_SENDS = (Kind.SEND, Kind.RECV_REDUCE_SEND)
_RECEIVES = (Kind.RECV, Kind.RECV_REDUCE, Kind.RECV_REDUCE_SEND)
_WRITTEN_LATER = ("output", "scratch")  # unknown until a step writes them


@dataclass(frozen=True)
class Transfer:
    """One message: ``sender``'s ``src`` into ``receiver``'s ``dst``, added to what is there
    (``reduces``) or copied over it, taken in ``round``; forwarded on to ``forward`` where
    the receiver sends the sum straight on (a fused step)."""

    round: int
    sender: int
    receiver: int
    src: Region
    dst: Region
    reduces: bool
    phase: str
    chunk: int = -1
    forward: int = -1

    def describe(self) -> str:
        what = f"chunk {self.chunk} ({self.src})" if self.chunk >= 0 else str(self.src)
        verb = "added into" if self.reduces else "copied into"
        tail = f", sum sent on to rank {self.forward}" if self.forward >= 0 else ""
        return f"rank {self.sender} -> rank {self.receiver}: {what}, {verb} {self.dst}{tail}"


@dataclass(frozen=True)
class LocalCopy:
    round: int
    rank: int
    src: Region
    dst: Region
    phase: str


@dataclass
class Round:
    """Round ``number`` (0: local copies before any message): its messages and copies, the
    phases they belong to, and every rank's buffers after it (``known`` marks the elements
    of buffers that start undefined, an output or scratch, once a step has written them)."""

    number: int
    transfers: list[Transfer] = field(default_factory=list)
    copies: list[LocalCopy] = field(default_factory=list)
    buffers: list[dict[str, np.ndarray]] = field(default_factory=list)
    known: list[dict[str, np.ndarray]] = field(default_factory=list)

    @property
    def phases(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for phase in [t.phase for t in self.transfers] + [c.phase for c in self.copies]:
            if phase:
                seen.setdefault(phase, None)
        return tuple(seen)

    def changed(self, rank: int, before: Round | None, role: str) -> np.ndarray:
        """Elements of ``rank``'s ``role`` that this round wrote."""
        now = self.buffers[rank][role]
        if before is None:
            return np.zeros(now.size, bool)
        was = before.buffers[rank][role]
        return (now != was) | (self.known[rank][role] & ~before.known[rank][role])


def rounds(call: Call, runs: list[RankRun]) -> list[Round]:
    """Round 0 (the buffers before the call, with any local copies made before the first
    message) and every round a message travelled in, in order."""
    n = call.world_size
    in_flight: dict[tuple[int, int], deque[tuple[int, Region]]] = {}
    clock = [0] * n
    step_round: list[list[int]] = [[0] * len(run.steps) for run in runs]
    transfers: list[Transfer] = []
    copies: list[LocalCopy] = []
    cursor = [0] * n
    while True:
        progressed = False
        for r, run in enumerate(runs):
            while cursor[r] < len(run.steps):
                step = run.steps[cursor[r]].step
                taken: tuple[int, Region] | None = None
                if step.kind in _RECEIVES:
                    queue = in_flight.get((step.peer, r))
                    if not queue:
                        break  # its message is not out yet: another rank goes first
                    taken = queue.popleft()
                if taken is not None:
                    sent_in, src = taken
                    clock[r] = max(clock[r], sent_in)
                    assert step.dst is not None
                    transfers.append(Transfer(
                        clock[r], step.peer, r, src, step.dst,
                        step.kind is not Kind.RECV, step.phase, step.chunk,
                        step.to if step.kind is Kind.RECV_REDUCE_SEND else -1))
                elif step.kind is Kind.COPY:
                    assert step.src is not None and step.dst is not None
                    copies.append(LocalCopy(clock[r], r, step.src, step.dst, step.phase))
                if step.kind in _SENDS:
                    to = step.to if step.kind is Kind.RECV_REDUCE_SEND else step.peer
                    sent = step.dst if step.kind is Kind.RECV_REDUCE_SEND else step.src
                    assert sent is not None
                    in_flight.setdefault((r, to), deque()).append((clock[r] + 1, sent))
                step_round[r][cursor[r]] = clock[r]
                cursor[r] += 1
                progressed = True
        if all(cursor[r] == len(run.steps) for r, run in enumerate(runs)):
            break
        if not progressed:
            raise RuntimeError("the recorded steps wait on each other: a receive without "
                               "its send")
    last = max((t.round for t in transfers), default=0)
    out = [Round(k) for k in range(last + 1)]
    for t in transfers:
        out[t.round].transfers.append(t)
    for c in copies:
        out[c.round].copies.append(c)
    for r, run in enumerate(runs):
        run.rounds = step_round[r]
        state, known = _start(run)
        writes = [(step_round[r][i], e) for i, e in enumerate(run.steps)
                  if e.step.kind is not Kind.SEND]
        w = 0
        for k in range(last + 1):
            while w < len(writes) and writes[w][0] <= k:
                executed = writes[w][1]
                state = executed.after
                dst = executed.step.dst
                if dst is not None and dst.buf in known:
                    known = {**known, dst.buf: known[dst.buf].copy()}
                    known[dst.buf][dst.offset: dst.offset + dst.count] = True
                w += 1
            out[k].buffers.append(state)
            out[k].known.append(known)
    return [k for k in out if k.number == 0 or k.transfers or k.copies]


def _start(run: RankRun) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    known = {role: np.full(a.size, role not in _WRITTEN_LATER) for role, a in
             run.before.items()}
    return run.before, known
