"""The table of collectives (``ringcomm.plan.collectives``): its references give known
answers, every collective the communicator runs matches its reference, and the
communicator, ``ringcomm schedule`` and the table agree on names, schedules and sizes.

Calls are made through ``what_runs.CALLS`` (one per collective), with buffers built from the
table's roles and sizes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from what_runs import CALLS, contribution

from ringcomm import cli
from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.plan.select import SMALL_BROADCAST_BYTES, Group, Selector
from ringcomm.plan.settings import Settings
from ringcomm.plan.topology import Topology
from ringcomm.runtime.communicator import Communicator
from ringcomm.runtime.local import run_group
from ringcomm.schedules import HOST_AWARE
from ringcomm.transport.header import ALGORITHM_CODES, OpKind

pytestmark = pytest.mark.timeout(60)

# the communicator's public methods that are not collectives
NOT_COLLECTIVES = {"send", "recv", "split", "close", "adopt", "allreduce_algorithm",
                   "allreduce_now", "allreduce_now_on",  # allreduce's short way
                   "choose", "describe", "wrapped", "tracing", "keep_timeline",
                   "start_faults", "abort", "register"}


def test_the_table_and_the_communicator_name_the_same_collectives():
    public = {name for name, value in vars(Communicator).items()
              if not name.startswith("_") and callable(value)}
    assert public - NOT_COLLECTIVES == set(COLLECTIVES)
    assert set(CALLS) == set(COLLECTIVES)
    wire = {kind for kind in OpKind
            if kind not in (OpKind.P2P, OpKind.PROBE, OpKind.ABORT, OpKind.CREDIT)}
    assert {spec.kind for spec in COLLECTIVES.values()} == wire
    for name, spec in COLLECTIVES.items():
        assert spec.name == name == spec.kind.name.lower()


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_every_collective_gives_its_reference_result(name, world, dtype):
    """Each collective through a real in-process group, every rank's result compared with
    the table's reference; the ops the trace shows are the table's collective."""
    spec = COLLECTIVES[name]
    ops = ["sum", "max", "prod"] if spec.reduces else ["sum"]
    roots = sorted({0, world - 1}) if spec.rooted else [0]
    blocks = [0, 1, 3, 7, 64] if name != "barrier" else [0]
    calls = list(itertools.product(blocks, ops, roots))

    def buffers(rank: int, block: int, root: int) -> dict[str, np.ndarray]:
        made = {}
        for role, size in spec.sizes(block, world, rank=rank, root=root).items():
            made[role] = contribution(rank, size, dtype) if role == spec.source \
                else np.full(size, 99, dtype)
        return made

    def fn(comm):
        results = []
        for block, op, root in calls:
            mine = buffers(comm.rank, block, root)
            CALLS[name](comm, mine, op, root)
            results.append(mine.get(spec.result))
        return results

    trace = []
    results = run_group(world, fn, segment_bytes=16, trace=trace)
    for i, (block, op, root) in enumerate(calls):
        inputs = [buffers(r, block, root).get(spec.source) for r in range(world)]
        for rank, want in enumerate(spec.reference(inputs, op, root)):
            got = results[rank][i]
            assert (got is None) == (want is None), (block, op, root, rank)
            if want is not None:
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), \
                    (block, op, root, rank, got, want)
    assert {e.op.split(" #")[0] for e in trace} <= {name}
    if world > 1 and name != "barrier":
        assert trace, "nothing ran"


# (collective, op, root, every rank's input, every rank's result): worked by hand
KNOWN = [
    ("allreduce", "sum", 0, [[1, 2], [10, 20]], [[11, 22], [11, 22]]),
    ("allreduce", "avg", 0, [[1.0, 2.0], [3.0, 7.0]], [[2.0, 4.5], [2.0, 4.5]]),
    ("allreduce", "bxor", 0, [[5, 3], [1, 3], [4, 0]], [[0, 0]] * 3),
    ("reduce_scatter", "max", 0, [[1, 9, 3, 4], [5, 6, 7, 2]], [[5, 9], [7, 4]]),
    ("allgather", "sum", 0, [[1], [2], [3]], [[1, 2, 3]] * 3),
    ("broadcast", "sum", 1, [[1, 2], [3, 4]], [[3, 4], [3, 4]]),
    ("reduce", "min", 1, [[1, 5], [3, 4]], [[1, 5], [1, 4]]),
    ("gather", "sum", 0, [[1], [2]], [[1, 2], None]),
    ("scatter", "sum", 1, [None, [7, 8]], [[7], [8]]),
    ("alltoall", "sum", 0, [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
     [[1, 4, 7], [2, 5, 8], [3, 6, 9]]),
    ("barrier", "sum", 0, [[], []], [[], []]),
]


@pytest.mark.parametrize("name,op,root,inputs,outputs", KNOWN)
def test_the_references_give_known_answers(name, op, root, inputs, outputs):
    dtype = np.float64 if op == "avg" else np.int64
    got = COLLECTIVES[name].reference(
        [None if x is None else np.array(x, dtype) for x in inputs], op, root)
    assert [None if x is None else x.tolist() for x in got] == outputs


def test_every_collective_has_a_known_answer():
    assert {k[0] for k in KNOWN} == set(COLLECTIVES)


def test_sizes_follow_nccl_tests_counts():
    """``count`` is the larger buffer's elements; the block is what every pair agrees on."""
    table = COLLECTIVES
    assert [table[c].block(10, 4) for c in table] == [10, 2, 2, 10, 10, 2, 2, 2, 10]
    assert table["allreduce"].sizes(10, 4) == {"data": 10}
    assert table["allgather"].sizes(2, 4) == {"input": 2, "output": 8}
    assert table["reduce_scatter"].sizes(2, 4) == {"input": 8, "output": 2}
    assert table["alltoall"].sizes(2, 4) == {"input": 8, "output": 8}
    assert table["gather"].sizes(2, 4, rank=1, root=1) == {"input": 2, "output": 8}
    assert table["gather"].sizes(2, 4, rank=0, root=1) == {"input": 2}
    assert table["scatter"].sizes(2, 4, rank=0, root=1) == {"output": 2}
    assert [c for c in table if table[c].blocked] == [
        "reduce_scatter", "allgather", "gather", "scatter", "alltoall"]


