"""Faults on purpose and checksums (``ringcomm.faults``).

The spec is read as the issue writes it and refused with the part quoted; each action acts
where messages move, on the links and on the board, in groups of threads and of real
processes, with the outcome the reference (docs/faults.md) states, always within the
timeout and 2 s; checksums catch a corruption on links and board and change no result when
nothing is corrupted; ranks that differ in either setting fail at init.
"""

from __future__ import annotations

import logging
import os
import re
import time

import numpy as np
import pytest

import ringcomm.faults
from ringcomm import ArgumentError
from ringcomm.core import config, fault_spec
from ringcomm.errors import (
    ChecksumError,
    CommError,
    CommTimeout,
    DesyncError,
    PeerLostError,
    RankKilled,
    RemoteError,
)
from ringcomm.faults.checksum import digest
from ringcomm.runtime.local import run_group
from ringcomm.transport.header import SIZE, Header, OpKind

slow = pytest.mark.slow
TIMEOUT = 1.0  # seconds an op may take in the groups of threads here


def values(rank: int, count: int, call: int = 0) -> np.ndarray:
    """Small integers, exact in float32 however summed."""
    return ((np.arange(count) * 7 + rank * 13 + call * 5) % 23 - 11).astype(np.float32)


# ------------------------------------------------------------------ the spec


@pytest.mark.parametrize("text,canonical", [
    ("kill:rank=1", "kill:rank=1,call=1,msg=0"),
    (" delay : rank = 0 , ms = 2.5 , op = Broadcast ; ",
     "delay:rank=0,op=broadcast,call=1,msg=0,ms=2.5"),
    ("drop:rank=2,op=send,call=3,msg=4,peer=0;corrupt:rank=0,msg=random,seed=7",
     "drop:rank=2,op=send,call=3,msg=4,peer=0;corrupt:rank=0,call=1,msg=random,seed=7"),
])
def test_a_spec_reads_as_the_issue_writes_it(text, canonical):
    spec = fault_spec.parse(text)
    assert str(spec) == canonical
    assert fault_spec.parse(str(spec)) == spec  # the canonical text is what ranks compare


@pytest.mark.parametrize("text,says", [
    ("explode:rank=1", "unknown action 'explode' in 'explode:rank=1'"),
    ("kill", "gives 'kill' no keys in 'kill'"),
    ("kill:op=allreduce", "does not say which rank acts in 'kill:op=allreduce'"),
    ("kill:rank=one", "has rank='one' in 'kill:rank=one', not a whole number of 0 or more"),
    ("kill:rank=1,when=now", "unknown key 'when' in 'kill:rank=1,when=now'"),
    ("kill:rank=1,op=allreduse", "unknown op 'allreduse'"),
    ("kill:rank=1,call=0", "has call='0'"),
    ("kill:rank=1,msg=-1", "has msg='-1'"),
    ("kill:rank=1,rank=2", "gives 'rank' twice"),
    ("kill:rank=1,msg", "has 'msg' in 'kill:rank=1,msg', not KEY=VALUE"),
    ("delay:rank=1", "gives the delay no length"),
    ("delay:rank=1,ms=soon", "has ms='soon'"),
    ("drop:rank=1,ms=5", "only a delay takes ms"),
    ("drop:rank=1,seed=3", "gives a seed without msg=random"),
    ("drop:rank=1,peer=1", "has peer=1, the acting rank itself"),
    (" ; ", "names no fault"),
])
def test_a_spec_that_cannot_be_read_is_refused_quoting_the_part(text, says, monkeypatch):
    with pytest.raises(ValueError, match=re.escape(says)):
        fault_spec.parse(text)
    with pytest.raises(ArgumentError, match=re.escape(says)):  # the API
        ringcomm.faults.inject(text)
    monkeypatch.setenv("RINGCOMM_FAULTS", text)  # the environment, as init reads it
    if text.strip(" ;"):
        with pytest.raises(ArgumentError, match=re.escape(f"RINGCOMM_FAULTS={text!r} ")):
            config.value("faults")
        with pytest.raises(ArgumentError, match=re.escape(says)):
            run_group(2, lambda comm: None)


def test_the_ops_a_spec_names_are_those_on_the_wire():
    kinds = {kind.name.lower() for kind in OpKind
             if kind < OpKind.PROBE and kind != OpKind.CREDIT}  # credits carry no data
    assert set(fault_spec.OPS) == kinds - {"p2p"} | {"send"}


