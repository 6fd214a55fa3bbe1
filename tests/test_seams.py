"""The plug-in points, through real use: the registry of link kinds picks a kind per pair and
says why; a wrapper put in through the one hook sees every message, post and take of every
collective and point-to-point op, the board's fast entry included; the selector's table
(``ringcomm schedule --choices``) is what runs.

Groups are real: transports set up through a real store (threads or processes of this
host), or in-process groups (``run_group``) over in-memory links and board. What a seam saw
is compared with what the schedules say (``what_runs``). Two ranks on different hosts of a
real network (network namespaces) are in ``test_multihost.py``, which asserts each pair's
kind and reason the same way (``_check_links``).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest
from mp_helpers import in_threads, transport_group
from what_runs import Call, Tally, contribution, p2p_messages, tally

from ringcomm import cli
from ringcomm.engines.base import Engine, EngineWrapper
from ringcomm.engines.wrapping import Wrapper
from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.runtime.communicator import Communicator
from ringcomm.runtime.local import run_group
from ringcomm.schedules import ALLREDUCE
from ringcomm.transport import shm_ring
from ringcomm.transport.board_channel import BoardChannel
from ringcomm.transport.link import Link
from ringcomm.transport.wrappers import BoardChannelWrapper, LinkWrapper

needs_shm = pytest.mark.skipif(not shm_ring.available(), reason="needs /dev/shm")

# --------------------------------------------------------------------------- link kinds

LOCAL_REASON = "same host, both offer pipes and shared memory"
LOCAL = f"[local: {LOCAL_REASON}]"
NOT_OFFERED_THERE = ("rank {peer} does not offer shared memory (RINGCOMM_SHM=0 there, or no "
                     "/dev/shm)")
NOT_OFFERED_HERE = "this rank does not offer shared memory (RINGCOMM_SHM=0)"

# name -> (world, mode, shm per rank, hosts, {(rank, peer): (link's words, choice)}), each
# choice as ``PairChoice`` (kind, reason, kinds declined before it and why)
PAIRS: dict[str, tuple[int, str, tuple[bool, ...], tuple[str, ...], dict]] = {
    "one host, both offer shared memory": (2, "auto", (True, True), ("h", "h"), {
        (0, 1): ("pipe + shared memory", ("local", LOCAL_REASON, ())),
        (1, 0): ("pipe + shared memory", ("local", LOCAL_REASON, ())),
    }),
    "one host, rank 1 offers no shared memory": (2, "auto", (True, False), ("h", "h"), {
        (0, 1): ("ipc://", ("socket", "ZeroMQ ipc (same host)",
                            (("local", NOT_OFFERED_THERE.format(peer=1)),))),
        (1, 0): ("ipc://", ("socket", "ZeroMQ ipc (same host)",
                            (("local", NOT_OFFERED_HERE),))),
    }),
    "tcp forced": (2, "tcp", (True, True), ("h", "h"), {
        (r, 1 - r): ("tcp://", ("socket", "ZeroMQ tcp (RINGCOMM_TRANSPORT forces it)",
                                (("local", "RINGCOMM_TRANSPORT=tcp forces sockets"),)))
        for r in (0, 1)}),
    "two host identities": (3, "auto", (True, True, True), ("a", "a", "b"), {
        (0, 1): ("pipe + shared memory", ("local", LOCAL_REASON, ())),
        (1, 0): ("pipe + shared memory", ("local", LOCAL_REASON, ())),
        **{(r, 2): ("tcp://", ("socket", "ZeroMQ tcp (another host)",
                               (("local", "rank 2 is on another host"),))) for r in (0, 1)},
        **{(2, p): ("tcp://", ("socket", "ZeroMQ tcp (another host)",
                               (("local", "no peer shares this host"),))) for p in (0, 1)},
    }),
}


def _bracket(kind: str, reason: str, declined: tuple) -> str:
    """How ``describe`` writes a pair's choice."""
    text = f"[{kind}: {reason}"
    if declined:
        text += " (" + "; ".join(f"not {k}: {why}" for k, why in declined) + ")"
    return text + "]"


