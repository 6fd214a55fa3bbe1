"""The hang report: when an op times out, what each rank was doing, and which ranks are
behind.

A timeout alone says that this rank waited too long, not why: the rank it waited for may
itself wait for a third, which never called the op. So when an op times out, every rank
that was in it logs where it stood (op and sequence number, engine and algorithm, the step
of its schedule, the peer it waited for, the messages and bytes it had moved:
``ringcomm.engines.progress.OpProgress``, which the engine hangs on the error as it leaves)
and puts that in the store; rank 0 gathers what arrives within a short, bounded time and
logs one screen: every rank's state, and the ranks at the end of the chains of waits (a rank
that sent no report, one in another op, one that waited for nobody) or in a cycle of them
(``analyze``). In the spirit of torch's desync report, but with nothing done while ops
run: all of it is built on the way out of a failed op.

The rank whose op times out tells every peer (``abort``), so every rank still waiting in an
op fails within moments with a ``RemoteError`` that says so; those count as timed out too
and report like the first. A rank that is in no op hears nothing and sends nothing: rank 0
names it as having no report (it finished this op, is not yet in it, or is gone).

The error stays what it was: the report is attached to it (``err.report``, a ``HangReport``)
and logged at ERROR. A slow or dead store costs at most ``GATHER_S`` (rank 0) or
``PUBLISH_S`` (the others) and turns nothing into another error: the store is talked to on a
thread of its own that the failing op leaves behind when its time is up.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..engines.progress import OpProgress
from ..errors import CommError, CommTimeout, RemoteError

log = logging.getLogger("ringcomm")

GATHER_S = 1.0  # the most rank 0 waits for the other ranks' states
SETTLE_S = 2.0  # the most a closing communicator waits for a report still at the store
QUIET_S = 0.5  # rank 0 stops sooner once no new state has come for this long
PUBLISH_S = 0.5  # the most another rank spends handing its state to the store
POLL_S = 0.02  # how often rank 0 looks for states still missing
SHOWN = 16  # ranks listed one by one in a summary (the rest are counted): one screen
NO_REPORT = "no report: finished this op, not yet in it, or gone"
VERSION = 1  # of the record each rank puts in the store

_COLLECTIVE = re.compile(r"^(\w+) #(\d+)$")  # a collective's name: "allreduce #12"
_TIMED_OUT_REMOTELY = re.compile(r"aborted the group: CommTimeout\b")  # an abort's text


class ReportStore(Protocol):
    """What the report needs of a store (``ringcomm.bootstrap.store.Store`` has it)."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str, timeout: float | None = None) -> bytes: ...

    def check(self, keys: Sequence[str]) -> bool: ...


def timed_out(err: BaseException) -> bool:
    """Whether ``err`` ends an op because of a timeout: this rank's (``CommTimeout``), or
    another rank's that aborted the group (a ``RemoteError`` carrying its ``CommTimeout``)."""
    if isinstance(err, CommTimeout):
        return True
    return isinstance(err, RemoteError) and bool(_TIMED_OUT_REMOTELY.search(err.detail))