def test_the_header_has_room_for_a_checksum_that_the_desync_check_never_sees():
    header = Header(3, 16, 4, 1024, 1, 0, -1, OpKind.ALLREDUCE, 0, 1, 1, checksum=0xBEEF)
    assert Header.unpack(header.pack()) == header and SIZE == 56
    assert header._replace(checksum=0) == Header(*header[:-1])


# ------------------------------------------------------------------ groups of threads


def _allreduces(calls: int, count: int = 1000):
    def job(comm):
        out = []
        for call in range(calls):
            x = values(comm.rank, count, call)
            comm.allreduce(x)
            out.append(x.tobytes() == sum(values(r, count, call).astype(np.float64)
                                          for r in range(comm.world_size)).astype(
                np.float32).tobytes())
        return out
    return job


def _group(spec, job, *, world=3, board=False, checksum=None, timeout=TIMEOUT):
    """Run ``job`` on a group of threads with ``spec`` injected; (results, seconds)."""
    start = time.monotonic()
    with ringcomm.faults.inject(spec, checksum=checksum):
        results = run_group(world, job, timeout=timeout, return_errors=True, board=board)
    return results, time.monotonic() - start


def _no_wrong_result(results):
    for res in results:
        if not isinstance(res, BaseException):
            assert all(res), results


ENGINES = [pytest.param(False, id="links"), pytest.param(True, id="board")]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("board", ENGINES)
def test_kill_ends_the_rank_and_every_survivor_raises(board, caplog):
    results, took = _group("kill:rank=1,op=allreduce,call=2", _allreduces(3), board=board)
    assert isinstance(results[1], RankKilled), results
    for r in (0, 2):
        assert isinstance(results[r], (PeerLostError, RemoteError)), results
    assert any(isinstance(results[r], PeerLostError) and results[r].peer == 1
               for r in (0, 2)), results
    assert took < TIMEOUT + 2
    where = "board post 0" if board else "message 0 to rank"
    assert [(rec.levelno, rec.getMessage()[:70]) for rec in caplog.records
            if "injects" in rec.getMessage()] == [
        (logging.WARNING, f"rank 1 injects fault kill:rank=1,op=allreduce,call=2,msg=0: kill "
                          f"{where}"[:70])]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("board", ENGINES)
def test_a_delay_below_the_timeout_changes_nothing_but_the_time(board):
    results, took = _group("delay:rank=2,op=allreduce,call=2,ms=300", _allreduces(3),
                           board=board)
    assert results == [[True] * 3] * 3
    assert took >= 0.3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("action", ["delay:ms=1300", "drop"])
@pytest.mark.parametrize("board", ENGINES)
def test_a_delay_above_the_timeout_or_a_drop_fails_every_rank_naming_the_peer(board, action):
    name, _, ms = action.partition(":")
    spec = f"{name}:rank=1,op=allreduce,call=2" + (f",{ms}" if ms else "")
    results, took = _group(spec, _allreduces(3), board=board)
    _no_wrong_result(results)
    assert all(isinstance(r, CommError) for r in results[::2]), results
    first = [r for r in results if isinstance(r, (CommTimeout, DesyncError))]
    assert first and all(r.peer is not None for r in first), results
    assert took < TIMEOUT + 2 + (1.3 if ms else 0)  # the delayed rank sleeps it out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("board", ENGINES)
def test_corrupt_with_checksums_is_a_checksum_error_naming_link_op_and_message(board):
    results, took = _group("corrupt:rank=1,op=allreduce,call=2", _allreduces(3),
                           board=board, checksum=True)
    _no_wrong_result(results)
    caught = [r for r in results if isinstance(r, ChecksumError)]
    assert caught, results
    for err in caught:
        assert err.peer == 1 and err.op == "allreduce #1", err
        assert re.search(rf"(message|post) 0 of allreduce #1 from rank 1 to rank {err.rank}",
                         str(err)), err
    assert all(isinstance(r, (ChecksumError, RemoteError)) for r in results if r is not
               results[1]), results
    assert took < TIMEOUT + 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("board", ENGINES)
def test_corrupt_without_checksums_goes_unseen_and_spares_the_senders_buffer(board):
    """What the checksum is for: the flipped byte reaches the other ranks' results and
    nobody can tell. The root's own buffer, which its message was sent from, is intact."""
    def job(comm):
        out = []
        for call in range(2):
            x = values(1, 500, call) if comm.rank == 1 else np.zeros(500, np.float32)
            comm.broadcast(x, root=1)
            out.append(x.tobytes() == values(1, 500, call).tobytes())
        return out
    results, _ = _group("corrupt:rank=1,op=broadcast,call=2", job, board=board)
    assert results[1] == [True, True], results
    others = [results[0], results[2]]
    assert [True, False] in others and all(r[0] for r in others), results
    if board:  # every rank takes the root's post
        assert others == [[True, False]] * 2, results


