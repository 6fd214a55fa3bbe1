"""The fault injector: a wrapper that kills, delays, drops or corrupts one chosen message.

Why a wrapper: faults must act where messages move, on every engine (a link's sends, the
board's posts, point-to-point sends), without the links, the board or the engines knowing;
the one hook of ``ringcomm.engines.wrapping`` gives exactly that. The injector stands in
front of the engines to learn which op runs (its name and its call number on this rank, as
``ringcomm.observe.steps`` does), and in front of the links and the board to count that
op's outgoing messages and act on the one a rule names:

- ``kill``: the process dies at once, as SIGKILL would, before the message leaves
  (``Transport.die``; a rank that is a thread of one process stops its thread instead);
- ``delay``: sleeps ``ms`` before sending it;
- ``drop``: never sends it (a board post counts as made, but nobody sees it);
- ``corrupt``: sends it with one payload byte flipped, in a copy (never in the caller's
  buffer) or in the shared-memory slot already reserved for it. It stands behind the
  checksum (``ringcomm.faults.checksum``), so the checksum was computed before the flip.

Only the acting rank's rules are kept; a rank with none has nothing in its path. Every
fault is logged at WARNING by the rank that acts, before it acts.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import numpy as np

from ..core.arrays import Buffer
from ..core.dtypes import DTYPE_CODES
from ..core.fault_spec import RANDOM, FaultRule, FaultSpec
from ..engines.base import Engine, EngineWrapper
from ..engines.context import OpContext
from ..engines.wrapping import Wrapper
from ..schedules.schedule import Kind, Schedule
from ..transport.board_channel import BoardChannel
from ..transport.header import Header, OpKind
from ..transport.link import Link, SendHandle
from ..transport.wrappers import BoardChannelWrapper, LinkWrapper

log = logging.getLogger("ringcomm")

_ITEMSIZES = {code: dtype.itemsize for dtype, code in DTYPE_CODES.items()}
# messages that a send to one peer (None: a board post, read by every peer) counts as
SendsTo = Callable[[int | None], int]


class _Armed:
    """A rule and where it stands in the op that runs: the index of the message it acts on
    (None: not in this op), and how many of the op's messages it has counted."""

    __slots__ = ("rule", "target", "seen", "done")

    def __init__(self, rule: FaultRule) -> None:
        self.rule = rule
        self.target: int | None = None
        self.seen = 0
        self.done = False


class FaultWrapper(Wrapper):
    """Injects the faults of ``spec`` whose acting rank is ``rank``, in a group of
    ``world_size``; ``die`` ends this rank (``Transport.die``). Counting starts once
    ``live`` (a communicator's own set-up ops do not count: ``start``)."""

    name = "faults"

    def __init__(self, spec: FaultSpec, rank: int, world_size: int,
                 die: Callable[[], NoReturn], *, live: bool = True) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.die = die
        self.live = live
        self.rules = [_Armed(rule) for rule in spec.rules if rule.rank == rank]
        self.calls: Counter[str] = Counter()  # ops begun, by name ("" : all of them)
        for rule in spec.rules:
            for who, what in ((rule.rank, "rank"), (rule.peer, "peer")):
                if who is not None and who >= world_size:
                    log.warning("rank %d: fault %s names %s %d, which this group of %d "
                                "ranks does not have: it never acts here", rank, rule, what,
                                who, world_size)

    def start(self) -> None:
        """Count ops from now on (the first op after this is call 1)."""
        self.live = True

    # ---------------------------------------------------------------- the hook
    def link(self, link: Link) -> Link:
        return _FaultyLink(link, self) if self.rules else link

    def board(self, channel: BoardChannel) -> BoardChannel:
        return _FaultyBoard(channel, self) if self.rules else channel

    def engine(self, engine: Engine) -> Engine:
        return _FaultyEngine(engine, self) if self.rules else engine

    # ---------------------------------------------------------------- counting
    def begin(self, op: str, sends_to: SendsTo) -> None:
        """An op named ``op`` (``allreduce``, ``send``...) begins on this rank;
        ``sends_to(peer)`` says how many messages it sends to ``peer`` (None: in all), for
        rules that pick one at random."""
        if not self.live:
            return
        calls = self.calls
        calls[op] += 1
        calls[""] += 1
        for armed in self.rules:
            armed.seen, armed.target = 0, None
            rule = armed.rule
            if armed.done or calls[rule.op or ""] != rule.call or \
                    rule.op not in (None, op):
                continue
            if rule.msg != RANDOM:
                armed.target = rule.msg
                continue
            count = sends_to(rule.peer)
            if count:  # the same message on every run of the same program
                picker = random.Random(f"{rule.seed}/{self.rank}/{op}/{rule.call}")
                armed.target = picker.randrange(count)

    def at_message(self, peer: int | None) -> list[FaultRule]:
        """The rules that act on the next outgoing message of the op (to ``peer``; None: a
        board post), counting it for every rule it concerns."""
        fired = []
        for armed in self.rules:
            if armed.target is None:
                continue
            want = armed.rule.peer
            if want is not None and peer is not None and peer != want:
                continue
            index = armed.seen
            armed.seen += 1
            if index == armed.target:
                armed.target, armed.done = None, True
                fired.append(armed.rule)
        return fired

    def act(self, rules: list[FaultRule], op: str, what: str) -> str | None:
        """Log and do what ``rules`` say to ``what`` (a message, in words): sleep for a
        delay, die for a kill; returns ``drop`` or ``corrupt`` for the caller to do, if one
        of them is there."""
        left = None
        for rule in sorted(rules, key=lambda r: ("delay", "corrupt", "drop", "kill")
                           .index(r.action)):
            log.warning("rank %d injects fault %s: %s %s of %s", self.rank, rule,
                        rule.action, what, op)
            if rule.action == "delay":
                time.sleep(rule.ms / 1000)
            elif rule.action == "kill":
                for handler in logging.getLogger().handlers + log.handlers:
                    handler.flush()
                self.die()
            else:
                left = "drop" if "drop" in (left, rule.action) else rule.action
        return left


