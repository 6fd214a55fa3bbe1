"""The hang report: an op that times out says where each rank stood, and rank 0 says who is
behind (``ringcomm.runtime.hang_report``, ``ringcomm.engines.progress``).

In-process groups check what each engine captures against its schedule; the analysis is
checked on states made by hand; real processes at world 3 (``hang_rank.py``), in which the
last rank never calls the op or waits in another, check the whole path: every waiting
rank's log and ``err.report``, rank 0's summary naming the rank behind, the time bound
(timeout + 2 s), ``torch.distributed``, and a store that is gone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mp_helpers import free_port

from ringcomm import CommTimeout, RemoteError
from ringcomm.engines.progress import OpProgress, in_order, over_links
from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.runtime.hang_report import NO_REPORT, RankState, analyze, timed_out
from ringcomm.runtime.local import run_group
from ringcomm.schedules.schedule import Kind

pytestmark = pytest.mark.timeout(60)

HERE = Path(__file__).parent
BOUND = 2.0  # a timeout reaches the caller within timeout + 2 s, hang report included


# --------------------------------------------------------------------------- in one process

def _skip_last(algorithm: str | None, timeout: float = 0.3, board: bool = False,
               async_op: bool = False) -> list:
    """World 3; every rank but the last runs an allreduce of 8 float32 (through the worker
    and the general runners where ``async_op``); the last never does. Returns the errors of
    ranks 0 and 1."""
    def fn(comm: Any) -> Any:
        if comm.rank == 2:
            return "skipped"
        try:
            if async_op:
                comm.allreduce(np.ones(8, np.float32), algorithm=algorithm, async_op=True).wait()
            else:
                comm.allreduce(np.ones(8, np.float32), algorithm=algorithm)
        except (CommTimeout, RemoteError) as err:
            return err
        return "no error"

    return run_group(3, fn, timeout=timeout, board=board, return_errors=True)[:2]


@pytest.mark.parametrize("algorithm,board,async_op", [
    ("ring", False, False), ("tree", False, False), ("rd", False, False), (None, True, False),
    (None, True, True)])
def test_every_engine_says_where_a_timed_out_op_stood(algorithm, board, async_op):
    """Each waiting rank's ``err.progress`` is its schedule's step: the step's index, its
    description, the peer it waits for, and the messages (posts, takes) of the steps
    before it, with their bytes. On the board: through its fast entry and its general
    runner."""
    for rank, err in enumerate(_skip_last(algorithm, board=board, async_op=async_op)):
        assert isinstance(err, (CommTimeout, RemoteError)), err
        p = err.progress
        assert isinstance(p, OpProgress), err
        schedule = COLLECTIVES["allreduce"].schedule(
            rank, 3, 8, 1 << 20, algorithm=algorithm or "board", hosts=((0, 1, 2),),
            piece=1 << 20)
        assert (p.engine, p.algorithm) == ("board" if board else "links",
                                           f"{schedule.algorithm} allreduce")
        assert p.steps == len(schedule.steps) and 0 <= p.step < p.steps, p
        step = schedule.steps[p.step]
        assert p.doing == " ".join(step.describe().split()), p
        assert step.kind in (Kind.RECV, Kind.RECV_REDUCE, Kind.RECV_REDUCE_SEND, Kind.TAKE,
                             Kind.TAKE_REDUCE), p
        assert p.peer == step.peer, p
        before = schedule.steps[:p.step]  # run in order: an allreduce has no receive runs
        sends = [s for s in before if s.kind in (Kind.SEND, Kind.RECV_REDUCE_SEND, Kind.POST)]
        recvs = [s for s in before if s.kind not in (Kind.SEND, Kind.POST, Kind.COPY)]
        assert (p.sent, p.sent_bytes) == (len(sends), 4 * sum(s.src.count for s in sends)), p
        assert (p.received, p.received_bytes) == (len(recvs),
                                                  4 * sum(s.dst.count for s in recvs)), p
        # the rank's own report: no store in a group of threads, so its own line only
        assert err.report is not None and not err.report.gathered, err
        text = err.report.text
        assert f"rank {rank}: allreduce #0 " in text and f"step {p.step} of {p.steps}" in text
        assert f"waiting for rank {p.peer}" in text, text


def test_the_rank_that_timed_out_waits_for_the_rank_that_skipped():
    """Ring over links: rank 0 waits for rank 2 (its left neighbour), rank 1 for rank 0."""
    peers = [err.progress.peer for err in _skip_last("ring")]
    assert peers == [2, 0], peers


def test_a_receive_that_times_out_says_whom_it_waited_for():
    def fn(comm: Any) -> Any:
        if comm.rank == 1:
            return "never sends"
        try:
            comm.recv(np.empty(4, np.float32), src=1, tag=7)
        except CommTimeout as err:
            return err
        return "no error"

    err = run_group(2, fn, timeout=0.3, return_errors=True)[0]
    assert isinstance(err, CommTimeout), err
    p = err.progress
    assert (p.engine, p.peer, p.step, p.received) == ("p2p", 1, 0, 0), p
    assert p.doing == "waiting for a message from rank 1 (tag 7)", p
    assert "recv from rank 1 timed out" in err.report.text, err.report.text


def test_only_timeouts_leave_a_report():
    def fn(comm: Any) -> Any:
        try:  # ranks disagree about the size: a DesyncError, not a hang
            comm.allreduce(np.ones(4 + comm.rank, np.float32), algorithm="ring")
        except Exception as err:  # noqa: BLE001 - returned to the test
            return err
        return "no error"

    for err in run_group(2, fn, timeout=5.0, return_errors=True):
        assert not timed_out(err) and err.report is None, err


def test_a_state_that_cannot_be_told_never_replaces_the_error():
    """The builders run while an op's error is on its way out: a failure of their own gives
    no state rather than an exception (here, counts for no peer at all)."""
    schedule = COLLECTIVES["allreduce"].schedule(0, 3, 8, 1 << 20, algorithm="ring")
    assert over_links(schedule, 1, 2, [], [], 4, receiving=True) is None
    assert in_order("board", schedule, "not a step", 2, 4) is None  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the analysis

def state(rank: int, op: str, peer: int | None, step: int = 1) -> RankState:
    """A rank's state as it would arrive: waiting in ``op`` at ``step`` for ``peer``."""
    match = re.match(r"^(\w+) #(\d+)$", op)
    progress = OpProgress("links", "ring allreduce", step, 4, "recv", peer)
    return RankState(rank, op, int(match.group(2)) if match else None, "timed out", progress,
                     "host", 100 + rank)


