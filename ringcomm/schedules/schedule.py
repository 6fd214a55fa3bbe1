"""Schedules: a collective as plain data, one list of steps per rank.

An algorithm never touches a socket. It returns, for one rank, the ordered steps that rank
performs: send a region to a peer, receive a region from a peer (copying it in, or reducing
it into local data), or copy a region locally; or, on the shared board of ranks that share
a host, post a region for every peer to read and take a peer's post. Regions name a buffer
role (``data`` for in-place ops, ``input``/``output`` for out-of-place ones, ``scratch`` for
partial results) and an element range, so one schedule serves every dtype and every buffer
type.

Because it is data, the same schedule is executed for real, run in one process over
in-memory links by the tests, priced by a cost model, and printed for teaching
(``print(schedule)``).

Sends never block (links queue them), so a schedule only has to put every receive after
the sends it depends on; segments are ordered so that a rank forwards segment ``k`` as soon
as it has reduced it, which is what pipelines a ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from itertools import pairwise


class Kind(Enum):
    SEND = "send"
    RECV = "recv"  # receive and copy into dst
    RECV_REDUCE = "recv+reduce"  # receive, dst = src (op) received
    # receive, reduce as RECV_REDUCE and send the result on to ``to``; ``dst`` may be left
    # as it was, because a transport with shared memory reduces straight into the outgoing
    # message (one memory pass instead of three): only for results nobody reads again
    RECV_REDUCE_SEND = "recv+reduce+send"
    COPY = "copy"  # local copy src -> dst
    # the shared board (ranks of one host): no messages, every rank reads the others' posts
    POST = "post"  # put src on the board, for every rank of the op to read
    TAKE = "take"  # wait for peer's post of this op, copy it into dst
    TAKE_REDUCE = "take+reduce"  # wait for peer's post, dst = src (op) post


@dataclass(frozen=True, slots=True)
class Region:
    """``count`` elements of buffer ``buf`` starting at element ``offset``."""

    buf: str
    offset: int
    count: int

    def __str__(self) -> str:
        return f"{self.buf}[{self.offset}:{self.offset + self.count}]"


@dataclass(frozen=True, slots=True)
class Step:
    """One action of one rank. ``final`` marks the receive that completes a reduction.

    ``phase``, ``round``, ``chunk`` and ``segment`` exist for people: they label the step in
    printouts and traces and play no part in execution. ``to`` is where a fused
    ``RECV_REDUCE_SEND`` forwards its result. ``at`` is an element of a slot on the board:
    where a post puts ``src``, and where a take starts reading the peer's post (as many
    elements as its ``dst`` holds).
    """

    kind: Kind
    peer: int = -1
    src: Region | None = None
    dst: Region | None = None
    final: bool = False
    phase: str = ""
    round: int = 0
    chunk: int = -1
    segment: int = 0
    to: int = -1
    at: int = 0

    def describe(self) -> str:
        where = f"{self.phase} round {self.round}"
        if self.chunk >= 0:
            where += f", chunk {self.chunk} seg {self.segment}"
        if self.kind is Kind.SEND:
            return f"send {self.src} -> rank {self.peer}   ({where})"
        if self.kind is Kind.RECV:
            return f"recv {self.dst} <- rank {self.peer}   ({where})"
        if self.kind is Kind.RECV_REDUCE:
            fin = ", final" if self.final else ""
            return f"recv from rank {self.peer}, {self.dst} = {self.src} (op) msg   ({where}{fin})"
        if self.kind is Kind.RECV_REDUCE_SEND:
            return (f"recv from rank {self.peer}, {self.src} (op) msg -> rank {self.to}   "
                    f"({where}, fused)")
        if self.kind is Kind.POST:
            place = f" at [{self.at}:]" if self.at else ""
            return f"post {self.src} on the board{place}   ({where})"
        if self.kind is Kind.TAKE:
            if self.dst is None or not self.dst.count:
                return f"check rank {self.peer}'s post   ({where})"
            return f"take rank {self.peer}'s {self._post_part()} -> {self.dst}   ({where})"
        if self.kind is Kind.TAKE_REDUCE:
            fin = ", final" if self.final else ""
            return (f"take rank {self.peer}'s {self._post_part()}, {self.dst} = {self.src} "
                    f"(op) post   ({where}{fin})")
        return f"copy {self.src} -> {self.dst}   ({where})"

    def _post_part(self) -> str:
        if not self.at:
            return "post"
        count = self.dst.count if self.dst is not None else 0
        return f"post[{self.at}:{self.at + count}]"


@dataclass(frozen=True)
class Schedule:
    """The steps of one rank for one collective; ``scratch`` is the scratch it needs (elements)."""

    collective: str
    algorithm: str
    rank: int
    world_size: int
    steps: tuple[Step, ...]
    scratch: int = 0
    meta: dict[str, object] = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        head = (
            f"{self.collective} ({self.algorithm}), rank {self.rank} of {self.world_size}, "
            f"{len(self.steps)} steps"
        )
        lines = [head] + [f"  {i:4d}  {s.describe()}" for i, s in enumerate(self.steps)]
        lines += [f"  steps {i}-{j - 1}: receives taken in the order they arrive"
                  for i, j in self.receive_runs.items()]
        return "\n".join(lines)

    @cached_property
    def on_board(self) -> bool:
        """Whether every step is a board step (the executor then runs it the short way)."""
        return bool(self.steps) and all(s.kind in _BOARD_KINDS for s in self.steps)

    @cached_property
    def receive_runs(self) -> dict[int, int]:
        """Runs of plain receives that may complete in any order: start index -> end index
        (exclusive). A run is two or more consecutive ``RECV`` steps from more than one peer
        into regions that do not overlap (the blocks of an all-to-all, a gather's root). The
        executor takes such receives in the order their messages arrive, keeping each
        peer's own order, so a rank is not held up by the one peer that is late."""
        runs: dict[int, int] = {}
        steps, i = self.steps, 0
        while i < len(steps):
            j = i
            while j < len(steps) and steps[j].kind is Kind.RECV:
                j += 1
            if j - i >= 2 and len({s.peer for s in steps[i:j]}) > 1 and \
                    _disjoint([_destination(s) for s in steps[i:j]]):
                runs[i] = j
            i = max(j, i + 1)
        return runs

    def messages(self) -> tuple[int, int]:
        """(messages sent, elements sent): what the cost model and the teaching views count."""
        sends = [s for s in self.steps if s.kind in (Kind.SEND, Kind.RECV_REDUCE_SEND)]
        return len(sends), sum(s.src.count for s in sends if s.src is not None)


_BOARD_KINDS = frozenset({Kind.POST, Kind.TAKE, Kind.TAKE_REDUCE})


class StepList:
    """A small builder that keeps algorithm code short and readable."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def send(self, peer: int, src: Region, **label) -> None:
        self.steps.append(Step(Kind.SEND, peer, src=src, **label))

    def recv(self, peer: int, dst: Region, **label) -> None:
        self.steps.append(Step(Kind.RECV, peer, dst=dst, **label))

    def recv_reduce(self, peer: int, dst: Region, src: Region, final: bool, **label) -> None:
        self.steps.append(Step(Kind.RECV_REDUCE, peer, src=src, dst=dst, final=final, **label))

    def recv_reduce_send(self, peer: int, to: int, dst: Region, src: Region, **label) -> None:
        """Receive from ``peer``, reduce with ``src``, send the result to ``to``. ``dst``
        receives the result only where the transport cannot fuse: nothing may read it later."""
        self.steps.append(Step(Kind.RECV_REDUCE_SEND, peer, src=src, dst=dst, to=to, **label))

    def post(self, src: Region, at: int = 0, **label) -> None:
        self.steps.append(Step(Kind.POST, src=src, at=at, **label))

    def take(self, peer: int, dst: Region, at: int = 0, **label) -> None:
        self.steps.append(Step(Kind.TAKE, peer, dst=dst, at=at, **label))

    def take_reduce(self, peer: int, dst: Region, src: Region, final: bool, at: int = 0,
                    **label) -> None:
        self.steps.append(Step(Kind.TAKE_REDUCE, peer, src=src, dst=dst, final=final, at=at,
                               **label))

    def copy(self, src: Region, dst: Region, **label) -> None:
        if src.count:
            self.steps.append(Step(Kind.COPY, src=src, dst=dst, **label))

    def build(
        self, collective: str, algorithm: str, rank: int, world_size: int, scratch: int = 0
    ) -> Schedule:
        return Schedule(collective, algorithm, rank, world_size, tuple(self.steps), scratch)


def _destination(step: Step) -> Region:
    """``step.dst`` of a step that writes one (every kind but ``SEND``)."""
    assert step.dst is not None, f"a {step.kind.value} step without a destination"
    return step.dst


def _disjoint(regions: list[Region]) -> bool:
    """Whether no two of ``regions`` share an element."""
    spans = sorted((r.buf, r.offset, r.offset + r.count) for r in regions)
    return all(a[0] != b[0] or a[2] <= b[1] for a, b in pairwise(spans))