def _flip(data: np.ndarray) -> bool:
    """Flip every bit of the middle byte of ``data`` (uint8, writable); False if empty."""
    if not data.size:
        return False
    data[data.size // 2] ^= 0xFF
    return True


def _schedule_sends(schedule: Schedule) -> SendsTo:
    def sends_to(peer: int | None) -> int:
        return sum(1 for step in schedule.steps
                   if step.kind is Kind.POST
                   or (step.kind is Kind.SEND and peer in (None, step.peer))
                   or (step.kind is Kind.RECV_REDUCE_SEND and peer in (None, step.to)))
    return sends_to


class _FaultyEngine(EngineWrapper):
    """Tells the injector which op begins, on either way into the engine."""

    def __init__(self, inner: Engine, faults: FaultWrapper) -> None:
        super().__init__(inner)
        self.faults = faults

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        self.faults.begin(ctx.name.partition(" #")[0], _schedule_sends(schedule))
        self.inner.run(schedule, buffers, ctx)

    def allreduce_now(self, plan: Any, data: Buffer, seq: int, deadline: float, name: str,
                      observe: Any = None) -> None:
        self.faults.begin("allreduce", _schedule_sends(plan.program.schedule))
        self.inner.allreduce_now(plan, data, seq, deadline, name, observe)


class _FaultyLink(LinkWrapper):
    """Counts the link's outgoing messages for the injector and acts on the chosen one. A
    point-to-point send (its messages go out between ops, not through an engine) begins a
    ``send`` op of its own at its first message."""

    def __init__(self, inner: Link, faults: FaultWrapper) -> None:
        super().__init__(inner)
        self.faults = faults
        self._slot: np.ndarray | None = None  # what the last ``reserve`` lent

    def _fired(self, header: Header, op: str) -> list[FaultRule]:
        if header.kind == OpKind.P2P and header.index == 0:
            self.faults.begin("send", _p2p_sends(header, self.peer))
        return self.faults.at_message(self.peer)

    def send(self, header: Header, payload: np.ndarray | None, op: str) -> SendHandle | None:
        if header.kind == OpKind.CREDIT:  # a device channel's flow control, not a message
            return self.inner.send(header, payload, op)  # of the op: ``msg`` never counts it
        fired = self._fired(header, op)
        if fired:
            does = self.faults.act(fired, op, f"message {header.index} to rank {self.peer}")
            if does == "drop":
                return None
            if does == "corrupt" and payload is not None:
                payload = payload.reshape(-1).view(np.uint8).copy()
                _flip(payload)
        return self.inner.send(header, payload, op)

    def reserve(self, nbytes: int) -> np.ndarray | None:
        self._slot = self.inner.reserve(nbytes)
        return self._slot

    def send_reserved(self, header: Header, op: str) -> SendHandle | None:
        slot, self._slot = self._slot, None
        fired = self._fired(header, op)
        if fired:
            does = self.faults.act(fired, op, f"message {header.index} to rank {self.peer}")
            if does == "drop":
                return None  # its slot stays reserved: the ring is of no use after this
            if does == "corrupt" and slot is not None:
                _flip(slot)  # the bytes already in shared memory, after any checksum
        return self.inner.send_reserved(header, op)


def _p2p_sends(first: Header, peer: int) -> SendsTo:
    """How many messages the point-to-point send whose first message is ``first`` sends."""
    itemsize = _ITEMSIZES.get(first.dtype, 1)
    per_message = max(1, first.segment // itemsize)
    count = max(1, math.ceil(first.count / per_message))
    return lambda to: count if to in (None, peer) else 0


class _FaultyBoard(BoardChannelWrapper):
    """Counts this rank's board posts for the injector and acts on the chosen one."""

    def __init__(self, inner: BoardChannel, faults: FaultWrapper) -> None:
        super().__init__(inner)
        self.faults = faults

    def post(self, header: bytes, payload: np.ndarray | None, deadline: float,
             op: str, at: int = 0) -> None:
        fired = self.faults.at_message(None)
        if fired:
            index = Header.unpack(header).index
            does = self.faults.act(fired, op, f"board post {index}")
            if does == "drop":
                self.board.lose_post()
                return
            if does == "corrupt" and payload is not None:
                copy = payload.reshape(-1).copy()
                _flip(copy.view(np.uint8))
                payload = copy
        self.inner.post(header, payload, deadline, op, at)