def test_a_rank_with_no_report_at_the_end_of_the_waits_is_behind():
    states = {0: state(0, "allreduce #5", 3), 1: state(1, "allreduce #5", 0),
              2: state(2, "allreduce #5", 1)}
    behind, findings = analyze(states, 4)
    assert behind == (3,), findings
    assert findings[0] == (f"rank 3 is behind ({NO_REPORT}); ranks 0, 1, 2 wait for it "
                           "(1 through rank 0, 2 through rank 1)"), findings


def test_a_rank_in_an_earlier_or_another_op_is_behind():
    states = {0: state(0, "allreduce #5", 2), 1: state(1, "allreduce #5", 2),
              2: state(2, "broadcast #4", 0)}
    behind, findings = analyze(states, 3)
    assert behind == (2,), findings
    assert findings[0].startswith("rank 2 is behind (in broadcast #4 at step 1 of 4"), findings
    assert "while ranks 0, 1 are in allreduce #5); ranks 0, 1 wait for it" in findings[0]
    states[2] = state(2, "recv from rank 0", 0)  # a point-to-point op instead
    assert analyze(states, 3)[0] == (2,)
    ahead = {0: state(0, "allreduce #6", None), 1: state(1, "allreduce #5", 0),
             2: state(2, "allreduce #5", 1)}  # rank 0 went on to the next op
    behind, findings = analyze(ahead, 3)
    assert behind == (0,) and "while ranks 1, 2 are in allreduce #5" in findings[0], findings


def test_a_tie_between_two_ops_names_the_ranks_of_the_earlier_one_behind():
    """Two ranks went on to allreduce #6 and wait there for rank 2; two are still in
    allreduce #5: as many ranks in each, so the furthest op is the one most are in, and the
    ranks of the earlier one are behind (never the ranks ahead)."""
    states = {0: state(0, "allreduce #6", 2), 1: state(1, "allreduce #6", 0),
              2: state(2, "allreduce #5", 3), 3: state(3, "allreduce #5", 2)}
    behind, findings = analyze(states, 4)
    assert behind == (2, 3), findings
    assert findings[0].startswith("rank 2 is behind (in allreduce #5"), findings
    assert "while ranks 0, 1 are in allreduce #6" in findings[0], findings


def test_waits_in_a_cycle_and_ops_the_ranks_disagree_about_are_named():
    cycle = {0: state(0, "allreduce #5", 2), 1: state(1, "allreduce #5", 0),
             2: state(2, "allreduce #5", 1)}
    behind, findings = analyze(cycle, 3)
    assert behind == () and len(findings) == 1, findings
    assert findings[0].startswith("ranks 0, 1, 2 wait for each other in a cycle "
                                  "(0 -> 2 -> 1 -> 0) in allreduce #5"), findings
    split = {0: state(0, "allreduce #5", 1), 1: state(1, "allreduce #5", 2),
             2: state(2, "barrier #5", None)}
    behind, findings = analyze(split, 3)
    assert behind == (2,), findings
    assert "the ranks disagree about op #5: allreduce on ranks 0, 1; barrier on rank 2" \
        in findings, findings