@pytest.mark.timeout(30)
def test_a_fault_acts_on_the_message_of_the_call_its_rule_names(caplog):
    """call counts that op on the acting rank, msg its messages within the op (to peer,
    where given), and msg=random picks the same message on every run."""
    def job(comm):
        for _ in range(3):
            comm.broadcast(np.zeros(4096, np.float32), root=0)
            comm.allreduce(np.zeros(4096, np.float32), algorithm="rd")
    # rd at world 4, 256 elements a segment: 16 messages to rank 1, then 16 to rank 2
    spec = ("delay:rank=0,op=allreduce,call=3,msg=5,peer=2,ms=1;"
            "delay:rank=0,op=allreduce,call=2,msg=random,seed=3,ms=1")
    seen = []
    for _ in range(2):
        caplog.clear()
        with ringcomm.faults.inject(spec):
            run_group(4, job, timeout=TIMEOUT, segment_bytes=1024)
        seen.append([rec.getMessage().partition(": ")[2] for rec in caplog.records
                     if "injects" in rec.getMessage()])
    assert seen[0] == seen[1]
    first, second = seen[0]
    assert re.fullmatch(r"delay message \d+ to rank [12] of allreduce #3", first), first
    assert second == "delay message 5 to rank 2 of allreduce #5", second


@pytest.mark.timeout(30)
def test_msg_random_picks_one_of_a_point_to_point_sends_messages_whatever_its_dtype(caplog):
    """A send of 64 KiB of uint8 in 4 KiB segments is 16 messages: msg=random picks one of
    those for every seed (counting it in 4-byte items would make it 64, and the rule would
    pick past the end for most seeds and never act)."""
    def job(comm):
        x = np.arange(1 << 16, dtype=np.uint8) if comm.rank == 0 else \
            np.zeros(1 << 16, np.uint8)
        if comm.rank == 0:
            comm.send(x, 1)
        else:
            comm.recv(x, 0)
    for seed in range(8):
        caplog.clear()
        with ringcomm.faults.inject(f"delay:rank=0,op=send,msg=random,seed={seed},ms=1"):
            run_group(2, job, timeout=TIMEOUT, segment_bytes=4096)
        acted = [r.getMessage() for r in caplog.records if "injects" in r.getMessage()]
        assert len(acted) == 1, (seed, acted)
        index = int(re.search(r"delay message (\d+) to rank 1", acted[0]).group(1))
        assert 0 <= index < 16, (seed, acted)


@pytest.mark.timeout(30)
def test_a_nested_inject_holds_over_the_outer_one():
    """``inject(None)`` inside ``inject("drop:...")`` means no faults, and an inner spec
    replaces the outer one, until the inner ends."""
    def job(comm):
        x = np.ones(100, np.float32)
        comm.allreduce(x)
        return float(x[0])
    with ringcomm.faults.inject("drop:rank=0,op=allreduce,call=1"):
        with ringcomm.faults.inject(None):
            assert run_group(2, job, timeout=TIMEOUT) == [2.0, 2.0]
        with ringcomm.faults.inject("delay:rank=1,op=allreduce,call=1,ms=1"):
            assert run_group(2, job, timeout=TIMEOUT) == [2.0, 2.0]
        results = run_group(2, job, timeout=TIMEOUT, return_errors=True)
    assert any(isinstance(r, CommTimeout) for r in results), results  # the outer, again


@pytest.mark.timeout(30)
@pytest.mark.parametrize("action", ["kill", "drop", "corrupt"])
def test_point_to_point_sends_are_ops_of_their_own(action):
    def job(comm):
        out = []
        for call in range(2):
            x = values(comm.rank, 3000, call)
            if comm.rank == 0:
                comm.send(x, 1)
                out.append(True)
            else:
                comm.recv(x, 0)
                out.append(x.tobytes() == values(0, 3000, call).tobytes())
        return out
    results, took = _group(f"{action}:rank=0,op=send,call=2", job, world=2,
                           checksum=True)
    err = results[1]
    if action == "kill":
        assert isinstance(results[0], RankKilled), results
        assert isinstance(err, PeerLostError) and err.peer == 0, results
        return
    assert results[0] == [True, True]  # a send completes once its messages left
    want = CommTimeout if action == "drop" else ChecksumError
    assert isinstance(err, want) and err.peer == 0, results
    if action == "corrupt":
        assert "message 0 of p2p #1 from rank 0 to rank 1" in str(err)
    assert took < TIMEOUT + 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("board", ENGINES)