@needs_shm
@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(PAIRS))
def test_the_registry_picks_the_first_kind_that_serves_each_pair_and_says_why(case):
    """Transports of threads set up through a real store: each pair's choice, the kinds
    declined before it and why, and ``describe`` line by line; a shared board only where
    every rank is on one host and offers shared memory."""
    world, mode, shm, hosts, expected = PAIRS[case]
    made = transport_group(world, mode, shm, hosts)
    try:
        for r, transport in enumerate(made):
            lines = transport.describe().splitlines()
            assert len(lines) == world - 1, lines
            for peer, line in zip((p for p in range(world) if p != r), lines, strict=True):
                how, (kind, reason, declined) = expected[(r, peer)]
                choice = transport.choices[peer]
                assert (choice.kind, choice.reason, choice.declined) == (kind, reason, declined)
                assert line.startswith(f"rank {r} -> rank {peer}: {how}"), line
                assert line.endswith(" " + _bracket(kind, reason, declined)), line
            board = mode == "auto" and all(shm) and len(set(hosts)) == 1
            assert (transport.board is not None) == board, (r, transport.board)
    finally:
        for transport in made:
            transport.close()


@needs_shm
@pytest.mark.timeout(30)
def test_the_communicator_describes_the_kinds_each_pair_and_its_engines():
    """``comm.describe()`` on a group of one host: the registry's order, each pair's line,
    the engines (links over the local kind, the board), the wrappers put in."""
    made = transport_group(2, "auto", True)
    comms = [Communicator(t, timeout=20) for t in made]
    try:
        for r, comm in enumerate(comms):
            lines = comm.describe().splitlines()
            assert lines[0] == f"rank {r} of 2: link kinds, in the order asked: local, socket"
            assert lines[1].startswith(f"rank {r} -> rank {1 - r}: pipe + shared memory")
            assert lines[1].endswith(LOCAL)
            assert lines[2] == "engines: links: links (pipe); board: shared board of 2 ranks"
            assert len(lines) == 3
            with comm.wrapped(Counting()):
                assert comm.describe().splitlines()[3:] == ["wrappers: counting"]
            assert len(comm.describe().splitlines()) == 3
    finally:
        for comm in comms:
            comm.close()


def job_shared_memory_off_on_rank_1(rank: int, world: int, store: str, **_: Any) -> dict:
    """A rank of the session's rank processes (``conftest.cluster``) through
    ``ringcomm.init``, ``RINGCOMM_SHM=0`` on rank 1 only (the pool undoes it after the job):
    what ``describe()`` says and the kind each pair chose, as JSON has them."""
    import ringcomm

    os.environ["RINGCOMM_SHM"] = "0" if rank else "1"
    comm = ringcomm.init(rank, world, store=store, timeout=20)
    try:
        return json.loads(json.dumps({"describe": comm.describe(), "choices": {
            peer: [c.kind, c.reason, [list(d) for d in c.declined]]
            for peer, c in comm.transport.choices.items()}}))
    finally:
        comm.close()


@needs_shm
@pytest.mark.timeout(40)
def test_shared_memory_turned_off_on_one_rank_gives_that_pair_sockets(cluster):
    """Two processes through ``ringcomm.init``, ``RINGCOMM_SHM=0`` on rank 1 only: the pair
    takes ipc sockets, each end saying whose shared memory was missing, and the group has
    no board."""
    outs = cluster.run(2, "test_seams.job_shared_memory_off_on_rank_1", timeout=30)
    for r, res in enumerate(outs):
        why = NOT_OFFERED_THERE.format(peer=1) if r == 0 else NOT_OFFERED_HERE
        assert res["choices"] == {str(1 - r): ["socket", "ZeroMQ ipc (same host)",
                                               [["local", why]]]}
        lines = res["describe"].splitlines()
        assert lines[1].startswith(f"rank {r} -> rank {1 - r}: ipc://"), lines
        assert lines[1].endswith(_bracket("socket", "ZeroMQ ipc (same host)",
                                          (("local", why),))), lines
        assert lines[2] == "engines: links: links (socket)", lines


# --------------------------------------------------------------------------- the hook


class Counting(Wrapper):
    """Counts every message each link sends and receives, every post and take on the board,
    and every op each engine runs (``run``, or its fast entry ``allreduce_now``)."""

    name = "counting"

    def __init__(self) -> None:
        self.seen = Tally()
        self.entries: Counter[tuple[str, str]] = Counter()  # (engine, entry) -> ops
        self.lock = threading.Lock()

    def link(self, link: Link) -> Link:
        return _CountedLink(link, self)

    def board(self, channel: BoardChannel) -> BoardChannel:
        return _CountedBoard(channel, self)

    def engine(self, engine: Engine) -> Engine:
        return _CountedEngine(engine, self)

    def count(self, what: str, peer: int = -1) -> None:
        with self.lock:
            if what == "posts":
                self.seen.posts += 1
            else:
                getattr(self.seen, what)[peer] += 1