def test_busbw_factors_are_nccl_tests_ones():
    factors = {name: spec.busbw_factor(4) for name, spec in COLLECTIVES.items()}
    assert factors == {"allreduce": 1.5, "reduce_scatter": 0.75, "allgather": 0.75,
                       "broadcast": 1.0, "reduce": 1.0, "gather": 0.75, "scatter": 0.75,
                       "alltoall": 0.75, "barrier": 0.0}
    assert COLLECTIVES["allreduce"].busbw_factor(1) == 0.0


def test_every_algorithm_builds_a_schedule_of_its_own_names():
    """The schedule names the collective and the algorithm the table files it under, and
    the wire has a code for that algorithm."""
    for spec in COLLECTIVES.values():
        for algorithm in spec.algorithms:
            schedule = spec.schedule(1, 3, 5, 2, root=2, algorithm=algorithm)
            assert (schedule.collective, schedule.algorithm) == (spec.name, algorithm)
            assert algorithm in ALGORITHM_CODES


def test_broadcast_is_chosen_by_size_and_allreduce_needs_a_choice():
    selector = Selector(Group(3, False, Settings(), Topology.single_host(3), 1 << 20))
    small = selector.choose("broadcast", SMALL_BROADCAST_BYTES)
    large = selector.choose("broadcast", SMALL_BROADCAST_BYTES + 1)
    assert (small.engine, small.algorithm, large.algorithm) == ("links", "binomial", "chain")
    assert COLLECTIVES["broadcast"].schedule(0, 3, 100, 8).algorithm == "chain"  # main one
    assert COLLECTIVES["gather"].schedule(0, 3, 4, 2).algorithm == "direct"
    with pytest.raises(ValueError, match="pass algorithm="):
        COLLECTIVES["allreduce"].schedule(0, 2, 4, 2)
    with pytest.raises(ValueError, match="reduce has no algorithm 'ring'; it has chain"):
        COLLECTIVES["reduce"].schedule(0, 2, 4, 2, algorithm="ring")


def test_the_communicator_runs_the_broadcast_the_table_chooses():
    sizes = [SMALL_BROADCAST_BYTES // 8, SMALL_BROADCAST_BYTES // 8 + 1]  # float64 elements

    def fn(comm):
        for size in sizes:
            comm.broadcast(np.full(size, float(comm.rank)), root=1)

    trace = []
    run_group(3, fn, trace=trace)
    ran = {e.op: e.algorithm for e in trace}
    assert ran == {"broadcast #0": "binomial", "broadcast #1": "chain"}


def test_ringcomm_schedule_lists_every_flat_algorithm_of_the_table(capsys):
    assert list(cli._SCHEDULES) == [
        "allreduce", "allreduce_tree", "allreduce_dbtree", "allreduce_hd", "allreduce_rd",
        "allreduce_board", "allreduce_twoshot", "reduce_scatter", "allgather", "allgather_board",
        "broadcast",
        "broadcast_binomial", "broadcast_board", "reduce", "gather", "scatter", "alltoall",
        "barrier", "barrier_board"]
    listed = sum(len([a for a in spec.algorithms if a not in HOST_AWARE])
                 for spec in COLLECTIVES.values())
    assert len(cli._SCHEDULES) == listed
    cli.main(["schedule", "broadcast_binomial", "-n", "3", "-c", "4", "--rank", "1", "--root", "2"])
    assert capsys.readouterr().out.startswith("broadcast (binomial), rank 1 of 3")
    cli.main(["schedule", "allreduce", "-n", "3", "-c", "6", "-s", "1", "--rank", "0"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[:3] == [  # as docs/architecture.md shows it
        "allreduce (ring), rank 0 of 3, 14 steps",
        "     0  send data[0:1] -> rank 1   (reduce-scatter round 0, chunk 0 seg 0)",
        "     1  recv from rank 2, data[2:3] (op) msg -> rank 1   (reduce-scatter round 0, "
        "chunk 2 seg 0, fused)"]
