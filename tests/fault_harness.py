"""Faults injected into real rank processes, and a judge of what every rank saw.

The fault matrix (``test_fault_matrix.py``) and the soak (``fault_soak.py``) both describe a
*case*: a group size, an op (a collective on a chosen engine and algorithm, or point-to-point
sends around the ring), a fault (``RINGCOMM_FAULTS``: the action, the rank that acts, which of
its outgoing messages) and a timeout. ``RankPool`` runs cases on a few long-lived rank
processes: for each case every rank sets the case's environment, makes a fresh communicator
through a store of its own, runs the op and a barrier after it, and reports what happened,
so only a case whose fault kills a rank costs a new process. ``judge`` says what in the
outcome breaks the promise of the issue: a wrong result returned without an error, a hang,
a survivor that crashed, an error of the wrong type, one that names the wrong peer, or one
later than the timeout plus two seconds.

Which message is the "middle" or "last" one of a rank is counted, not guessed: ``Op.messages``
counts the sends and board posts of the schedule the selector chooses for the call (and the
segments of a point-to-point send), and ``test_fault_matrix`` checks those counts against a
run that counts what really left each rank.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
from what_runs import Call, contribution, p2p_messages, tally

from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.plan.select import Group, Selector
from ringcomm.plan.settings import Settings
from ringcomm.plan.topology import Topology
from ringcomm.schedules.schedule import Kind

SEGMENT = 16 << 10  # bytes a message segment: ops of tens of KiB go in several messages
TIMEOUT = 1.5  # seconds an op may take, on the ranks the faulted message goes to
LATER = 1.0  # seconds more on the other ranks: the rank waiting for it is the first to time out
GRACE = 2.0  # every survivor must have its answer within the timeout plus this
DELAY_BELOW_MS = 150
DELAY_ABOVE_MS = int(TIMEOUT * 1000) + 1000  # past the receivers' timeout, not by much
SETUP_S = 20.0  # what a rank may take to make its communicator on a busy machine
ACTIONS = ("kill", "delay_below", "delay_above", "drop", "corrupt")
POSITIONS = ("first", "middle", "last")
P2P = "send"  # the op's name in a fault spec and in errors

# the errors each action may leave on a rank that survives it
ALLOWED = {
    "kill": {"PeerLostError", "RemoteError"},
    "delay_above": {"CommTimeout", "DesyncError", "RemoteError"},
    "drop": {"CommTimeout", "DesyncError", "RemoteError"},
    "corrupt": {"ChecksumError", "RemoteError"},
    "delay_below": set(),
}
# the error at least one rank must raise, naming the rank that acted
PRIMARY = {
    "delay_above": {"CommTimeout", "DesyncError"},
    "drop": {"CommTimeout", "DesyncError"},
    "corrupt": {"ChecksumError"},
}


# ------------------------------------------------------------------------ ops and cases


@dataclass(frozen=True)
class Op:
    """One op of a case: ``collective`` (a name of the table of collectives, or ``send``:
    every rank sends ``block`` elements to the next and receives from the one before),
    ``algorithm`` forced through ``RINGCOMM_ALGO`` (an allreduce over links), and whether
    the ranks offer the shared board (``RINGCOMM_BOARD``)."""

    label: str
    collective: str
    block: int
    algorithm: str | None = None
    board: bool = True
    root: int = 0

    @property
    def call(self) -> Call:
        return Call(self.collective, self.block, root=self.root)

    def env(self) -> dict[str, str]:
        env = {"RINGCOMM_BOARD": "1" if self.board else "0"}
        if self.algorithm is not None:
            env["RINGCOMM_ALGO"] = self.algorithm
        return env

    def engine(self, world: int) -> tuple[str, str]:
        """(engine, algorithm) the selector chooses for this op, as every rank does."""
        if self.collective == P2P:
            return "p2p", "direct"
        call = self.call
        choice = _selector(world, self.board).choose(
            self.collective, call.nbytes(0, world), call.itemsize, forced=self.algorithm)
        return choice.engine, choice.algorithm

    def messages(self, rank: int, world: int) -> int:
        """Messages and board posts ``rank`` sends in this op: what a fault's ``msg``
        counts."""
        if self.collective == P2P:
            return p2p_messages(rank, world, (rank + 1) % world, self.block, 4, SEGMENT)
        _, algorithm = self.engine(world)
        t = tally(self.call.schedule(rank, world, algorithm, SEGMENT))
        return sum(t.sent.values()) + t.posts

    def outgoing(self, rank: int, world: int) -> list[tuple[frozenset[int], int]]:
        """``rank``'s messages and board posts in this op, in the order they leave: the
        ranks each goes to (every other rank for a post) and its payload in bytes."""
        if self.collective == P2P:
            per = SEGMENT // 4
            return [(frozenset({(rank + 1) % world}), 4 * min(per, self.block - start))
                    for start in range(0, max(self.block, 1), per)]
        _, algorithm = self.engine(world)
        out = []
        for step in self.call.schedule(rank, world, algorithm, SEGMENT).steps:
            region = step.src or step.dst
            nbytes = 4 * region.count if region is not None else 0
            if step.kind is Kind.POST:
                out.append((frozenset(range(world)) - {rank}, nbytes))
            elif step.kind is Kind.SEND:
                out.append((frozenset({step.peer}), nbytes))
            elif step.kind is Kind.RECV_REDUCE_SEND:
                out.append((frozenset({step.to}), nbytes))
        return out


def _selector(world: int, board: bool) -> Selector:
    settings = Settings.local(segment_bytes=SEGMENT)
    return Selector(Group(world, board, settings, Topology.single_host(world), SEGMENT))


KIB = 1 << 10
# the ops of the matrix; sizes give most ranks several messages (segments of 16 KiB)
MATRIX_OPS = (
    Op("allreduce/board", "allreduce", 1 * KIB),  # the one-shot post, the fast entry
    *(Op(f"allreduce/{name}", "allreduce", 12 * KIB, algorithm=name, board=False)
      for name in ("ring", "tree", "hd", "rd")),
    Op("broadcast", "broadcast", 24 * KIB, root=1),  # 96 KiB: a chain over the links
    Op("allgather", "allgather", 24 * KIB),  # 96 KiB a rank: the ring
    Op("reduce_scatter", "reduce_scatter", 8 * KIB),
    Op("alltoall", "alltoall", 8 * KIB),
    Op("barrier", "barrier", 0),  # on the board
    Op("send/recv", P2P, 12 * KIB),
)


@dataclass(frozen=True)
class Case:
    """One op under one fault: ``actor`` does ``action`` just before its outgoing message
    ``msg`` of the op (0-based; board posts count)."""

    world: int
    op: Op
    action: str
    actor: int
    msg: int
    timeout: float = TIMEOUT

    @property
    def fault_op(self) -> str:
        return self.op.collective

    @property
    def target(self) -> tuple[frozenset[int], int]:
        """The ranks the faulted message goes to, and its payload in bytes."""
        return self.op.outgoing(self.actor, self.world)[self.msg]

    def timeout_of(self, rank: int) -> float:
        """``rank``'s timeout (a local setting): the ranks the faulted message goes to wait
        ``timeout``, the others ``LATER`` seconds more, so that the first to give up is one
        that waits for the acting rank, not one that waits for a rank stalled behind it."""
        return self.timeout + (0.0 if rank in self.target[0] else LATER)

    @property
    def harmless(self) -> bool:
        """Whether the fault cannot change the op's outcome: a delay below the timeout, or
        a corruption of a message without a payload (a barrier's), which has no byte to
        flip."""
        return self.action == "delay_below" or (self.action == "corrupt" and
                                                self.target[1] == 0)

    def spec(self) -> str:
        """The fault as ``RINGCOMM_FAULTS`` reads it."""
        action = "delay" if self.action.startswith("delay") else self.action
        spec = f"{action}:rank={self.actor},op={self.fault_op},call=1,msg={self.msg}"
        if self.action == "delay_below":
            spec += f",ms={DELAY_BELOW_MS}"
        elif self.action == "delay_above":
            spec += f",ms={DELAY_ABOVE_MS}"
        return spec

    def env(self) -> dict[str, str]:
        env = dict(self.op.env(), RINGCOMM_FAULTS=self.spec())
        if self.action == "corrupt":
            env["RINGCOMM_CHECKSUM"] = "1"
        return env

    def describe(self) -> str:
        return (f"{self.op.label} at world size {self.world}, RINGCOMM_FAULTS="
                f"{self.spec()!r}" + (" with checksums" if self.action == "corrupt" else ""))


def acting_rank(op: Op, world: int, prefer: int = 1) -> int:
    """The rank that acts in ``op``'s cases: ``prefer`` where it sends anything, else the
    lowest rank that does."""
    order = [prefer % world] + [r for r in range(world) if r != prefer % world]
    return next(r for r in order if op.messages(r, world) > 0)


def position_index(position: str, messages: int) -> int:
    return {"first": 0, "middle": messages // 2, "last": messages - 1}[position]


def matrix_case(op: Op, action: str, position: str, world: int = 3) -> Case:
    actor = acting_rank(op, world)
    return Case(world, op, action, actor, position_index(position, op.messages(actor, world)))


# ------------------------------------------------------------------------ what a rank does


def expected(op: Op, rank: int, world: int) -> np.ndarray | None:
    """``rank``'s result of ``op`` when nothing goes wrong."""
    if op.collective == P2P:
        return contribution((rank - 1) % world, op.block, "float32")
    spec = COLLECTIVES[op.collective]
    call = op.call
    inputs = [call.buffers(r, world).get(spec.source) for r in range(world)]
    return spec.reference(inputs, "sum", op.root)[rank] if spec.result else None


def issue(comm: Any, op: Op) -> np.ndarray | None:
    """Run ``op`` on ``comm``; return this rank's result."""
    rank, world = comm.rank, comm.world_size
    if op.collective == P2P:
        out = np.full(op.block, 99, np.float32)
        sent = comm.send(contribution(rank, op.block, "float32"), (rank + 1) % world,
                         async_op=True)
        try:
            comm.recv(out, (rank - 1) % world)
        finally:  # as a program waits for every part of a batch: a failed send says why
            sent.wait()  # (a receive after it raises CommAborted, naming that failure)
        return out
    buffers = op.call.buffers(rank, world)
    op.call.issue(comm, buffers)
    spec = COLLECTIVES[op.collective]
    return buffers.get(spec.result) if spec.result else None


def _error(err: BaseException, where: str, elapsed: float) -> dict[str, Any]:
    return {"status": "error", "type": type(err).__name__, "where": where,
            "peer": getattr(err, "peer", None), "message": str(err), "elapsed": elapsed}


def run_rank(rank: int, world: int, store: str, case: Case) -> tuple[Any, dict[str, Any]]:
    """Make a communicator, run the case's op, then a barrier (so a rank whose part of the
    op ended before the fault hears of it too); return the communicator (still open) and
    what happened: ``ok`` (the result exact), ``wrong`` (returned a result that is not),
    ``error`` (the first error, where and when), ``crash`` (anything that is not a
    ringcomm error), or ``setup`` (no communicator)."""
    import ringcomm

    try:
        comm = ringcomm.init(rank=rank, world_size=world, store=store,
                             timeout=case.timeout_of(rank),
                             segment_bytes=SEGMENT)
    except Exception as err:  # noqa: BLE001 - reported to the test
        return None, {"status": "setup", "type": type(err).__name__, "message": str(err),
                      "traceback": traceback.format_exc()}
    start = time.monotonic()
    where = "in the op"
    try:
        got = issue(comm, case.op)
        elapsed = time.monotonic() - start
        want = expected(case.op, rank, world)
        if want is not None and (got is None or got.tobytes() != want.tobytes()):
            bad = int(np.count_nonzero(got != want)) if got is not None else -1
            return comm, {"status": "wrong", "elapsed": elapsed,
                          "message": f"{bad} of {want.size} elements wrong"}
        where = "in the barrier after the op"
        comm.barrier()
        return comm, {"status": "ok", "elapsed": time.monotonic() - start}
    except ringcomm.CommError as err:
        return comm, _error(err, where, time.monotonic() - start)
    except Exception as err:  # noqa: BLE001 - a crash: reported to the test
        out = _error(err, where, time.monotonic() - start)
        out.update(status="crash", traceback=traceback.format_exc())
        return comm, out


class _SentCounter:
    """Counts what leaves this rank, link messages and board posts, as a fault's ``msg``
    counts them (built on first use: the wrapper classes import ringcomm's core)."""

    def __new__(cls) -> Any:
        from ringcomm.engines.wrapping import Wrapper
        from ringcomm.transport.wrappers import BoardChannelWrapper, LinkWrapper

        class Link(LinkWrapper):
            def __init__(self, inner: Any, sent: list[int]) -> None:
                super().__init__(inner)
                self.sent = sent

            def send(self, header: Any, payload: Any, op: str) -> Any:
                self.sent[0] += 1
                return self.inner.send(header, payload, op)

            def send_reserved(self, header: Any, op: str) -> Any:
                self.sent[0] += 1
                return self.inner.send_reserved(header, op)

        class Board(BoardChannelWrapper):
            def __init__(self, inner: Any, sent: list[int]) -> None:
                super().__init__(inner)
                self.sent = sent

            def post(self, header: Any, payload: Any, deadline: float, op: str,
                     at: int = 0) -> None:
                self.sent[0] += 1
                self.inner.post(header, payload, deadline, op, at)

        class Counter(Wrapper):
            name = "sent-counter"

            def __init__(self) -> None:
                self.sent = [0]

            def link(self, link: Any) -> Any:
                return Link(link, self.sent)

            def board(self, channel: Any) -> Any:
                return Board(channel, self.sent)

        return Counter()


def count_rank(rank: int, world: int, stores: Sequence[str], ops: Sequence[Op]) -> list[int]:
    """Each op run once without faults, with its environment (ops of one environment on
    one communicator, a store each): what left this rank in each, messages and board
    posts."""
    import ringcomm

    counts = []
    comm = None
    env: dict[str, str] | None = None
    try:
        for op, store in zip(ops, stores, strict=True):
            if op.env() != env:
                if comm is not None:
                    comm.close()
                env = op.env()
                with _environment(env):
                    comm = ringcomm.init(rank=rank, world_size=world, store=store,
                                         timeout=SETUP_S, segment_bytes=SEGMENT)
            assert comm is not None
            counter = _SentCounter()
            with comm.wrapped(counter):
                got = issue(comm, op)
            want = expected(op, rank, world)
            assert want is None or got is not None and got.tobytes() == want.tobytes(), op
            comm.barrier()
            counts.append(counter.sent[0])
    finally:
        if comm is not None:
            comm.close()
    return counts


_SET_BY_CASES = ("RINGCOMM_FAULTS", "RINGCOMM_CHECKSUM", "RINGCOMM_ALGO", "RINGCOMM_BOARD")


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Any:
    """The case's settings in this process's environment, and none of an earlier case's."""
    before = {k: os.environ.get(k) for k in _SET_BY_CASES}
    for key in _SET_BY_CASES:
        os.environ.pop(key, None)
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _serve(slot: int, conn: Connection) -> None:
    """A rank process: run what the pool sends until it sends None. A case's communicator
    stays open until the pool says every rank has reported, so that no rank's leaving is
    what its peers see."""
    os.environ.pop("RINGCOMM_TRACE", None)
    import ringcomm

    ringcomm.init  # noqa: B018 - loads the library before the pool counts this rank ready
    if "RINGCOMM_DEBUG" not in os.environ:  # each injected fault's warning: on request
        logging.getLogger("ringcomm").setLevel(logging.ERROR)
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, kwargs = msg
        if kind == "count":
            try:
                conn.send(("counted", count_rank(**kwargs)))
            except Exception:  # noqa: BLE001 - reported to the test
                conn.send(("failed", traceback.format_exc()))
            continue
        case: Case = kwargs["case"]
        with _environment(case.env()):
            comm, outcome = run_rank(kwargs["rank"], case.world, kwargs["store"], case)
        conn.send(("done", outcome))
        if conn.recv() != "close":
            return
        start = time.monotonic()
        problem = None
        if comm is not None:
            try:
                comm.close()
            except Exception as err:  # noqa: BLE001 - reported to the test
                problem = f"{type(err).__name__}: {err}"
        conn.send(("closed", {"close_s": time.monotonic() - start, "close_error": problem}))


# ------------------------------------------------------------------------ the pool


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Outcome:
    """What every rank of one case reported (``died``: the ranks whose process ended;
    ``hung``: those that did not answer in time) and how long the case took."""

    case: Case
    ranks: list[dict[str, Any]]
    died: set[int] = field(default_factory=set)
    hung: set[int] = field(default_factory=set)
    wall: float = 0.0


class RankPool:
    """``size`` rank processes that run cases one after another. A process that dies (a
    ``kill`` fault) is replaced at the next case; one that hangs gets the whole pool
    replaced, so that no half-finished case reaches the next."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[Any] = [None] * size
        self._conns: list[Connection | None] = [None] * size
        self.started = 0  # processes started, for tests that count them

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure(self, slots: Iterable[int]) -> None:
        """Start a process in each of ``slots`` that has none alive, and wait until each has
        loaded ringcomm: a case's ranks then meet at the store within its short timeout."""
        started = set()
        for i in slots:
            p = self._procs[i]
            if p is not None and p.is_alive():
                continue
            self._drop(i)
            ours, theirs = self._ctx.Pipe()
            p = self._ctx.Process(target=_serve, args=(i, theirs), daemon=True,
                                  name=f"fault-rank-{i}")
            p.start()
            theirs.close()
            self._procs[i], self._conns[i] = p, ours
            self.started += 1
            started.add(i)
        died: set[int] = set()
        _, slow = self._gather(started, "ready", SETUP_S, died)
        if died or slow:
            raise AssertionError(f"rank processes {sorted(died | slow)} did not start")

    def _drop(self, slot: int) -> None:
        p, conn = self._procs[slot], self._conns[slot]
        if p is not None:
            if p.is_alive():
                p.kill()
            p.join(5)
        if conn is not None:
            conn.close()
        self._procs[slot] = self._conns[slot] = None

    def close(self) -> None:
        for i, conn in enumerate(self._conns):
            if conn is not None and self._procs[i].is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
        deadline = time.monotonic() + 5
        for i, p in enumerate(self._procs):
            if p is not None:
                p.join(max(0.1, deadline - time.monotonic()))
            self._drop(i)

    def _gather(self, slots: set[int], tag: str, limit: float,
                died: set[int]) -> tuple[dict[int, Any], set[int]]:
        """The ``tag`` message of each slot in ``slots``; slots whose process ended go in
        ``died``, those silent for ``limit`` seconds are returned as hung."""
        got: dict[int, Any] = {}
        waiting = {self._conns[s]: s for s in slots}
        deadline = time.monotonic() + limit
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait(list(waiting), timeout=left):
                slot = waiting.pop(conn)  # type: ignore[index]
                try:
                    kind, value = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    died.add(slot)
                    continue
                if kind != tag:
                    raise AssertionError(f"rank {slot} answered {kind!r}: {value}")
                got[slot] = value
        return got, set(waiting.values())

    def run(self, case: Case) -> Outcome:
        """Run ``case`` on ranks ``0..world-1``; every rank's report."""
        world = case.world
        assert world <= self.size
        self._ensure(range(world))
        store = f"127.0.0.1:{free_port()}"
        start = time.monotonic()
        for r in range(world):
            self._conns[r].send(("case", {"rank": r, "store": store, "case": case}))
        died: set[int] = set()
        limit = SETUP_S + case.timeout + LATER + GRACE + 5
        reports, hung = self._gather(set(range(world)), "done", limit, died)
        closing = set(reports)
        for r in closing:
            self._conns[r].send("close")
        closed, close_hung = self._gather(closing, "closed", 15.0, died)
        hung |= close_hung
        wall = time.monotonic() - start
        ranks = []
        for r in range(world):
            if r in died:
                report = {"status": "died", "exitcode": self._exit_code(r)}
            elif r in hung:
                report = dict(reports.get(r, {}), status="hang",
                              hung_in="close" if r in reports else "op")
            else:
                report = dict(reports[r], **closed[r])
            ranks.append(report)
        if hung:
            for r in range(world):
                self._drop(r)
        for r in died:
            self._drop(r)
        return Outcome(case, ranks, died, hung, wall)

    def _exit_code(self, slot: int) -> int | None:
        p = self._procs[slot]
        if p is None:
            return None
        p.join(5)
        return p.exitcode  # type: ignore[no-any-return]

    def count(self, world: int, ops: Sequence[Op]) -> list[list[int]]:
        """Per rank, what left it in each of ``ops`` run without faults (``count_rank``)."""
        self._ensure(range(world))
        stores = [f"127.0.0.1:{free_port()}" for _ in ops]
        for r in range(world):
            self._conns[r].send(("count", {"rank": r, "world": world, "stores": stores,
                                           "ops": list(ops)}))
        died: set[int] = set()
        got, hung = self._gather(set(range(world)), "counted",
                                 len(ops) * (SETUP_S + 5), died)
        if died or hung:
            for r in range(world):
                self._drop(r)
            raise AssertionError(f"counting: ranks {sorted(died)} died, {sorted(hung)} hung")
        return [got[r] for r in range(world)]


# ------------------------------------------------------------------------ the judge


def judge(outcome: Outcome) -> list[str]:
    """What in ``outcome`` breaks the promise: empty where every rank saw what it should."""
    case = outcome.case
    problems = []
    errors = {}
    for r, report in enumerate(outcome.ranks):
        status = report["status"]
        killed = case.action == "kill" and r == case.actor
        if killed:
            if status != "died":
                problems.append(f"rank {r} should have been killed but reported {status}: "
                                f"{report.get('message', '')}")
            elif report.get("exitcode") != -9:
                problems.append(f"rank {r} ended with exit code {report.get('exitcode')}, "
                                "not by SIGKILL")
            continue
        if status in ("died", "hang", "setup", "crash", "wrong"):
            problems.append(f"rank {r}: {status} {_details(report)}")
            continue
        if report.get("close_error"):
            problems.append(f"rank {r}: close raised {report['close_error']}")
        if report["elapsed"] > case.timeout_of(r) + GRACE:
            problems.append(f"rank {r} took {report['elapsed']:.2f} s, more than its timeout "
                            f"{case.timeout_of(r):g} s + {GRACE:g} s")
        if status == "error":
            errors[r] = report
            if case.harmless or report["type"] not in ALLOWED[case.action]:
                problems.append(f"rank {r} raised {report['type']} ({report['where']}): "
                                f"{report['message']}")
        elif not case.harmless:
            problems.append(f"rank {r} finished the op and the barrier after it without an "
                            "error")
    if case.action in PRIMARY and not case.harmless and not any(
            e["type"] in PRIMARY[case.action] and e["peer"] == case.actor
            for e in errors.values()):
        problems.append(f"no rank raised {' or '.join(sorted(PRIMARY[case.action]))} naming "
                        f"rank {case.actor} (peer=): " + "; ".join(
                            f"rank {r}: {e['type']} peer={e['peer']}"
                            for r, e in errors.items()))
    if case.action == "kill" and errors and not any(
            f"rank {case.actor}" in e["message"] for e in errors.values()):
        problems.append(f"no survivor's error names rank {case.actor}, the one killed")
    if case.action == "corrupt":
        for r, e in errors.items():
            if e["type"] == "ChecksumError" and f"rank {case.actor}" not in e["message"]:
                problems.append(f"rank {r}'s ChecksumError does not name the link from rank "
                                f"{case.actor}: {e['message']}")
    return problems


def _details(report: dict[str, Any]) -> str:
    text = report.get("message", "") or ""
    if report.get("type"):
        text = f"{report['type']}: {text}"
    if report.get("traceback"):
        text += "\n" + report["traceback"]
    return text