def test_checksums_change_no_result(board):
    """Every collective, one- and two-shot on the board, ring and tree over links, with
    checksums on: exact results."""
    def job(comm):
        rank, world = comm.rank, comm.world_size
        right = []
        for count in (1, 1000, 300_000):  # 1.2 MB: two-shot on the board, in pieces
            x = values(rank, count)
            comm.allreduce(x)
            right.append(x.tobytes() == sum(values(r, count).astype(np.float64)
                                            for r in range(world)).astype(np.float32)
                         .tobytes())
        for algorithm in ("ring", "tree"):
            x = values(rank, 5000)
            comm.allreduce(x, algorithm=algorithm)
            right.append(np.array_equal(x, sum(values(r, 5000) for r in range(world))))
        out = np.zeros(3 * 70, np.float32)
        comm.allgather(out, values(rank, 70))
        right.append(np.array_equal(out, np.concatenate([values(r, 70) for r in range(3)])))
        x = values(rank, 500) if rank == 2 else np.zeros(500, np.float32)
        comm.broadcast(x, root=2)
        right.append(np.array_equal(x, values(2, 500)))
        out = np.zeros(3 * 40, np.float32)
        comm.alltoall(out, values(rank, 3 * 40))
        want = np.concatenate([values(r, 3 * 40)[rank * 40:(rank + 1) * 40] for r in range(3)])
        right.append(np.array_equal(out, want))
        comm.barrier()
        return right
    results, _ = _group(None, job, board=board, checksum=True, timeout=20.0)
    assert results == [[True] * 8] * 3, results


def test_a_checksum_is_one_call_over_the_payloads_memory():
    data = np.arange(1 << 20, dtype=np.float32)
    assert digest(data) == digest(data.tobytes()) == digest(memoryview(data.view(np.uint8)))
    flipped = data.copy()
    flipped.view(np.uint8)[12345] ^= 0xFF
    assert digest(flipped) != digest(data)


def test_a_group_without_faults_or_checksums_has_nothing_in_its_path():
    def job(comm):
        return [type(link).__name__ for link in comm.transport.links if link is not None], \
            type(comm.wiring.board).__name__, comm.wiring.wrappers
    assert run_group(2, job, board=True) == [(["InMemoryLink"], "InMemoryBoardChannel",
                                              [])] * 2
    with ringcomm.faults.inject("kill:rank=1,op=reduce,call=9"):  # acts on rank 1 only
        (links0, board0, _), (links1, board1, _) = run_group(2, job, board=True)
    assert (links0, board0) == (["InMemoryLink"], "InMemoryBoardChannel")
    assert (links1, board1) == (["_FaultyLink"], "_FaultyBoard")


# ------------------------------------------------------------------ real processes


def _outcomes(res):
    return [x["outcomes"] if x is not None else None for x in res]