def test_a_rank_that_others_wait_for_while_it_waits_for_nobody_is_behind():
    """It came to the op late (the others had given up), or was busy with a send."""
    states = {0: state(0, "allreduce #1", None, step=0), 1: state(1, "allreduce #1", 0),
              2: state(2, "allreduce #1", 1)}
    behind, findings = analyze(states, 3)
    assert behind == (0,), findings
    assert findings == ("rank 0 is behind (in allreduce #1 at step 0 of 4 (ring allreduce, "
                        "links engine), waiting for nobody: it came to this op late, or was "
                        "busy); ranks 1, 2 wait for it (2 through rank 1)",), findings


def test_ranks_nobody_waits_for_are_only_listed():
    behind, findings = analyze({0: state(0, "allreduce #2", None)}, 3)
    assert behind == () and findings == ("ranks 1, 2 sent no report, and no rank that "
                                         "reported waited for them",), findings


def test_a_state_survives_the_store():
    mine = state(1, "allreduce #5", 0)
    assert RankState.from_json(mine.to_json()) == mine
    with pytest.raises(ValueError, match="not a hang report record"):
        RankState.from_json(b'{"rank": 1}')


# --------------------------------------------------------------------------- real processes

def run_ranks(tmp_path: Path, scenario: str, algorithm: str = "auto", timeout: float = 1.0,
              world: int = 3, port: int | None = None,
              between: Any = None) -> list[tuple[dict, str]]:
    """``hang_rank.py SCENARIO`` on ``world`` processes; each rank's JSON line and stderr.
    ``between(sync)`` runs while they do (the store-gone scenario stops the store there)."""
    port = port or free_port()
    sync = tmp_path / "sync"
    sync.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "hang_rank.py"), scenario, str(r), str(world), str(port),
         str(timeout), str(sync), algorithm], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env) for r in range(world)]
    try:
        if between is not None:
            between(sync)
        outs = [p.communicate(timeout=45) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{out}\n{err[-3000:]}"
        line = [ln for ln in out.splitlines() if ln.startswith("{")]
        assert line, f"rank {r} printed no result:\n{out}\n{err[-3000:]}"
        results.append((json.loads(line[-1]), err))
    return results


def check_waiting_rank(rank: int, res: dict, log: str, timeout: float) -> None:
    """A rank that waited: it failed as a hang should, in time, and logged (and attached)
    its op, its step and the peer it waited for."""
    assert res["error"] in ("CommTimeout", "RemoteError"), res
    assert res["elapsed"] <= timeout + BOUND, res
    p = res["progress"]
    assert p is not None and p["peer"] is not None, res
    mine = [ln for ln in log.splitlines() if ln.startswith(f"ERROR ringcomm: rank {rank}: ")]
    assert len(mine) == 1, log
    assert re.search(rf"allreduce #\d+ (timed out|stopped: .*) at step {p['step']} of "
                     rf"{p['steps']} .* waiting for rank {p['peer']} ", mine[0]), mine[0]
    report = res["report"]
    assert report is not None, res
    if report["gathered"]:  # rank 0: its row of the summary
        assert re.search(rf"  rank {rank}: allreduce #\d+ .* at step {p['step']} of "
                         rf"{p['steps']} \(.*\), waiting for rank {p['peer']}; done: ",
                         report["text"]), report["text"]
    else:
        assert report["text"] == mine[0].split(": ", 1)[1], report


@pytest.mark.parametrize("algorithm", ["auto", pytest.param("ring", marks=pytest.mark.slow)])
def test_rank_0_names_the_rank_that_never_called_the_op(tmp_path, algorithm):
    """The last rank never calls the allreduce (on the board, as one host's ranks run it;
    and over links): ranks 0 and 1 time out, each logs where it stood, and rank 0's summary
    names rank 2 as behind, with no report, within timeout + 2 s."""
    timeout = 1.0
    results = run_ranks(tmp_path, "skip", algorithm, timeout)
    for rank in (0, 1):
        check_waiting_rank(rank, *results[rank], timeout)
    report = results[0][0]["report"]
    assert report["gathered"] and report["behind"] == [2], report
    assert report["states"] == [0, 1] and report["missing"] == [2], report
    assert report["findings"][0].startswith(f"rank 2 is behind ({NO_REPORT}); ranks 0, 1 "
                                            "wait for it"), report
    summary = results[0][1]
    assert "ERROR ringcomm: ringcomm hang report, gathered by rank 0: 2 of 3 ranks" in summary
    assert report["text"] in summary
    assert results[2][0] == {"rank": 2}  # it never called the op: nothing to report
    if algorithm == "ring":  # rank 1 waits for rank 0, which waits for rank 2
        assert [results[r][0]["progress"]["peer"] for r in (0, 1)] == [2, 0]
        assert "(1 through rank 0)" in report["findings"][0], report


def test_a_rank_waiting_in_another_op_is_named_behind(tmp_path):
    """The last rank waits in a receive from rank 0 while the others run a ring allreduce:
    every rank times out or is aborted, all three report, and rank 0's summary names rank 2
    as the one in another op, which ranks 0 and 1 wait for."""
    timeout = 1.0
    results = run_ranks(tmp_path, "other-op", "ring", timeout)
    for rank in (0, 1):
        check_waiting_rank(rank, *results[rank], timeout)
    last, log = results[2]
    assert last["error"] in ("CommTimeout", "RemoteError") and last["progress"]["peer"] == 0
    assert last["elapsed"] <= timeout + BOUND, last
    assert re.search(r"ERROR ringcomm: rank 2: recv (#0 )?from rank 0 (timed out|stopped: .*) at "
                     r"step 0 of 1 .* waiting for rank 0 ", log), log
    report = results[0][0]["report"]
    assert report["behind"] == [2] and report["states"] == [0, 1, 2], report
    assert re.match(r"rank 2 is behind \(in recv (#0 )?from rank 0 at step 0 of 1 .*, while ranks "
                    r"0, 1 are in allreduce #\d+\); ranks 0, 1 wait for it", report["findings"][0])


@pytest.mark.slow  # about 3 s
def test_a_rank_that_comes_late_reports_its_own_state(tmp_path):
    """The last rank calls the allreduce after the others gave up: it is told at once (the
    abort was waiting for it) and logs where it stood."""
    timeout = 1.0
    results = run_ranks(tmp_path, "late", "ring", timeout)
    report = results[0][0]["report"]
    assert report["behind"] == [2], report
    last, log = results[2]
    assert last["error"] == "RemoteError" and last["report"]["states"] == [2], last
    p = last["progress"]  # the steps before its step went; the failed one did not
    before = COLLECTIVES["allreduce"].schedule(2, 3, 8, 1 << 20, algorithm="ring").steps[
        :p["step"]]
    assert p["sent"] == sum(s.kind in (Kind.SEND, Kind.RECV_REDUCE_SEND) for s in before), p
    assert p["received"] == sum(s.kind is not Kind.SEND for s in before), p
    assert re.search(r"ERROR ringcomm: rank 2: allreduce #\d+ stopped: rank \d timed out and "
                     r"aborted the group at step 0 of \d+", log), log


@pytest.mark.slow  # three processes that import torch: about 6 s
def test_the_report_comes_through_torch_distributed(tmp_path):
    timeout = 2.0  # it bounds the rendezvous too, on a busy machine
    results = run_ranks(tmp_path, "torch", timeout=timeout)
    for rank in (0, 1):
        check_waiting_rank(rank, *results[rank], timeout)
    report = results[0][0]["report"]
    assert report["gathered"] and report["behind"] == [2], report
    assert "ringcomm hang report, gathered by rank 0" in results[0][1]


@pytest.mark.slow  # about 5 s
def test_a_store_that_is_gone_changes_neither_the_error_nor_its_time(tmp_path):
    """The store goes away after init; then the last rank skips an op: the others still
    raise the timeout (not a store error), within the bound (a store request alone may wait
    for the whole timeout), each with its own state, and rank 0 says that the store failed."""
    from ringcomm.bootstrap.store import StoreServer

    timeout = 2.5  # a store request waits as long: longer than the bound's 2 s
    port = free_port()
    server = StoreServer("127.0.0.1", port)

    def stop_the_store(sync: Path) -> None:
        end = time.monotonic() + 30
        while not all((sync / f"ready-{r}").exists() for r in range(3)):
            assert time.monotonic() < end, "the ranks did not get ready"
            time.sleep(0.02)
        server.close()
        (sync / "store-gone").touch()

    try:
        results = run_ranks(tmp_path, "store-gone", "auto", timeout, port=port,
                            between=stop_the_store)
    finally:
        server.close()
    for rank in (0, 1):
        check_waiting_rank(rank, *results[rank], timeout)
    report = results[0][0]["report"]
    assert report["states"] == [0] and "store" in report["text"], report
