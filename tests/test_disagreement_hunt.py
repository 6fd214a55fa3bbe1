"""The disagreement hunt (``tests/hunt.py``): ranks that differ in exactly one respect of an
op never get a wrong result, always get a typed error, and never hang; ranks that agree get
right and (for reductions) bitwise identical results.

In one process over in-memory channels (hundreds of cases, seconds), on links only and with
the shared board: the default suite runs the first half of each set of cases (every kind of
disagreement among them), the slow suite the second. Over real processes (tens of cases, ipc
and tcp) in the slow suite. Reproducible: a
failure prints the seed and the case; ``RINGCOMM_HUNT_SEED`` replays a seed,
``RINGCOMM_HUNT_CASES`` runs more cases.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import hunt
import pytest

from ringcomm.runtime.local import run_group

SEED = int(os.environ.get("RINGCOMM_HUNT_SEED", "20261123"))
IN_MEMORY_CASES = int(os.environ.get("RINGCOMM_HUNT_CASES", "400"))
TIMEOUT = 2.0  # s per op: an in-memory rank that waits for a message nobody sends times out
MARGIN = 4.0  # s: generous, many groups share the interpreter; far below a hang

# The engines an in-memory group runs its ops on: links only (every collective and forced
# algorithm alike), or the shared board as well, which takes allreduces left to the
# automatic choice (one-shot, or two-shot in posts of up to 1 MiB), small broadcasts and
# all-gathers, and every case's closing barrier. The board's hunt draws those more often,
# so that its fewer cases still bring disagreements in dtype and reduce op to the board,
# half of those in dtype between dtypes of one size (float32 and int32, say), which only
# the header tells apart.
ENGINES = {
    "links": (False, IN_MEMORY_CASES, {}),
    "board": (True, IN_MEMORY_CASES * 3 // 10, dict(
        auto=0.6, max_bytes=2 << 20, same_size=0.5,
        collectives=(*hunt.COLLECTIVES, "allreduce", "allreduce", "broadcast", "allgather"))),
}


def _in_memory(case: hunt.Case, board: bool) -> list[str]:
    def rank_main(comm):
        call = case.calls[comm.rank]
        comm.segment_bytes = call.segment  # a setting the ranks failed to agree on
        return hunt.play(comm, call)

    reports = run_group(case.world, rank_main, timeout=TIMEOUT, return_errors=True,
                        board=board)
    problems = [f"rank {r}: {rep!r}" for r, rep in enumerate(reports)
                if not isinstance(rep, dict)]  # an error outside the ops: a bug
    return problems or hunt.judge(case, reports, timeout=TIMEOUT, margin=MARGIN)


def _on_the_board(case: hunt.Case, field: str, *, one_size: bool = False) -> bool:
    """Whether ``case`` is a disagreement in ``field`` about an allreduce left to the
    automatic choice (which a group with a board runs there); ``one_size``: between dtypes
    of one size."""
    return case.field == field and any(
        c.collective == "allreduce" and c.algorithm is None for c in case.calls) and (
        not one_size or len({hunt.data(0, 1, c.dtype).itemsize for c in case.calls}) == 1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("half", [0, pytest.param(1, marks=pytest.mark.slow)],
                         ids=["first-half", "second-half"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_hunt_over_in_memory_ranks_finds_no_silent_wrong_result(engine, half):
    board, n, how = ENGINES[engine]
    all_cases = hunt.cases(SEED, n, worlds=(2, 3, 4, 5, 6), **how)
    all_cases = all_cases[n // 2:] if half else all_cases[:n // 2]
    if not half:  # every kind is hunted in the default suite's half
        assert {c.field for c in all_cases} == {None, *hunt.FIELDS}
        if board:
            assert any(_on_the_board(c, "op") for c in all_cases)
            assert any(_on_the_board(c, "dtype", one_size=True) for c in all_cases)
    with ThreadPoolExecutor(max_workers=8) as pool:
        verdicts = list(pool.map(_in_memory, all_cases, [board] * len(all_cases)))
    failed = [f"{case.describe()}\n    " + "\n    ".join(problems)
              for case, problems in zip(all_cases, verdicts, strict=True) if problems]
    assert not failed, f"{len(failed)} of {len(all_cases)} cases failed:\n" + "\n".join(
        failed[:10])


def test_the_hunt_tells_a_wrong_result_from_a_right_one():
    """The judge itself: a control in which one rank returned a wrong value, and a
    disagreement in which a rank returned without an error, are both reported."""
    call = hunt.Call("allreduce", 4, "float32")
    case = hunt.Case(0, 0, 2, None, (call, call))

    def report(output):
        want = hunt.expected(call, 0, 2)
        return {"returned": True, "right": output.tobytes() == want.tobytes(),
                "digest": output.tobytes(), "error": None, "in": None, "elapsed": 0.0}

    right = hunt.expected(call, 0, 2)
    assert hunt.judge(case, [report(right), report(right)], timeout=1, margin=1) == []
    assert hunt.judge(case, [report(right), report(right + 1)], timeout=1, margin=1) == [
        "rank 1: returned a wrong output from allreduce(4 x float32, sum, seg 2097152)",
        "the reduced results differ between ranks"]
    odd = hunt.Case(0, 0, 2, "count", (call, hunt.Call("allreduce", 5, "float32")))
    assert hunt.judge(odd, [report(right), report(right)], timeout=1, margin=1) == [
        "rank 0: no error although the ranks disagree in count",
        "rank 1: no error although the ranks disagree in count"]


PROCESS_TIMEOUT = 3.0  # s per op; stalls are found by probing after about a second


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport,world,n", [("ipc", 3, 24), ("tcp", 3, 12), ("ipc", 4, 12),
                                               ("tcp", 2, 8)])
def test_the_hunt_over_real_processes_finds_no_silent_wrong_result(cluster, transport, world,
                                                                   n):
    seed = SEED + world * 10 + (transport == "tcp")
    # every rank process started (torch imported) before the cases' 3 s inits begin
    cluster.run(world, "fault_jobs.job_ready", timeout=60)
    reports = cluster.run(world, "job_hunt", transport=transport, seed=seed, n=n,
                          op_timeout=PROCESS_TIMEOUT, timeout=180)
    all_cases = hunt.cases(seed, n, worlds=(world,))
    failed = []
    for i, case in enumerate(all_cases):
        problems = hunt.judge(case, [reports[r][i] for r in range(world)],
                              timeout=PROCESS_TIMEOUT, margin=3.0)
        if problems:
            failed.append(f"{case.describe()}\n    " + "\n    ".join(problems))
    assert not failed, f"{len(failed)} of {n} cases failed:\n" + "\n".join(failed)