REAL = [  # op, elements, environment, victim: links ring and board, kill/drop/corrupt
    # kills in real processes: the fault matrix's default cases, and these in the slow suite
    pytest.param("kill", "allreduce", 300_000, {"RINGCOMM_ALGO": "ring"}, 1, marks=slow),
    pytest.param("kill", "allreduce", 256, {}, 2, marks=slow),
    pytest.param("kill", "broadcast", 2000, {"RINGCOMM_BOARD": "0"}, 0, marks=slow),
    ("drop", "allreduce", 300_000, {"RINGCOMM_ALGO": "ring"}, 1),
    pytest.param("drop", "allreduce", 256, {}, 1, marks=slow),
    pytest.param("drop", "send", 1000, {}, 2, marks=slow),
    # message 1 is a fused receive-reduce-send, whose sum is written into a ring's slot
    ("corrupt", "allreduce,msg=1", 300_000, {"RINGCOMM_ALGO": "ring"}, 1),
    ("corrupt", "allreduce", 256, {}, 0),
    pytest.param("corrupt", "allgather", 100, {"RINGCOMM_BOARD": "0"}, 2, marks=slow),
    # the other link kinds: ZeroMQ ipc sockets, and a shared-memory mailbox for small ones
    ("corrupt", "allreduce", 3000, {"RINGCOMM_SHM": "0", "RINGCOMM_BOARD": "0"}, 2),
    ("corrupt", "allreduce", 300, {"RINGCOMM_MAILBOX": "1", "RINGCOMM_BOARD": "0"}, 1),
    pytest.param("corrupt", "send", 1000, {}, 1, marks=slow),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("action,op,count,env,victim", REAL)
def test_faults_in_real_processes(cluster, action, op, count, env, victim):
    """Three calls, the second faulted: the first is right everywhere, no rank returns a
    wrong result, every error comes within the timeout and 2 s, and the outcome is the
    action's (a point-to-point fault concerns its receiver only)."""
    world, op_timeout = 3, 2.0
    spec = f"{action}:rank={victim},op={op},call=2"
    op = op.partition(",")[0]
    cluster.run(world, "fault_jobs.job_ready")  # every rank up: the init below is short
    res = cluster.run(world, "fault_jobs.job_fault", dies=(victim,) if action == "kill" else (),
                      spec=spec, op=op, count=count, checksum=action == "corrupt", calls=3,
                      op_timeout=op_timeout, env=env)
    assert all(x["board"] == (not env or "RINGCOMM_ALGO" in env) for x in res if x is not None)
    assert all(x["kinds"] == ({"socket"} if "RINGCOMM_SHM" in env else {"pipe"})
               for x in res if x is not None), res
    if "RINGCOMM_MAILBOX" in env:
        assert all(x["counters"]["mailbox"] for x in res if x is not None), res
    outcomes = _outcomes(res)
    errors = {}
    for r, calls in enumerate(outcomes):
        if calls is None:
            continue
        assert calls[0] == {"right": True}, (r, outcomes)  # call 1 is untouched
        assert all(call.get("right", True) for call in calls), (r, outcomes)
        if "type" in calls[-1]:
            assert calls[-1]["elapsed"] < op_timeout + 2, (r, calls)
            errors[r] = calls[-1]
    involved = [(victim + 1) % world] if op == "send" else \
        [r for r in range(world) if r != victim]
    assert set(involved) <= set(errors), outcomes
    types = {e["type"] for e in errors.values()}
    if action == "kill":
        assert types <= {"PeerLostError", "RemoteError"}, errors
        assert any(e["type"] == "PeerLostError" and e["peer"] == victim
                   for e in errors.values()), errors
    elif action == "drop":
        assert any(e["type"] in ("CommTimeout", "DesyncError") and e["peer"] == victim
                   for e in errors.values()), errors
    else:
        caught = [e for e in errors.values() if e["type"] == "ChecksumError"]
        assert caught and all(e["peer"] == victim and f"from rank {victim} to rank "
                              f"{e['rank']}" in e["msg"] for e in caught), errors


@pytest.mark.timeout(90)
@pytest.mark.parametrize("variable,value,says", [
    ("RINGCOMM_FAULTS", "kill:rank=1,op=allreduce,call=5",
     "ranks disagree on faults (RINGCOMM_FAULTS): rank 0 has it unset; rank 1 has "
     "'kill:rank=1,op=allreduce,call=5,msg=0'"),
    pytest.param("RINGCOMM_CHECKSUM", "1", "ranks disagree on checksum (RINGCOMM_CHECKSUM): "
                 "rank 0 has False; rank 1 has True", marks=slow),
])
def test_ranks_that_differ_in_faults_or_checksums_fail_at_init(cluster, variable, value, says):
    env = {r: {variable: value if r == 1 else None} for r in range(2)}
    for r, x in enumerate(cluster.run(2, "job_agreement", env=env)):
        err = x["init_error"]
        assert err["type"] == "ArgumentError" and err["rank"] == r, err
        assert says in err["msg"], err["msg"]


@pytest.mark.timeout(30)
def test_a_spec_every_rank_sets_is_agreed():
    """The same spec on every rank of a group of threads (one environment): nothing to
    disagree on, and the settings describe it."""
    with ringcomm.faults.inject("delay:rank=0,ms=1", checksum=True):
        described = run_group(2, lambda comm: comm.settings.describe())
    assert described == [{"algorithm": "auto", "transport": "auto",
                           "segment_bytes": described[0]["segment_bytes"],
                           "profile": described[0]["profile"],
                           "faults": "delay:rank=0,call=1,msg=0,ms=1", "checksum": True}] * 2
    assert os.environ.get("RINGCOMM_FAULTS") is None  # inject leaves the environment alone