class _CountedLink(LinkWrapper):
    def __init__(self, inner: Link, counting: Counting) -> None:
        super().__init__(inner)
        self.counting = counting

    def send(self, header, payload, op):
        handle = self.inner.send(header, payload, op)
        self.counting.count("sent", self.peer)
        return handle

    def send_reserved(self, header, op):
        handle = self.inner.send_reserved(header, op)
        self.counting.count("sent", self.peer)
        return handle

    def recv_header(self, wait):
        header = self.inner.recv_header(wait)  # a poll that finds nothing raises: no message
        self.counting.count("received", self.peer)
        return header


class _CountedBoard(BoardChannelWrapper):
    def __init__(self, inner: BoardChannel, counting: Counting) -> None:
        super().__init__(inner)
        self.counting = counting

    def post(self, header, payload, deadline, op, at=0):
        self.inner.post(header, payload, deadline, op, at)
        self.counting.count("posts")

    def take(self, peer, header, dtype, count, deadline, op, at=0):
        payload = self.inner.take(peer, header, dtype, count, deadline, op, at)
        self.counting.count("taken", peer)
        return payload


class _CountedEngine(EngineWrapper):
    def __init__(self, inner: Engine, counting: Counting) -> None:
        super().__init__(inner)
        self.counting = counting

    def run(self, schedule, buffers, ctx):
        self.counting.entries[(self.name, "run")] += 1
        self.inner.run(schedule, buffers, ctx)

    def allreduce_now(self, plan, data, seq, deadline, name, observe=None):
        self.counting.entries[(self.name, "allreduce_now")] += 1
        self.inner.allreduce_now(plan, data, seq, deadline, name, observe)


SMALL = 3  # elements a block: on the board where there is one
LARGE = 20 << 10  # 80 KiB of float32 a block: above the board's 64 KiB, three segments
BIG = 320 << 10  # 1.25 MiB of float32: two-shot on the board, in two posts of a slot each
SEGMENT = 32 << 10


