"""Giving up releases everything: after ``Communicator.abort`` (or torch's abort and
``destroy_process_group`` of a failed group) a rank holds no thread, socket, descriptor,
mapping or file of ringcomm's, and a new group in the same process works.

The ranks are real processes (``tests/abort_rank.py``), each checking what it holds
through /proc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from mp_helpers import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
RELEASED = {"threads": [], "zmq_threads": [], "ringcomm_fds": [], "maps": [], "files": []}


def run_ranks(scenario: str, world: int, timeout: float) -> list[tuple[int, dict | None, str]]:
    """``world`` processes of ``abort_rank.py SCENARIO``: each one's exit status, JSON
    report and stderr; all are killed if one outlives ``timeout``."""
    ports = [str(free_port()), str(free_port())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_")}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "abort_rank.py"), scenario,
                               str(r), str(world), *ports], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
            out.append((p.returncode, lines[0] if lines else None, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def released(held: dict) -> dict:
    return {key: held[key] for key in RELEASED}


@pytest.mark.timeout(60)
def test_abort_ends_the_op_in_flight_tells_the_peers_and_releases_everything():
    results = run_ranks("abort", 3, 45)
    reports = []
    for r, (code, rep, err) in enumerate(results):
        assert code == 0 and rep is not None, f"rank {r} ({code}):\n{err}"
        reports.append(rep)
    assert all(rep["board"] for rep in reports), reports  # the waits were on the board
    aborted, waiting, late = (rep["err"] for rep in reports)
    assert aborted["type"] == "CommAborted" and "given up on purpose" in aborted["msg"], aborted
    assert reports[0]["abort_s"] < 1.0, reports[0]
    # rank 1 waited in the allreduce: it hears from rank 0 at once, not at its 20 s timeout
    assert waiting["type"] == "RemoteError" and "rank 0 failed" in waiting["msg"], waiting
    assert "given up on purpose" in waiting["msg"] and waiting["s"] < 2.0, waiting
    # rank 2 joins late: the others' posts are on the board, so its allreduce may still
    # complete with the right sum; its next op fails at once
    if late is not None:
        assert late["type"] in ("RemoteError", "PeerLostError") and late["s"] < 2.0, late
    else:
        assert reports[2]["sum"] == 3 * 3, reports[2]  # 1 + 1 + 1, twice (the warm-up)
        assert reports[2]["after"]["type"] == "RemoteError", reports[2]
        assert "given up on purpose" in reports[2]["after"]["msg"], reports[2]
    for r, rep in enumerate(reports):
        if r < 2 or late is not None:
            assert rep["after"]["type"] == "CommAborted", (r, rep["after"])
        for when in ("held_after_abort", "held_at_end"):
            assert released(rep[when]) == RELEASED, (r, when, rep[when])
            # and nothing else either: every descriptor and OS thread of the group is gone
            assert rep[when]["fds"] == rep["held_before"]["fds"], (r, when, rep)
            assert rep[when]["os_threads"] == rep["held_before"]["os_threads"], (r, when, rep)
        assert rep["second"] == 0 + 1 + 2, rep  # the new group works


@pytest.mark.timeout(60)
def test_an_abort_between_ops_tells_the_peers_waiting_in_their_next_op():
    results = run_ranks("idle", 3, 45)
    for r, (code, rep, err) in enumerate(results):
        assert code == 0 and rep is not None, f"rank {r} ({code}):\n{err}"
        assert rep["board"], rep
        if r:
            got = rep["err"]
            assert got is not None and got["type"] == "RemoteError", (r, got)
            assert "given up between ops" in got["msg"] and got["s"] < 2.0, (r, got)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torch_abort_and_destroy_of_a_failed_group_release_everything():
    """Rank 2 is SIGKILLed mid-run; rank 0 gives up with ``_abort_process_group``, rank 1
    with ``destroy_process_group``; both then hold nothing of ringcomm's and form a new
    group of two in the same process."""
    results = run_ranks("torch", 3, 100)
    code, _, err = results[2]
    assert code == -9, (code, err)
    for r in (0, 1):
        code, rep, err = results[r]
        assert code == 0 and rep is not None, f"rank {r} ({code}):\n{err}"
        assert rep["err"] is not None and rep["err"]["s"] < 5.0, rep
        assert rep["err"]["type"] in ("PeerLostError", "RemoteError"), rep["err"]
        assert rep["release_s"] < 3.0, rep
        assert released(rep["held_after_abort"]) == RELEASED, (r, rep["held_after_abort"])
        assert released(rep["held_at_end"]) == RELEASED, (r, rep["held_at_end"])
        assert rep["second"] == 1 + 2, rep
