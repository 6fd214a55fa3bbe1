"""Real processes on 127.0.0.1, over ipc:// and tcp://: checked values for every collective,
ranks that disagree, ranks that die, the rendezvous store, and a clean close.

The ranks are spawned processes, started once for the module and given one job per test
(``tests/mp_helpers.py``): a job inits a communicator on a fresh store port, runs its checks,
closes, and sends back what the test asserts on. A rank that hangs is killed after the job's
time limit and one that dies is replaced, so a failure here never blocks the suite. The
schedules themselves are covered in one process by ``test_algorithms.py``; these tests are
about what only real processes show: sockets, the wire format, process death and teardown.

The default suite runs every collective and point-to-point op at world 2 (ipc with torch
tensors, tcp with numpy arrays); the rest is marked slow.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import pytest
from mp_helpers import IPC_BASE, free_port

import ringcomm
from ringcomm import CommError, StoreError, StoreTimeout

slow = pytest.mark.slow
FAST_GROUPS = {("ipc", 2, "torch"), ("tcp", 2, "numpy")}  # the default suite's
GROUPS = [pytest.param(t, w, id=f"{t}-{w}") for t in ("ipc", "tcp") for w in (2, 3)]
FAST = 5.0  # s: errors come from a peer's abort or a closed connection, far within the jobs'
# op timeouts (20-30 s), never from a timeout


# --------------------------------------------------------------------------- correct results


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport,world,lib", [
    *(pytest.param(t, w, lib, id=f"{t}-{w}-{lib}",
                   marks=() if (t, w, lib) in FAST_GROUPS else slow)
      for t in ("ipc", "tcp") for w in (2, 3) for lib in ("numpy", "torch")),
    pytest.param("ipc", 4, "torch", id="ipc-4-torch", marks=slow),
])
def test_every_collective_gives_checked_values(cluster, transport, world, lib):
    """allreduce (sum/max/avg), reduce_scatter and allgather in float32, float64, int64,
    bfloat16 and float16; broadcast, reduce, gather, scatter (roots 0 and last), alltoall
    (equal and uneven splits) and barrier; counts 0, 1, fewer than the ranks, indivisible by
    them, and 5 MiB (several segments). Values are checked on every rank."""
    checks = cluster.run(world, "job_collectives", transport=transport, lib=lib, timeout=80)
    # per small count (0, 1, world - 1, 3 * world + 1): 14 allreduces (sum, max and avg in
    # four dtypes, no avg for int64), 10 reduce_scatter/allgather (5 dtypes), 8 rooted (2
    # roots x 4), 4 more (scatter list, alltoall even and uneven, barrier); the 5 MiB count
    # in float32 only: 3 + 2 + 8 + 4
    assert checks == [4 * (14 + 10 + 8 + 4) + (3 + 2 + 8 + 4)] * world


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport,world", [
    *(pytest.param(*g.values, id=g.id, marks=() if g.id == "ipc-2" else slow) for g in GROUPS),
    pytest.param("tcp", 4, marks=slow)])
def test_async_ops_overlap_and_complete_in_issue_order_and_p2p_tags_match(
        cluster, transport, world):
    done = cluster.run(world, "job_async_and_p2p", transport=transport)
    expected = ["allreduce #1", "allreduce #2", "allgather #3", "broadcast #4", "barrier #5",
                "allreduce #6"]
    assert done == [expected] * world


@slow
@pytest.mark.timeout(30)
def test_world_of_one(cluster):
    assert cluster.run(1, "job_world_one") == [True]


# --------------------------------------------------------------------------- wrong input


@slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport,world", GROUPS)
def test_bad_arguments_raise_on_the_caller_before_anything_is_sent(cluster, transport, world):
    """Bad op name, root, dst/src, sizes, layout: ArgumentError at the call even with
    ``async_op=True``; only rank 0 errs, and the group is still in step afterwards."""
    caught = cluster.run(world, "job_bad_arguments", transport=transport)
    assert caught == [17] + [0] * (world - 1)


def _check_disagreement(res, world, ops):
    """Every rank raised DesyncError or RemoteError, naming itself and its op, quickly; a
    RemoteError names a rank that raised DesyncError and carries its message; every rank's
    communicator refuses further ops."""
    errs = [x["err"] for x in res]
    assert all(e is not None for e in errs), errs
    desynced = {r for r, e in enumerate(errs) if e["type"] == "DesyncError"}
    assert desynced, errs
    for r, e in enumerate(errs):
        assert isinstance(e["error"], CommError)
        assert e["type"] in ("DesyncError", "RemoteError"), e
        assert e["rank"] == r and e["op"] == ops[r], e
        assert e["msg"].startswith(f"[rank {r}, {ops[r]}]"), e["msg"]
        assert e["elapsed"] < FAST, e
        if e["type"] == "RemoteError":
            assert e["peer"] in desynced, (e, desynced)
            assert f"rank {e['peer']} failed and aborted the group: DesyncError" in e["msg"]
        after = res[r]["after"]
        assert after is not None and after["type"] == "CommAborted", after
        assert after["rank"] == r
    return errs


def _either_side(odd: int, world: int, template: str, mine: str, theirs: str) -> list[str]:
    """The message rank ``odd`` (the one that differs) or any other rank may raise: each
    names the sender's view first, the detecting rank's second."""
    found = [template.format(sender=r, a=mine, receiver=odd, b=theirs)
             for r in range(world) if r != odd]
    found += [template.format(sender=odd, a=theirs, receiver=r, b=mine)
              for r in range(world) if r != odd]
    return found


@slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["dtype", "torch-dtype", "count", "big-count", "op"])
@pytest.mark.parametrize("transport,world", GROUPS)
def test_ranks_that_disagree_all_raise_typed_errors(cluster, transport, world, case):
    """Either side may find the difference first (the other hears of it as an abort); the
    rank that finds it names exactly what differs, with both ranks' values."""
    from mp_helpers import BIG

    res = cluster.run(world, "job_mismatch", transport=transport, case=case)
    ops = ["broadcast #1" if case == "op" and r == 1 else "allreduce #1" for r in range(world)]
    errs = _check_disagreement(res, world, ops)
    sends = "rank {sender} sends {a}, rank {receiver} expects {b}"
    reduces = "rank {sender} reduces {a} elements, rank {receiver} {b}"
    needles = {
        "dtype": _either_side(1, world, sends, "float64", "float32"),
        "torch-dtype": _either_side(1, world, sends, "float16", "bfloat16"),
        "count": _either_side(1, world, reduces, "100", "101"),
        "big-count": _either_side(world - 1, world, reduces, str(BIG), str(BIG + world)),
        "op": _either_side(1, world, "rank {sender} is in {a}, rank {receiver} in {b}",
                           "allreduce #1", "broadcast #1")
        + [f"rank {s} waits in {a} while this rank waits in {b}"
           for s, a, b in ((0, "allreduce #1", "broadcast #1"), (1, "broadcast #1", "allreduce #1"),
                           (2, "allreduce #1", "broadcast #1"))],
    }[case]
    found = [e["msg"] for e in errs if e["type"] == "DesyncError"]
    assert any(n in m for m in found for n in needles), (found, needles)
    assert "Every rank must call the same collectives" in errs[0]["msg"]


@slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("algorithm", ["tree", "dbtree", "hd", "rd"])
@pytest.mark.parametrize("world", [3, 4])
def test_ranks_in_different_collectives_find_out_by_probing_while_they_stall(
        cluster, world, algorithm):
    """Rank 1 broadcasts while the others allreduce over a tree or halving-doubling: rank 1
    and the ranks it waits for only wait (nobody receives a wrong header), so the stalled
    receives probe their peers and find out in about a second, not at the timeout."""
    res = cluster.run(world, "job_mismatch", transport="ipc", case="op", algorithm=algorithm)
    ops = ["broadcast #1" if r == 1 else "allreduce #1" for r in range(world)]
    errs = _check_disagreement(res, world, ops)
    needles = ("rank 1 waits in broadcast #1 while this rank waits in allreduce #1",
               "waits in allreduce #1 while this rank waits in broadcast #1",
               "rank 1 is in broadcast #1, rank", "in allreduce #1, rank 1 in broadcast #1")
    assert any(n in e["msg"] for e in errs for n in needles), errs


@slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("world", [3, 4])
def test_a_rank_that_fails_aborts_peers_that_had_no_way_to_notice(cluster, world):
    """Rank 1 passes float32 where the others pass float64. In the ring rank 0 only hears
    from rank ``world - 1``, whose data is fine: it learns of the failure from the abort."""
    res = cluster.run(world, "job_mismatch", transport="ipc", case="dtype", algorithm="ring")
    errs = _check_disagreement(res, world, ["allreduce #1"] * world)
    assert errs[0]["type"] == "RemoteError", errs[0]
    assert errs[0]["peer"] in (1, 2)
    assert "float32" in errs[0]["msg"]


@slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["broadcast-count", "root", "tag"])
@pytest.mark.parametrize("transport,world", GROUPS)
def test_ranks_that_only_send_learn_of_a_disagreement_by_their_next_op(
        cluster, transport, world, case):
    """A rank that only sends in the op (broadcast's root, a sender of p2p, or every rank
    when the roots differ) cannot see the mismatch in that op; by its next op it must have a
    typed error, never a hang or a silent success."""
    res = cluster.run(world, "job_mismatch", transport=transport, case=case)
    first = [x["err"] or x["after"] for x in res]
    assert all(e is not None for e in first), res
    assert any(e["type"] == "DesyncError" for e in first), first
    for r, e in enumerate(first):
        assert e["type"] in ("DesyncError", "RemoteError"), e
        assert e["rank"] == r and e["elapsed"] < FAST, e
    if case == "tag":
        assert first[1]["type"] == "DesyncError"
        assert "ranks disagree about the op: rank 0 uses tag 1, rank 1 tag 2." in first[1]["msg"]
        assert first[1]["op"] == "recv #0 from rank 0"


# --------------------------------------------------------------------------- peers that die


def _check_peer_death(res, victim, *, limit, op="allreduce", may_finish=()):
    lost = []
    for r, x in enumerate(res):
        if r == victim:
            assert x is None
            continue
        err, after = x["err"], x["after"]
        if r in may_finish and err is None:  # its part needs nothing from the victim
            err, after = after, None
        assert err is not None, f"rank {r}: no error although rank {victim} died"
        assert isinstance(err["error"], CommError)
        assert err["type"] in ("PeerLostError", "RemoteError"), err
        assert err["rank"] == r, err
        assert err["elapsed"] < limit, err
        if err["type"] == "PeerLostError":
            assert err["peer"] == victim and f"rank {victim} died" in err["msg"], err
            lost.append(r)
        else:
            assert "PeerLostError" in err["msg"] and f"rank {victim} died" in err["msg"], err
        if r not in may_finish:
            assert err["op"].startswith(op), err
            assert after is not None and after["type"] == "CommAborted", after
        assert x["close_s"] < 5.0, x
    assert lost, "no survivor raised PeerLostError"


def _victim_run(cluster, tmp_path, world, victim, **kw):
    report = tmp_path / "victim_ipc_dir"
    try:
        return cluster.run(world, "job_peer_dies", dies=(victim,), victim=victim,
                           report=str(report), op_timeout=20.0, timeout=60, **kw)
    finally:  # a killed rank cannot remove its ipc sockets: do it for it
        if report.exists():
            leftover = report.read_text()
            if leftover and os.path.dirname(leftover) == IPC_BASE:
                shutil.rmtree(leftover, ignore_errors=True)


@slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport,world,victim,when,how", [
    ("ipc", 2, 1, "before", "exit"),
    ("tcp", 2, 0, "sleeping", "kill"),
    ("ipc", 3, 0, "during", "kill"),  # rank 0 serves the store, too
    ("tcp", 3, 2, "during", "exit"),
    ("tcp", 3, 1, "before", "kill"),
    ("ipc", 4, 2, "sleeping", "exit"),
])
def test_a_dead_peer_gives_peer_lost_errors_fast(cluster, tmp_path, transport, world, victim,
                                                 when, how):
    """Rank ``victim`` calls os._exit(1) or is SIGKILLed: before the allreduce, part-way
    through a run of 5 MiB allreduces, or while the others wait for it to join. Survivors raise
    PeerLostError (or RemoteError from a survivor that did), far within the 20 s timeout;
    the communicator then raises CommAborted, and close() returns."""
    res = _victim_run(cluster, tmp_path, world, victim, transport=transport, when=when,
                      how=how)
    _check_peer_death(res, victim, limit=FAST)


@slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world,victim,when,how", [
    (2, 1, "sleeping", "kill"),
    (3, 0, "before", "exit"),  # rank 0 made the board and serves the store
    (4, 2, "sleeping", "exit"),
])
def test_a_dead_peer_on_the_shared_board_gives_peer_lost_errors_fast(cluster, tmp_path, world,
                                                                     victim, when, how):
    """Small allreduces on the shared board: no message of the op travels, so the waiting
    ranks learn of the death from the victim's pipe closing, which they watch meanwhile."""
    res = _victim_run(cluster, tmp_path, world, victim, transport="ipc", when=when, how=how,
                      op="small")
    assert all(x["board"] for r, x in enumerate(res) if r != victim), res
    _check_peer_death(res, victim, limit=FAST)


@slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport,world", [("ipc", 2), ("tcp", 3)])
def test_a_rank_that_only_sends_to_a_dead_peer_raises_peer_lost(cluster, tmp_path, transport,
                                                                world):
    """A 5 MiB broadcast down the chain 0 -> 1 -> ... -> last, with the last rank dead: the
    rank before it only *sends* to it (zero-copy), so no receive notices the death. Rank 0,
    which needs nothing from the victim, may finish and then stays idle, so no abort helps."""
    victim = world - 1
    res = _victim_run(cluster, tmp_path, world, victim, transport=transport, when="before",
                      op="broadcast", idle=(0,))
    _check_peer_death(res, victim, limit=2.5, op="broadcast",
                      may_finish=(0,) if world > 2 else ())
    sender = res[victim - 1]["err"]
    assert sender["type"] == "PeerLostError" and "to send to it" in sender["msg"], sender


# --------------------------------------------------------------------------- store and close


def _threads_left_by(before: set[threading.Thread]) -> list[threading.Thread]:
    """ringcomm's threads that were not running before (process-wide ones, such as the fake
    device runtime's, started by earlier tests in this process, are not this init's)."""
    return [t for t in threading.enumerate() if t.name.startswith("ringcomm") and t not in before]


@slow
@pytest.mark.timeout(30)
def test_an_unreachable_store_fails_fast_with_a_store_error():
    port = free_port()  # nothing listens there
    before = set(threading.enumerate())
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match=f"could not reach the store at 127.0.0.1:{port}"):
        ringcomm.init(rank=1, world_size=2, store=f"127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - start < 6
    assert not _threads_left_by(before)


@slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("bind_host", ["127.0.0.1", "0.0.0.0"])
def test_serving_the_store_on_a_port_in_use_says_so(bind_host):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind((bind_host, 0))
        holder.listen()
        port = holder.getsockname()[1]
        before = set(threading.enumerate())
        start = time.monotonic()
        with pytest.raises(StoreError, match="in use") as info:
            ringcomm.init(rank=0, world_size=2, store=f"127.0.0.1:{port}", timeout=5)
        assert not isinstance(info.value, StoreTimeout)
        assert str(port) in str(info.value)
        assert time.monotonic() - start < 2
    assert not _threads_left_by(before)


@slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport,world", GROUPS)
def test_close_releases_files_and_threads_and_init_works_again(cluster, transport, world):
    res = cluster.run(world, "job_lifecycle", transport=transport)
    dirs = [d for x in res for d in x["dirs"]]
    assert len(dirs) == 3 * world
    if transport == "ipc":
        assert len(set(dirs)) == len(dirs)
        assert not [d for d in dirs if os.path.exists(d)]
    else:
        assert dirs == [None] * len(dirs)


@slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport,world", [("ipc", 3), ("tcp", 2)])
def test_ranks_with_different_histories_still_meet(cluster, transport, world):
    assert cluster.run(world, "job_uneven_history", transport=transport) == [world] * world


@slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport,world", [("ipc", 3), ("tcp", 4)])
def test_split_makes_working_sub_communicators(cluster, transport, world):
    res = cluster.run(world, "job_split", transport=transport)
    for r, x in enumerate(res):
        part = [p for p in range(world) if p % 2 == r % 2]
        assert x["sub_size"] == len(part)
        assert x["sub_rank"] == sorted(part, reverse=True).index(r)  # ranked by key
        assert x["sum"] == sum(part) and x["parent"] == world and x["none"]


# --------------------------------------------------------------------------- one address again
# A process may init and close any number of times on one store address: rank 0 serves the
# store afresh each time, and the store of a group that is closing lives until every rank
# has left it, while telling a newcomer (a fast rank's next init) to come back to the next.
# Without that, a cycle failed within its first three (a rank's next init reached the store
# of the group still closing, and lost it, or met there a group its rank 0 never joined).


@pytest.mark.timeout(90)
def test_ranks_closing_at_random_times_init_again_and_again_on_one_address(cluster):
    took = cluster.run(2, "job_reinit_one_address", cycles=10, jitter=0.05, seed=0, timeout=80)
    assert [len(t) for t in took] == [10] * 2


@pytest.mark.timeout(60)
def test_a_group_made_while_another_lives_on_its_address_keeps_the_store(cluster):
    seen = cluster.run(2, "job_next_group_while_the_first_lives", timeout=50)
    assert seen == [[1.0, 2.0, 2.0]] * 2


@slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("jitter", [0.0, 0.05], ids=["at-once", "random-times"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_twenty_groups_in_a_row_on_one_address(cluster, world, jitter):
    took = cluster.run(world, "job_reinit_one_address", cycles=20, jitter=jitter, seed=world,
                       timeout=140)
    assert [len(t) for t in took] == [20] * world