def every_call(world: int, board: bool) -> list[Call]:
    """Every collective of the table at a size on the board and one above its thresholds,
    at two roots and two ops where it takes them; all-to-all with uneven splits (some
    empty); allreduce by every algorithm, blocking (the board's fast entry) and async.
    Async calls come last: the fast entry waits for none (it takes the general way while an
    op is in flight)."""
    calls = []
    for name, spec in COLLECTIVES.items():
        if name == "allreduce":
            continue
        roots = sorted({0, world - 1}) if spec.rooted else [0]
        ops = ["sum", "max"] if spec.reduces else ["sum"]
        blocks = [SMALL, LARGE] if name != "barrier" else [0]
        calls += [Call(name, block, op=op, root=root)
                  for block in blocks for op in ops for root in roots]
    for scale in (1, 4096):  # a few elements a pair, then several segments
        calls.append(Call("alltoall", splits=tuple(
            tuple((s + 2 * d) % 3 * scale for d in range(world)) for s in range(world))))
    for block in (SMALL, BIG):
        calls += [Call("allreduce", block, op=op) for op in ("sum", "max", "avg")]
        calls += [Call("allreduce", block, algorithm=name) for name in ALLREDUCE]
        if board:
            calls.append(Call("allreduce", block, algorithm="twoshot"))
    calls.append(Call("allreduce", BIG // 2, dtype="float64"))
    if board:
        calls.append(Call("allreduce", SMALL, algorithm="board"))
    calls += [Call("allreduce", SMALL, async_op=True), Call("allreduce", BIG, async_op=True),
              Call("broadcast", LARGE, root=world - 1, async_op=True)]
    return calls


def exercise(comm: Communicator, calls: list[Call], counting: Counting) -> dict[str, Any]:
    """Run ``calls`` and point-to-point sends around the ring (small, several segments, a
    receive from any rank) on ``comm`` with ``counting`` in place; return what it saw and
    what the schedules say."""
    rank, world = comm.rank, comm.world_size
    for call in calls:
        done = call.issue(comm, call.buffers(rank, world))
        if call.async_op:
            done.wait()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for count, src in ((SMALL, prv), (BIG, prv), (LARGE, None)):
        out = np.empty(count, np.float32)
        work = comm.send(contribution(rank, count, "float32"), nxt, async_op=True)
        comm.recv(out, src)
        work.wait()
        assert np.array_equal(out, contribution(prv, count, "float32"))

    expected = Tally()
    for call in calls:
        choice = comm.choose(call.collective, call.nbytes(rank, world), call.itemsize,
                             algorithm=call.algorithm)
        expected.add(tally(call.schedule(rank, world, choice.algorithm, choice.segment_bytes,
                                         comm.hosts)))
    for count in (SMALL, BIG, LARGE):
        expected.sent[nxt] += p2p_messages(rank, world, nxt, count, 4, comm.segment_bytes)
        expected.received[prv] += p2p_messages(prv, world, rank, count, 4, comm.segment_bytes)
    fast = sum(call.collective == "allreduce" and call.algorithm is None and not call.async_op
               for call in calls) if "board" in comm.engines else 0
    with counting.lock:
        seen = counting.seen.as_dict()
    return {"seen": seen, "expected": expected.as_dict(), "fast": fast,
            "entries": dict(counting.entries), "ops": len(calls)}


def check_counts(results: list[dict[str, Any]], board: bool) -> None:
    for rank, res in enumerate(results):
        assert res["seen"] == res["expected"], f"rank {rank}"
        assert sum(res["expected"]["sent"].values()) > 0
        assert (res["expected"]["posts"] > 0) == board, rank
        entries = res["entries"]
        assert entries.get(("board", "allreduce_now"), 0) == res["fast"], entries
        assert sum(entries.values()) == res["ops"], entries  # every op through the hook


@pytest.mark.timeout(90)
@pytest.mark.parametrize("board", [False, True], ids=["links", "board"])
# the hook is the same at every world size: an even and an odd one in the default suite
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_a_wrapper_put_in_through_the_hook_sees_every_message_post_and_take(world, board):
    """In-process groups; the wrapper goes in with ``comm.wrapped`` on every rank. Per rank
    and peer, the messages it saw sent and received equal the sends (fused ones too) and
    receives of the schedules each call ran, plus ``direct.send``'s messages of the
    point-to-point ops; its posts and takes on the board equal the schedules' posts and
    takes; every op reached it through an engine, each blocking allreduce of a board
    group through the board's fast entry, also for sizes it had planned before the wrapper
    went in."""
    calls = every_call(world, board)

    def fn(comm: Communicator) -> dict[str, Any]:
        for block in (SMALL, BIG):  # plans of the fast entry made before the wrapper
            comm.allreduce(contribution(comm.rank, block, "float32"))
        counting = Counting()
        with comm.wrapped(counting):
            return exercise(comm, calls, counting)

    check_counts(run_group(world, fn, board=board, segment_bytes=SEGMENT, timeout=60), board)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["local", "tcp"])
def test_a_wrapper_given_at_construction_sees_every_message_on_real_links(kind):
    """Three ranks (threads) over real transports: pipes and shared memory with the shared
    board (whose reserved sends the fused steps use), or tcp sockets; the wrapper given to
    the communicator when it is made."""
    if kind == "local" and not shm_ring.available():
        pytest.skip("needs /dev/shm")
    made = transport_group(3, "auto" if kind == "local" else "tcp", True)
    board = made[0].board is not None
    assert board == (kind == "local")
    calls = every_call(3, board)
    countings = [Counting() for _ in made]
    comms = [Communicator(t, timeout=30, segment_bytes=SEGMENT, wrappers=[c])
             for t, c in zip(made, countings, strict=True)]
    try:
        results = in_threads(3, lambda r: exercise(comms[r], calls, countings[r]), timeout=50)
    finally:
        for comm in comms:
            comm.close()
    check_counts(results, board)
    if kind == "local":
        assert all(comm.transport.counters["shm"] for comm in comms)


# --------------------------------------------------------------------------- the selector

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _bytes(text: str) -> int:
    number, unit = text.split()
    return int(number) * _UNITS[unit]


def choice_table(capsys: Any, *args: str) -> tuple[int, bool, list | None, list[dict]]:
    """``ringcomm schedule --choices ARGS``'s table: world size, whether the group has the
    board, its hosts (lists of ranks) or None, and its rows."""
    cli.main(["schedule", "--choices", *args])
    lines = capsys.readouterr().out.splitlines()
    head = re.fullmatch(r"what runs for (\d+) ranks \((.*)\), by size .*", lines[0])
    assert head, lines[0]
    world, where = int(head.group(1)), head.group(2)
    layout = re.fullmatch(r"(\d+)x(\d+) hosts x ranks", where)
    hosts = None if layout is None else [
        list(range(h * int(layout.group(2)), (h + 1) * int(layout.group(2))))
        for h in range(int(layout.group(1)))]
    board = where == "one host, with a shared board"
    assert board or hosts or where == "one host, without a shared board", where
    assert lines[1].split() == ["collective", "sizes", "engine", "algorithm", "why"]
    rows = []
    for line in lines[2:]:
        collective, sizes, engine, algorithm, why = re.split(r"\s{2,}", line.strip())
        low, high = (0, _bytes(sizes[6:])) if sizes.startswith("up to ") else \
            map(_bytes, re.fullmatch(r"(.*) < size <= (.*)", sizes).groups())
        rows.append({"collective": collective, "low": low, "high": high, "engine": engine,
                     "algorithm": algorithm, "why": why})
    return world, board, hosts, rows


def row_calls(row: dict, world: int) -> list[Call]:
    """Calls of ``row``'s band, of float32: its smallest power of two (4 B for the first
    band) and, where it is at most 4 MiB, its largest; for the collectives whose size is
    cut into a block per rank, the nearest sizes inside the band that are."""
    name = row["collective"]
    if name == "barrier":
        return [Call(name)]
    sizes = [4 if not row["low"] else 2 * row["low"]]
    if row["high"] <= 4 << 20 and row["high"] != sizes[0]:
        sizes.append(row["high"])
    calls = []
    for size in sizes:
        if name in ("reduce_scatter", "alltoall"):
            per_rank = 4 * world
            size = max(per_rank, size // per_rank * per_rank)
            call = Call(name, size // per_rank)
        else:
            call = Call(name, size // 4)
        assert row["low"] < call.nbytes(0, world) <= min(row["high"], 4 << 20), (row, call)
        calls.append(call)
    return calls


def disagreements(rows: list[dict], trace: list, world: int) -> list[str]:
    """The calls whose op (the ``i``-th call, op ``#i`` on every rank) ran on another engine
    or algorithm than their row says, or not on every rank; ``rows[i]`` is the row of the
    ``i``-th call."""
    ran: dict[str, set] = {}
    ranks: dict[str, set] = {}
    for event in trace:
        ran.setdefault(event.op, set()).add((event.engine, event.algorithm))
        ranks.setdefault(event.op, set()).add(event.rank)
    wrong = []
    for i, row in enumerate(rows):
        op = f"{row['collective']} #{i}"
        if ran.get(op) != {(row["engine"], row["algorithm"])} or \
                ranks.get(op) != set(range(world)):
            wrong.append(f"{op}: the table says {row['engine']}/{row['algorithm']}, "
                         f"ran {ran.get(op)} on ranks {ranks.get(op)}")
    return wrong


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["-n", "3"], ["-n", "3", "--no-board"], ["--hosts", "2x2"]],
                         ids=["one-host", "no-board", "2x2"])
def test_the_table_of_choices_is_what_runs(capsys, args):
    """Each row of the printed table run at the ends of its band (up to 4 MiB), on an
    in-process group like the table's (the board, simulated hosts): the engine and
    algorithm of every step every rank ran are the row's. A row that says otherwise is
    caught."""
    world, board, hosts, rows = choice_table(capsys, *args)
    assert {row["collective"] for row in rows} == set(COLLECTIVES)
    runs = [(row, call) for row in rows for call in row_calls(row, world)]

    def fn(comm: Communicator) -> None:
        for _, call in runs:
            call.issue(comm, call.buffers(comm.rank, world))

    trace: list = []
    run_group(world, fn, board=board, hosts=hosts, trace=trace, timeout=40)
    of_calls = [row for row, _ in runs]
    assert disagreements(of_calls, trace, world) == []
    # the comparison catches a table that says otherwise: each row, given another
    # algorithm, is found out
    for i, row in enumerate(of_calls):
        other = dict(row, algorithm="ring" if row["algorithm"] != "ring" else "rd")
        assert disagreements(of_calls[:i] + [other] + of_calls[i + 1:], trace, world), row
