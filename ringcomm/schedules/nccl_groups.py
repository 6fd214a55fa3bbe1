"""A collective's schedules as NCCL group calls: which sends and receives of each rank go
between one ``groupStart`` and ``groupEnd``, and which local work (reductions, copies)
follows that group on the stream.

Why groups: an NCCL send is a kernel that waits for its peer's matching receive. Two ranks
that each queue a send to the other and then a receive from it, as separate calls, wait for
each other for ever; inside one group NCCL runs them together. So a ring step becomes
``groupStart; send(chunk -> next); recv(tmp <- prev); groupEnd``, then the reduction of
``tmp`` into the chunk, on the same stream.

How: every message of the op gets a *level*, the same at both ends, and group ``l`` of every
rank holds exactly the calls of the messages of level ``l``, in step order; a message to be
reduced lands in a temporary and its reduction is local work after its group. Levels are the
smallest that keep each rank's steps meaning what they mean in the schedule:

- a rank's receives keep their order (a receive is never earlier than the one before it);
- a send is never earlier than the last receive before it, and comes a level after any
  receive, reduction or copy before it that writes what it reads (its group runs before
  that work, otherwise);
- a receive comes a level after any earlier call or local work that touches the memory it
  overwrites (in a group the calls run at once, and the local work after them);
- a reduction (local work after its message's group) and a copy come no earlier than the
  calls and local work before them that touch their memory.

So group ``l`` of one rank meets group ``l`` of its peers, call for call, and every rank
runs its groups in the same order: no rank can wait for a group its peer reaches only after
waiting for it. ``deadlock`` replays plans under NCCL's rule to check that, and names the
ranks that would wait for ever.

Levels need every rank's schedule (a message's level is fixed by both of its ends); a rank
computes them all, as it can, since schedules are plain data of the op's arguments.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict, deque
from dataclasses import dataclass
from enum import Enum

import numpy as np

from .schedule import Kind, Region, Schedule

TEMP = "nccl:temp"  # the buffer name of a received message waiting for its reduction


class Call(Enum):
    SEND = "send"
    RECV = "recv"


@dataclass(frozen=True)
class P2P:
    """One NCCL call: send ``region`` to ``peer``, or receive from it into ``region`` (a
    part of ``TEMP`` where the message is reduced afterwards). ``step`` is its schedule
    step."""

    call: Call
    peer: int
    region: Region
    step: int


@dataclass(frozen=True)
class Local:
    """Work on the stream after a group: ``dst = src (op) temp`` for a received message
    (``temp`` set; ``final`` where it completes the reduction, where ``avg`` divides), or a
    copy ``src -> dst``."""

    step: int
    dst: Region
    src: Region
    temp: Region | None = None
    final: bool = False


@dataclass(frozen=True)
class Group:
    """NCCL calls made between one ``groupStart`` and ``groupEnd`` (none: local work only),
    then the local work that follows, in order; ``level`` is the same at every rank."""

    level: int
    calls: tuple[P2P, ...]
    then: tuple[Local, ...]


@dataclass(frozen=True)
class Plan:
    rank: int
    groups: tuple[Group, ...]
    temp: int  # elements of temporary space the plan needs

    @property
    def calls(self) -> int:
        return sum(len(g.calls) for g in self.groups)


def _overlaps(a: Region, b: Region) -> bool:
    return a.buf == b.buf and a.offset < b.offset + b.count and b.offset < a.offset + a.count


# a message: (sender, receiver, its index among the messages from sender to receiver)
Message = tuple[int, int, int]


def _messages(schedule: Schedule) -> list[tuple[Message | None, Message | None]]:
    """For each step of ``schedule``: the message it receives and the one it sends."""
    out: list[tuple[Message | None, Message | None]] = []
    sent: dict[int, int] = defaultdict(int)
    got: dict[int, int] = defaultdict(int)
    r = schedule.rank
    for step in schedule.steps:
        taken = given = None
        if step.kind in (Kind.RECV, Kind.RECV_REDUCE, Kind.RECV_REDUCE_SEND):
            taken = (step.peer, r, got[step.peer])
            got[step.peer] += 1
        if step.kind in (Kind.SEND, Kind.RECV_REDUCE_SEND):
            to = step.to if step.kind is Kind.RECV_REDUCE_SEND else step.peer
            given = (r, to, sent[to])
            sent[to] += 1
        if step.kind in (Kind.POST, Kind.TAKE, Kind.TAKE_REDUCE):
            raise ValueError(f"{schedule.algorithm} {schedule.collective} is a board "
                             "schedule; NCCL runs schedules of messages")
        out.append((taken, given))
    return out


def levels(schedules: list[Schedule]) -> tuple[dict[Message, int], list[dict[int, int]]]:
    """Every message's level and, per rank, the level of each copy (by step), raised until
    every rank's rules hold (see the module docstring); a ``ValueError`` where they never
    do (schedules that wait on each other).

    A first pass walks the ranks together in the order the messages flow (a rank's receive
    waits until its sender has walked the send), so each message is levelled once its
    causes are; a rank is walked again only when a level of one of its messages went up
    since (a receiver's rule can raise a level its sender used)."""
    per_rank = [_messages(s) for s in schedules]
    spans = [_Spans(s) for s in schedules]
    level: dict[Message, int] = defaultdict(int)
    walkers = [_Walker(s, m, level, sp) for s, m, sp in zip(schedules, per_rank, spans,
                                                            strict=True)]
    sent: set[Message] = set()
    busy = list(range(len(schedules)))
    while busy:
        moved = False
        for r in list(busy):
            w = walkers[r]
            while not w.done:
                taken = w.messages[w.index][0]
                if taken is not None and taken not in sent:
                    break  # its sender has not walked the send yet
                given = w.step()
                if given is not None:
                    sent.add(given)
                moved = True
            if w.done:
                busy.remove(r)
        if busy and not moved:
            raise ValueError("the schedules' messages wait on each other: no NCCL grouping "
                             f"exists (ranks {busy} wait for messages never sent)")
    copies = [w.copies for w in walkers]
    queue = deque(r for r, w in enumerate(walkers) if w.raised)
    queue.extend(r for r in range(len(schedules)) if r not in queue)
    queued = set(queue)
    budget = (sum(len(s.steps) for s in schedules) + 2) * max(1, len(schedules))
    while queue:
        budget -= 1
        if budget < 0:
            raise ValueError("the schedules' messages wait on each other: no NCCL grouping "
                             "exists")
        r = queue.popleft()
        queued.discard(r)
        w = _Walker(schedules[r], per_rank[r], level, spans[r])
        w.run()
        copies[r] = w.copies
        for message in w.raised:  # its other end must be walked again (a walk sees the
            other = message[1] if message[0] == r else message[0]  # levels it raises)
            if other not in queued:
                queue.append(other)
                queued.add(other)
    return dict(level), copies


class _Spans:
    """The memory a rank's schedule names, cut at every region's ends, so that "the highest
    level that touched this region" is a max over a few array cells (a numpy slice) however
    many steps came before."""

    def __init__(self, schedule: Schedule) -> None:
        cuts: dict[str, set[int]] = defaultdict(set)
        for step in schedule.steps:
            for region in (step.src, step.dst):
                if region is not None:
                    cuts[region.buf].update((region.offset, region.offset + region.count))
        self.cuts = {buf: sorted(points) for buf, points in cuts.items()}

    def cells(self, region: Region) -> tuple[str, int, int]:
        cuts = self.cuts[region.buf]
        return region.buf, bisect_left(cuts, region.offset), \
            bisect_left(cuts, region.offset + region.count)

    def fresh(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per buffer: the highest level that wrote each cell, and that touched it (-1:
        none)."""
        return {buf: (np.full(len(c), -1), np.full(len(c), -1)) for buf, c in self.cuts.items()}


class _Walker:
    """One rank's walk through its steps, raising levels so that its rules hold (the
    module docstring): ``raised`` the messages it raised, ``copies`` the level of each of
    its copies."""

    def __init__(self, schedule: Schedule, messages: list[tuple[Message | None,
                                                                Message | None]],
                 level: dict[Message, int], spans: _Spans) -> None:
        self.schedule, self.messages, self.level, self.spans = schedule, messages, level, spans
        self.index = 0
        self.floor = 0  # the level of the rank's last receive
        self.raised: list[Message] = []
        self.copies: dict[int, int] = {}
        self.marks = spans.fresh()

    @property
    def done(self) -> bool:
        return self.index >= len(self.messages)

    def run(self) -> None:
        while not self.done:
            self.step()

    def need(self, message: Message, at_least: int) -> int:
        if self.level[message] < at_least:
            self.level[message] = at_least
            self.raised.append(message)
        return self.level[message]

    def after(self, region: Region, *, writes_only: bool, gap: int) -> int:
        """The lowest level for work on ``region``: ``gap`` levels after what touched it
        (only what wrote it, with ``writes_only``)."""
        buf, lo, hi = self.spans.cells(region)
        if hi <= lo:
            return self.floor
        seen = int(self.marks[buf][0 if writes_only else 1][lo:hi].max())
        return max(self.floor, seen + gap) if seen >= 0 else self.floor

    def touch(self, region: Region, at: int, writes: bool) -> None:
        buf, lo, hi = self.spans.cells(region)
        wrote, touched = self.marks[buf]
        np.maximum(touched[lo:hi], at, out=touched[lo:hi])
        if writes:
            np.maximum(wrote[lo:hi], at, out=wrote[lo:hi])

    def step(self) -> Message | None:
        """Walk the next step; the message it sends, if any."""
        i = self.index
        step = self.schedule.steps[i]
        taken, given = self.messages[i]
        self.index += 1
        if taken is not None:
            assert step.dst is not None
            if step.kind is Kind.RECV:  # lands in place, during its group
                self.floor = self.need(taken, self.after(step.dst, writes_only=False, gap=1))
            else:  # lands in a temporary; the reduction is local work after the group
                assert step.src is not None
                self.floor = self.need(taken, max(
                    self.after(step.dst, writes_only=False, gap=0),
                    self.after(step.src, writes_only=True, gap=0)))
                self.touch(step.src, self.floor, False)
            self.touch(step.dst, self.floor, True)
        if given is not None:
            src = step.dst if step.kind is Kind.RECV_REDUCE_SEND else step.src
            assert src is not None
            self.touch(src, self.need(given, self.after(src, writes_only=True, gap=1)), False)
        if step.kind is Kind.COPY:
            assert step.src is not None and step.dst is not None
            at = self.copies[i] = max(self.after(step.dst, writes_only=False, gap=0),
                                      self.after(step.src, writes_only=True, gap=0))
            self.touch(step.src, at, False)
            self.touch(step.dst, at, True)
        return given


def plans(schedules: list[Schedule]) -> list[Plan]:
    """Every rank's plan for one op (``schedules[r]`` is rank ``r``'s)."""
    level, copies = levels(schedules)
    return [_plan(s, _messages(s), level, c) for s, c in zip(schedules, copies, strict=True)]


def _plan(schedule: Schedule, messages: list[tuple[Message | None, Message | None]],
          level: dict[Message, int], copies: dict[int, int]) -> Plan:
    calls: dict[int, list[P2P]] = defaultdict(list)
    then: dict[int, list[Local]] = defaultdict(list)
    temp_at: dict[int, int] = defaultdict(int)
    for i, (step, (taken, given)) in enumerate(zip(schedule.steps, messages, strict=True)):
        if taken is not None:
            assert step.dst is not None
            at = level[taken]
            if step.kind is Kind.RECV:
                calls[at].append(P2P(Call.RECV, step.peer, step.dst, i))
            else:
                assert step.src is not None
                temp = Region(TEMP, temp_at[at], step.dst.count)
                temp_at[at] += step.dst.count
                calls[at].append(P2P(Call.RECV, step.peer, temp, i))
                then[at].append(Local(i, step.dst, step.src, temp, step.final))
        if given is not None:
            src = step.dst if step.kind is Kind.RECV_REDUCE_SEND else step.src
            assert src is not None
            calls[level[given]].append(P2P(Call.SEND, given[1], src, i))
        if step.kind is Kind.COPY:
            assert step.src is not None and step.dst is not None
            if step.src.count:
                then[copies[i]].append(Local(i, step.dst, step.src))
    for work in then.values():  # local work after one group runs in step order
        work.sort(key=lambda w: w.step)
    groups = tuple(Group(at, tuple(calls.get(at, ())), tuple(then.get(at, ())))
                   for at in sorted(set(calls) | set(then)))
    return Plan(schedule.rank, groups, max(temp_at.values(), default=0))


def deadlock(plans: list[Plan]) -> list[int]:
    """Replay every rank's plan as NCCL runs it; the ranks left waiting (none: it finishes).

    A rank runs its groups in order: it launches a group, and the group ends once every call
    in it has met its peer's matching call (the k-th send from a to b meets the k-th receive
    at b from a) in a group the peer has launched.
    """
    n = len(plans)
    at = [0] * n  # the group each rank has launched and not finished
    where: dict[tuple[Call, Message], int] = {}  # a call -> its group index at its rank
    for r, p in enumerate(plans):
        counts: dict[tuple[Call, int], int] = defaultdict(int)
        for g, group in enumerate(p.groups):
            for c in group.calls:
                k = counts[(c.call, c.peer)]
                counts[(c.call, c.peer)] += 1
                message = (r, c.peer, k) if c.call is Call.SEND else (c.peer, r, k)
                where[(c.call, message)] = g
    sends = {m for call, m in where if call is Call.SEND}
    recvs = {m for call, m in where if call is Call.RECV}
    if sends != recvs:
        raise ValueError(f"the plans' sends and receives do not match: "
                         f"{sorted(sends ^ recvs)[:4]}")

    def meets(r: int) -> bool:
        counts: dict[tuple[Call, int], int] = defaultdict(int)
        for g, group in enumerate(plans[r].groups[: at[r] + 1]):
            for c in group.calls:
                k = counts[(c.call, c.peer)]
                counts[(c.call, c.peer)] += 1
                if g < at[r]:
                    continue
                if c.call is Call.SEND:
                    partner = where[(Call.RECV, (r, c.peer, k))]
                else:
                    partner = where[(Call.SEND, (c.peer, r, k))]
                if partner > at[c.peer]:
                    return False
        return True

    while True:
        running = [r for r in range(n) if at[r] < len(plans[r].groups)]
        if not running:
            return []
        done = [r for r in running if meets(r)]
        if not done:
            return running
        for r in done:
            at[r] += 1