@dataclass(frozen=True)
class RankState:
    """What one rank was doing when its op timed out (or was aborted by a rank that timed
    out): ``op`` (``allreduce #5``; ``seq`` its sequence number, None for point-to-point),
    why it stopped (``cause``), where it stood (``progress``; None where the error came
    from outside the steps), and the process (``host``, ``pid``) to look at."""

    rank: int
    op: str
    seq: int | None
    cause: str
    progress: OpProgress | None
    host: str = ""
    pid: int = 0

    @classmethod
    def of(cls, rank: int, err: CommError) -> RankState:
        op = err.op or "?"
        match = _COLLECTIVE.match(op)
        if isinstance(err, CommTimeout):
            cause = "timed out"
        else:
            cause = f"stopped: rank {err.peer} timed out and aborted the group"
        progress = err.progress if isinstance(err.progress, OpProgress) else None
        return cls(rank, op, int(match.group(2)) if match else None, cause, progress,
                   socket.gethostname(), os.getpid())

    @property
    def peer(self) -> int | None:
        """The rank this one waited for, where it waited for one."""
        return self.progress.peer if self.progress is not None else None

    @property
    def collective(self) -> str | None:
        match = _COLLECTIVE.match(self.op)
        return match.group(1) if match else None

    def where(self) -> str:
        """``step 3 of 14 of ring allreduce (links engine), waiting for rank 0 (recv from ...)``"""
        p = self.progress
        if p is None:
            return "outside its schedule's steps"
        waits = f", waiting for rank {p.peer}" if p.peer is not None else ""
        doing = f" ({p.doing})" if p.doing else ""
        return f"{p.where()}{waits}{doing}"

    def describe(self) -> str:
        """One line, as this rank logs it."""
        done = f"; done in this op: {self.progress.done()}" if self.progress else ""
        return (f"rank {self.rank}: {self.op} {self.cause} at {self.where()}{done} "
                f"[pid {self.pid} on {self.host}]")

    def to_json(self) -> str:
        return json.dumps({"version": VERSION, "rank": self.rank, "op": self.op,
                           "seq": self.seq, "cause": self.cause, "host": self.host,
                           "pid": self.pid,
                           "progress": self.progress.to_dict() if self.progress else None})

    @classmethod
    def from_json(cls, text: bytes | str) -> RankState:
        """The inverse of ``to_json``; ValueError where ``text`` is not such a record."""
        try:
            fields = json.loads(text)
            progress = fields.get("progress")
            return cls(int(fields["rank"]), str(fields["op"]),
                       None if fields.get("seq") is None else int(fields["seq"]),
                       str(fields["cause"]),
                       OpProgress.from_dict(progress) if progress else None,
                       str(fields.get("host", "")), int(fields.get("pid", 0)))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as err:
            raise ValueError(f"not a hang report record: {err}") from None


@dataclass(frozen=True)
class HangReport:
    """The hang report a rank attaches to its error (``err.report``). On rank 0 it holds
    every state that reached it (``gathered``), the ranks judged ``behind`` and the
    ``findings`` that say why; elsewhere, this rank's own state. ``text`` (and ``str``)
    is what was logged."""

    rank: int
    world_size: int
    states: dict[int, RankState]
    gathered: bool = False
    behind: tuple[int, ...] = ()
    findings: tuple[str, ...] = ()
    note: str = ""  # what went wrong with the store, if anything
    elapsed: float = 0.0  # seconds spent gathering
    text: str = field(default="", compare=False)

    @property
    def missing(self) -> tuple[int, ...]:
        """The ranks whose state did not arrive (all but this one, unless ``gathered``)."""
        return tuple(r for r in range(self.world_size) if r not in self.states)

    def __str__(self) -> str:
        return self.text


def analyze(states: dict[int, RankState],
            world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Who is behind, and why: ``(ranks, findings)``.

    The op most ranks are in is the collective most reporting ranks name (ties: the
    furthest); a rank in any other (an earlier or a later collective, another collective
    under the same number, a point-to-point op) is elsewhere. Each rank that reported waited for a
    peer; following those waits from rank to rank ends at a rank that sent no report, is
    elsewhere, or waited for nobody (it came late, or was busy: a send, a copy): those are
    behind. Or the waits go round a cycle (a message went missing, or the ranks disagree
    about the op). Ranks that ran different collectives under one sequence number are named
    too."""
    main = _main_op(states)
    elsewhere = {r for r, s in states.items() if main is not None and s.op != main}
    waiters: dict[int, list[tuple[int, bool]]] = {}  # culprit -> (waiter, directly)
    cycles: list[tuple[int, ...]] = []
    for start in sorted(set(states) - elsewhere):
        path, cur = [start], start
        while True:
            nxt = states[cur].peer
            if nxt is None or not 0 <= nxt < world_size:
                if cur != start:  # others wait for a rank that waits for nobody
                    waiters.setdefault(cur, []).append((start, len(path) == 2))
                break
            if nxt in path:
                cycle = tuple(path[path.index(nxt):])
                turn = cycle.index(min(cycle))
                cycle = cycle[turn:] + cycle[:turn]
                if cycle not in cycles:
                    cycles.append(cycle)
                break
            path.append(nxt)
            if nxt not in states or nxt in elsewhere:
                waiters.setdefault(nxt, []).append((start, len(path) == 2))
                break
            cur = nxt
    findings: list[str] = []
    behind = tuple(sorted(waiters) + sorted(elsewhere - set(waiters)))
    in_main = sorted(r for r, s in states.items() if s.op == main)
    for culprit in behind:
        state = states.get(culprit)
        if state is None:
            what = NO_REPORT
        elif state.op == main and state.peer is None:
            what = (f"in {state.op} at {_step(state)}, waiting for nobody: it came to this op "
                    "late, or was busy")
        else:
            what = (f"in {state.op} at {_step(state)}, while {_ranks(in_main)} "
                    f"{'is' if len(in_main) == 1 else 'are'} in {main}")
        line = f"rank {culprit} is behind ({what})"
        waiting = waiters.get(culprit, [])
        if waiting:
            through = [(w, states[w].peer) for w, direct in waiting if not direct]
            who = sorted(w for w, _ in waiting)
            line += (f"; {_ranks(who)} wait{'s' if len(who) == 1 else ''} for it" +
                     (" (" + ", ".join(f"{w} through rank {p}" for w, p in through) + ")"
                      if through else ""))
        findings.append(line)
    for cycle in cycles:
        ring = " -> ".join(map(str, (*cycle, cycle[0])))
        findings.append(f"{_ranks(sorted(cycle))} wait for each other in a cycle ({ring}) in "
                        f"{main}: a message went missing, or the ranks disagree about the op")
    by_seq: dict[int, dict[str, list[int]]] = {}
    for r, s in states.items():
        if s.seq is not None:
            by_seq.setdefault(s.seq, {}).setdefault(s.collective or "?", []).append(r)
    for seq, names in sorted(by_seq.items()):
        if len(names) > 1:
            findings.append(f"the ranks disagree about op #{seq}: " + "; ".join(
                f"{name} on {_ranks(sorted(rs))}" for name, rs in sorted(names.items())))
    silent = sorted(set(range(world_size)) - set(states) - set(waiters))
    if silent and not behind:
        findings.append(f"{_ranks(silent)} sent no report, and no rank that reported waited "
                        f"for {'it' if len(silent) == 1 else 'them'}")
    return behind, tuple(findings)


def _main_op(states: dict[int, RankState]) -> str | None:
    """The op most ranks are in: the collective that most reporting ranks name (ties: the
    one of the furthest sequence number, then the lowest rank's); None where no rank
    reported a collective."""
    counts: dict[str, int] = {}
    seqs: dict[str, int] = {}
    for r in sorted(states):
        s = states[r]
        if s.seq is not None:
            counts[s.op] = counts.get(s.op, 0) + 1
            seqs[s.op] = s.seq
    if not counts:
        return None
    return max(counts, key=lambda op: (counts[op], seqs[op]))  # first of the most: lowest rank's


def summary_text(report: HangReport) -> str:
    """Rank 0's screen: the findings, then every rank's state (the ranks behind first), at
    most ``SHOWN`` of them one by one."""
    heard = len(report.states)
    lines = [f"ringcomm hang report, gathered by rank {report.rank}: {heard} of "
             f"{report.world_size} ranks reported within {report.elapsed:.2f} s"]
    if report.note:
        lines.append(f"  ({report.note})")
    lines += [f"  {finding}" for finding in report.findings]
    order = list(report.behind) + [r for r in range(report.world_size)
                                   if r not in report.behind]
    shown = order[:SHOWN]
    for r in shown:
        state = report.states.get(r)
        if state is None:
            lines.append(f"  rank {r}: {NO_REPORT}")
            continue
        p = state.progress
        lines.append(f"  rank {r}: {state.op} {state.cause} at {_step(state)}"
                     + (f"; done: {p.done()}" if p else "") + f" [pid {state.pid} on {state.host}]")
        if p is not None and p.doing:
            lines.append(f"      the step: {p.doing}")
    rest = order[SHOWN:]
    if rest:
        silent = sum(1 for r in rest if r not in report.states)
        lines.append(f"  ... {len(rest)} more ranks ({silent} with no report)")
    return "\n".join(lines)


def _step(state: RankState) -> str:
    """``step 1 of 7 (ring allreduce, links engine), waiting for rank 2``"""
    p = state.progress
    if p is None:
        return "no step (it failed outside its schedule)"
    waits = f", waiting for rank {p.peer}" if p.peer is not None else ""
    return f"step {p.step} of {p.steps} ({p.algorithm}, {p.engine} engine){waits}"


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))


def key(rank: int) -> str:
    """Where ``rank`` puts its state in its group's store."""
    return f"hang/{rank}"


class HangReporter:
    """Builds the hang report of one communicator's rank when an op of it times out
    (``on_failure``); ``store`` is its group's (keys under the group's own prefix), or None
    (a group inside one process: each rank then logs its own state only)."""

    def __init__(self, rank: int, world_size: int, store: ReportStore | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self._reported = False  # a communicator fails once; so does its report
        self._thread: threading.Thread | None = None  # the one that talks to the store

    def settle(self, timeout: float = SETTLE_S) -> None:
        """Wait (at most ``timeout``) for the report's talk with the store to end, before
        the store is closed: a store client's sockets may not be closed while another
        thread still waits on one."""
        if self._thread is not None:
            self._thread.join(timeout)

    def on_failure(self, err: CommError) -> None:
        """If ``err`` ends an op because of a timeout: log this rank's state, hand it to the
        store, and on rank 0 gather the others' and log the summary; attach the report to
        ``err``. Never raises, and returns within ``GATHER_S`` plus a little."""
        if self._reported or not timed_out(err):
            return
        self._reported = True
        try:
            err.report = self._report(err)
        except Exception:  # noqa: BLE001 - the report must never replace the error
            log.exception("rank %d: the hang report failed", self.rank)

    def _report(self, err: CommError) -> HangReport:
        mine = RankState.of(self.rank, err)
        log.error("%s", mine.describe())
        states = {self.rank: mine}
        if self.store is None or self.world_size == 1:
            return HangReport(self.rank, self.world_size, states, text=mine.describe())
        gather = self.rank == 0
        started = time.monotonic()
        found, note, self._thread = _exchange(self.store, self.rank, self.world_size,
                                              mine.to_json(), gather)
        if not gather:
            if note:
                log.warning("rank %d: the hang report did not reach rank 0: %s", self.rank,
                            note)
            return HangReport(self.rank, self.world_size, states, note=note,
                              text=mine.describe())
        for r, raw in found.items():
            try:
                state = RankState.from_json(raw)
            except ValueError as bad:
                log.warning("rank %d: rank %d's hang report could not be read: %s",
                            self.rank, r, bad)
                continue
            if state.rank == r:
                states[r] = state
        behind, findings = analyze(states, self.world_size)
        report = HangReport(self.rank, self.world_size, states, True, behind, findings, note,
                            time.monotonic() - started)
        text = summary_text(report)
        log.error("%s", text)
        return replace(report, text=text)


def _exchange(store: ReportStore, rank: int, world_size: int, mine: str,
              gather: bool) -> tuple[dict[int, bytes], str, threading.Thread]:
    """Put this rank's state in the store and, if ``gather``, collect the others' states
    until all have come, ``GATHER_S`` has passed, or none has come for ``QUIET_S``. On a
    thread of its own, which is left behind when its time is up (a store that does not
    answer may hold a request for as long as its own timeout). Returns the states found by
    then and a note on what went wrong with the store, if anything."""
    found: dict[int, bytes] = {}
    lock = threading.Lock()
    note: list[str] = []
    finished = threading.Event()

    def run() -> None:
        try:
            store.set(key(rank), mine)
            if not gather:
                return
            started = last = time.monotonic()
            waiting = [r for r in range(world_size) if r != rank]
            while waiting:
                for r in list(waiting):
                    if store.check([key(r)]):
                        raw = store.get(key(r), timeout=POLL_S)
                        with lock:
                            found[r] = raw
                        waiting.remove(r)
                        last = time.monotonic()
                now = time.monotonic()
                if not waiting or now - started >= GATHER_S or now - last >= QUIET_S:
                    break
                time.sleep(POLL_S)
        except Exception as err:  # noqa: BLE001 - a store gone or failing: said in the report
            with lock:
                note.append(f"the store failed: {type(err).__name__}: {err}")
        finally:
            finished.set()

    thread = threading.Thread(target=run, name=f"ringcomm-hang-report-{rank}", daemon=True)
    thread.start()
    in_time = finished.wait((GATHER_S if gather else PUBLISH_S) + 0.2)
    with lock:
        if not in_time:
            note.append("the store did not answer in time")
        return dict(found), "; ".join(note), thread

