"""Every collective, every world size from 1 to 16, odd counts: one process, in-memory channels.

Results are compared with the numpy references of the table of collectives; integer-valued
data keeps float sums exact, so the comparisons are exact too.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm import ArgumentError, CommTimeout, DesyncError, RemoteError
from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.runtime.local import run_group
from ringcomm.schedules import ALLREDUCE, Kind, direct, ring

pytestmark = pytest.mark.timeout(120)

WORLDS = list(range(1, 17))
SEG = 24  # bytes: tiny segments so that every schedule pipelines many of them


def data(rank: int, count: int, dtype=np.float64) -> np.ndarray:
    return ((np.arange(count) * 7 + rank * 13) % 23 - 11).astype(dtype)


counts = st.sampled_from([0, 1, 2, 3, 5, 7, 16, 17, 31, 64, 100])


def reference(collective, inputs, op="sum", root=0):
    return COLLECTIVES[collective].reference(inputs, op, root)


def _allreduce_sum_matches(world: int, count: int, algorithm: str) -> None:
    def fn(comm):
        x = data(comm.rank, count)
        comm.allreduce(x, "sum", algorithm=algorithm)
        return x

    results = run_group(world, fn, segment_bytes=SEG)
    expected = reference("allreduce", [data(r, count) for r in range(world)])
    for res, want in zip(results, expected, strict=True):
        assert res.tobytes() == want.tobytes()


ALLREDUCE_CASES = dict(world=st.sampled_from(WORLDS), count=counts,
                       algorithm=st.sampled_from(list(ALLREDUCE)))


# 40 examples a default run (each run draws its own); the slow suite draws 400
@settings(max_examples=40, deadline=None)
@given(**ALLREDUCE_CASES)
def test_allreduce_sum_matches_numpy_and_is_identical_on_every_rank(world, count, algorithm):
    _allreduce_sum_matches(world, count, algorithm)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(**ALLREDUCE_CASES)
def test_allreduce_sum_matches_numpy_on_many_more_draws(world, count, algorithm):
    _allreduce_sum_matches(world, count, algorithm)


@pytest.mark.parametrize("op", ["max", "min", "prod", "band", "bor", "bxor"])
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("algorithm", list(ALLREDUCE))
def test_allreduce_ops_on_ints(op, world, algorithm):
    count = 37

    def fn(comm):
        x = data(comm.rank, count, np.int64)
        comm.allreduce(x, op, algorithm=algorithm)
        return x

    expected = reference("allreduce", [data(r, count, np.int64) for r in range(world)], op)
    for res, want in zip(run_group(world, fn, segment_bytes=SEG), expected, strict=True):
        np.testing.assert_array_equal(res, want)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 7])
@pytest.mark.parametrize("algorithm", list(ALLREDUCE))
def test_allreduce_avg_divides_once(world, algorithm):
    def fn(comm):
        x = np.full(29, float(comm.rank + 1))
        comm.allreduce(x, "avg", algorithm=algorithm)
        return x

    for res in run_group(world, fn, segment_bytes=SEG):
        np.testing.assert_allclose(res, (world + 1) / 2)


@settings(max_examples=30, deadline=None)
@given(world=st.sampled_from(WORLDS), count=counts)
def test_reduce_scatter_and_allgather(world, count):
    def fn(comm):
        x = data(comm.rank, count * world)
        out = np.empty(count)
        comm.reduce_scatter(out, x, "sum")
        gathered = np.empty(count * world)
        comm.allgather(gathered, out)
        return out, gathered

    blocks = reference("reduce_scatter", [data(r, count * world) for r in range(world)])
    gathered_blocks = reference("allgather", blocks)
    for rank, (out, gathered) in enumerate(run_group(world, fn, segment_bytes=SEG)):
        np.testing.assert_array_equal(out, blocks[rank])
        np.testing.assert_array_equal(gathered, gathered_blocks[rank])


@settings(max_examples=30, deadline=None)
@given(world=st.sampled_from(WORLDS), count=counts, root_pick=st.integers(0, 15),
       big=st.booleans())
def test_broadcast_and_reduce(world, count, root_pick, big):
    root = root_pick % world
    n = count * (3000 if big else 1)  # big enough to take the pipelined chain

    def fn(comm):
        x = data(comm.rank, n)
        comm.broadcast(x, root=root)
        y = data(comm.rank, n)
        comm.reduce(y, root=root, op="sum")
        return x, y

    inputs = [data(r, n) for r in range(world)]
    broadcast = reference("broadcast", inputs, root=root)
    reduced = reference("reduce", inputs, root=root)
    for rank, (x, y) in enumerate(run_group(world, fn, segment_bytes=SEG * 100)):
        np.testing.assert_array_equal(x, broadcast[rank])
        np.testing.assert_array_equal(y, reduced[rank])


@settings(max_examples=30, deadline=None)
@given(world=st.sampled_from(WORLDS), count=counts, root_pick=st.integers(0, 15))
def test_gather_and_scatter(world, count, root_pick):
    root = root_pick % world

    blocks = np.concatenate([data(100 + r, count) for r in range(world)])

    def fn(comm):
        out = np.empty(count * world) if comm.rank == root else None
        comm.gather(out, data(comm.rank, count), root=root)
        got = np.empty(count)
        comm.scatter(got, blocks if comm.rank == root else None, root=root)
        return out, got

    gathered = reference("gather", [data(r, count) for r in range(world)], root=root)
    scattered = reference("scatter", [blocks if r == root else None for r in range(world)],
                          root=root)
    for rank, (out, got) in enumerate(run_group(world, fn, segment_bytes=SEG)):
        if rank == root:
            np.testing.assert_array_equal(out, gathered[rank])
        np.testing.assert_array_equal(got, scattered[rank])


@settings(max_examples=30, deadline=None)
@given(world=st.sampled_from(WORLDS), count=counts)
def test_alltoall_even(world, count):
    def fn(comm):
        x = data(comm.rank, count * world)
        out = np.empty(count * world)
        comm.alltoall(out, x)
        return out

    expected = reference("alltoall", [data(r, count * world) for r in range(world)])
    for out, want in zip(run_group(world, fn, segment_bytes=SEG), expected, strict=True):
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_alltoall_uneven_splits(world):
    # rank s sends (s + d) % 3 elements to rank d
    def size(s, d):
        return (s + d) % 3

    def fn(comm):
        r = comm.rank
        in_splits = [size(r, d) for d in range(world)]
        out_splits = [size(s, r) for s in range(world)]
        x = np.concatenate([np.full(size(r, d), 10.0 * r + d) for d in range(world)])
        out = np.empty(sum(out_splits))
        comm.alltoall(out, x, in_splits=in_splits, out_splits=out_splits)
        return out

    for r, out in enumerate(run_group(world, fn, segment_bytes=SEG)):
        expected = np.concatenate([np.full(size(s, r), 10.0 * s + r) for s in range(world)])
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("world", WORLDS)
def test_barrier_and_p2p_ring(world):
    def fn(comm):
        comm.barrier()
        r, n = comm.rank, comm.world_size
        if n == 1:
            return None
        out = np.empty(10)
        w = comm.send(np.full(10, float(r)), dst=(r + 1) % n, async_op=True)
        comm.recv(out, src=(r - 1) % n)
        w.wait()
        comm.barrier()
        return out

    for r, out in enumerate(run_group(world, fn, segment_bytes=SEG)):
        if world > 1:
            np.testing.assert_array_equal(out, float((r - 1) % world))


def test_p2p_sent_before_a_collective_does_not_break_it():
    def fn(comm):
        if comm.rank == 0:
            comm.send(np.arange(5.0), dst=1)
        x = np.ones(8)
        comm.allreduce(x)
        got = np.empty(5)
        if comm.rank == 1:
            comm.recv(got, src=0)
        return x, got

    results = run_group(2, fn, segment_bytes=SEG)
    np.testing.assert_array_equal(results[0][0], 2.0)
    np.testing.assert_array_equal(results[1][1], np.arange(5.0))


@pytest.mark.parametrize("world", WORLDS)
def test_every_send_has_a_matching_receive(world):
    """Static check of the schedules: per ordered pair, the sequence of message sizes sent
    is the sequence the receiver expects, for every algorithm of every collective in the
    table, from several roots (channels are FIFO)."""
    count, seg = 23, 4
    for spec in COLLECTIVES.values():
        roots = sorted({0, world // 2, world - 1}) if spec.rooted else [0]
        for algorithm, root in itertools.product(spec.algorithms, roots):
            sends, recvs = message_sizes([spec.schedule(r, world, count, seg, root=root,
                                                        algorithm=algorithm)
                                          for r in range(world)])
            assert sends == recvs, (spec.name, algorithm, root)


def message_sizes(schedules):
    """Per ordered pair of ranks, the sizes of the messages sent and of those expected, in
    order: equal exactly when every send has its receive (channels are FIFO)."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, schedule in enumerate(schedules):
        for step in schedule.steps:
            if step.kind is Kind.SEND:
                sends[(r, step.peer)].append(step.src.count)
            if step.kind in (Kind.RECV, Kind.RECV_REDUCE, Kind.RECV_REDUCE_SEND):
                recvs[(step.peer, r)].append(step.dst.count)
            if step.kind is Kind.RECV_REDUCE_SEND:
                sends[(r, step.to)].append(step.src.count)
    return sends, recvs


def test_schedule_prints_step_by_step():
    text = str(ring.allreduce(1, 4, 16, 2))
    assert text.startswith("allreduce (ring), rank 1 of 4")
    assert "reduce-scatter round 0, chunk 0 seg 0" in text
    assert "send data[4:6] -> rank 2" in text
    assert "(all-gather round 5" in text


ALL_DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
              "uint8", "bool", "complex64", "complex128"]


def _np_dtype(name):
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_with_every_op_it_supports(dtype):
    from ringcomm.core.dtypes import REDUCE_OPS

    world, dt = 3, _np_dtype(dtype)
    ops = [name for name, op in REDUCE_OPS.items() if dtype in op.dtypes]
    assert "sum" in ops

    def values(rank):
        v = (np.arange(11) + rank) % 3 + 1  # small positive numbers: exact in every dtype
        return (v % 2).astype(dt) if dtype == "bool" else v.astype(dt)

    def fn(comm):
        out = {}
        for op in ops:
            x = values(comm.rank)
            comm.allreduce(x, op)
            out[op] = x
        return out

    # small positive integers: every result is exact in every dtype, but avg's, which rounds
    # to the nearest value in the dtype in the reference too
    expected = {op: reference("allreduce", [values(r) for r in range(world)], op)
                for op in ops}
    for rank, res in enumerate(run_group(world, fn, segment_bytes=SEG)):
        for op in ops:
            assert res[op].dtype == dt
            assert res[op].tobytes() == expected[op][rank].tobytes(), (op, res[op], expected)


@pytest.mark.parametrize("dtype,op", [("complex64", "max"), ("float32", "band"),
                                      ("int32", "avg"), ("bool", "avg")])
def test_unsupported_op_dtype_pairs_are_refused_before_sending(dtype, op):
    def fn(comm):
        with pytest.raises(ArgumentError, match=f"'{op}' is not defined for {dtype}"):
            comm.allreduce(np.ones(4, dtype), op)
        x = np.ones(4)
        comm.allreduce(x)  # nothing was sent: the group is still in step
        return x

    for res in run_group(2, fn):
        np.testing.assert_array_equal(res, 2.0)


def test_bad_arguments_say_what_is_wrong():
    def fn(comm):
        with pytest.raises(ArgumentError, match="unknown reduce op 'average'"):
            comm.allreduce(np.ones(3), "average")
        with pytest.raises(ArgumentError, match="root=2 is out of range"):
            comm.broadcast(np.ones(3), root=2)
        with pytest.raises(ArgumentError, match="must have world_size"):
            comm.allgather(np.empty(5), np.ones(3))
        with pytest.raises(ArgumentError, match="not contiguous"):
            comm.allreduce(np.ones((4, 4))[:, 1])
        with pytest.raises(ArgumentError, match="is this rank itself"):
            comm.send(np.ones(3), dst=comm.rank)
        with pytest.raises(ArgumentError, match="numpy array or a torch CPU tensor"):
            comm.allreduce([1.0, 2.0])
        with pytest.raises(ArgumentError, match="not supported"):
            comm.allreduce(np.array(["a"]))
        with pytest.raises(ArgumentError) as info:
            comm.reduce_scatter(np.empty(2), np.ones(3))
        assert str(info.value).startswith(f"[rank {comm.rank}, reduce_scatter] ")
        assert info.value.rank == comm.rank and info.value.op == "reduce_scatter"
        return True

    assert run_group(2, fn) == [True, True]


@pytest.mark.parametrize("mine,theirs", [("float64", "float32"), ("float16", "bfloat16"),
                                         ("float32", "int32"), ("int16", "float16")])
@pytest.mark.parametrize("algorithm", list(ALLREDUCE))
def test_a_dtype_mismatch_is_named_even_where_the_sizes_agree(mine, theirs, algorithm):
    """Rank 1 passes another dtype, of the same item size in all but the first pair (so
    the byte counts agree): the rank that receives from it names both dtypes; everyone
    else hears of it from that rank."""
    def fn(comm):
        x = np.ones(64, _np_dtype(theirs if comm.rank == 1 else mine))
        comm.allreduce(x, algorithm=algorithm)

    errors = run_group(3, fn, timeout=10, return_errors=True)
    desyncs = [e for e in errors if isinstance(e, DesyncError)]
    assert desyncs and all(isinstance(e, (DesyncError, RemoteError)) for e in errors), errors
    for e in desyncs:
        if e.rank == 1:
            assert f"ranks disagree about the op: rank {e.peer} sends {mine}, rank 1 " \
                f"expects {theirs}." in str(e), e
        else:
            assert e.peer == 1
            assert f"ranks disagree about the op: rank 1 sends {theirs}, rank {e.rank} " \
                f"expects {mine}." in str(e), e
    for e in errors:
        if isinstance(e, RemoteError):
            assert f"rank {e.peer} failed and aborted the group: DesyncError" in str(e)


def test_size_mismatch_between_ranks_is_a_desync_naming_both_counts():
    def fn(comm):
        comm.allreduce(np.ones(10 + comm.rank), algorithm="ring")

    errors = run_group(2, fn, timeout=10, return_errors=True)
    assert all(isinstance(e, (DesyncError, RemoteError)) for e in errors), errors
    texts = [str(e) for e in errors if isinstance(e, DesyncError)]
    assert any("rank 1 reduces 11 elements, rank 0 10" in t or
               "rank 0 reduces 10 elements, rank 1 11" in t for t in texts), texts


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "avg", "prod", "min", "max"])
@pytest.mark.parametrize("algorithm", list(ALLREDUCE))
# five ranks fold onto four for the doubling algorithms (two rounds of them): eight, three
# rounds, only in the slow suite
@pytest.mark.parametrize("world", [2, 3, 5, pytest.param(8, marks=pytest.mark.slow)])
def test_every_rank_gets_bitwise_the_same_reduced_result(dtype, op, algorithm, world):
    """Random floats, whose sums depend on the order of additions: whatever order an
    algorithm adds in, every rank must end with the very same bits (DDP replicas rely on
    it)."""
    rng = np.random.default_rng(world)
    inputs = [rng.standard_normal(257).astype(_np_dtype(dtype)) for _ in range(world)]

    def fn(comm):
        x = inputs[comm.rank].copy()
        comm.allreduce(x, op, algorithm=algorithm)
        return x

    results = run_group(world, fn, segment_bytes=SEG * 4)
    assert len({r.tobytes() for r in results}) == 1
    ref = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
           "max": np.maximum}[op]
    expected = inputs[0].astype(np.float64)
    for x in inputs[1:]:
        expected = ref(expected, x.astype(np.float64))
    if op == "avg":
        expected /= world
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    np.testing.assert_allclose(results[0].astype(np.float64), expected, rtol=tol,
                               atol=tol * world)


def test_a_rank_that_never_joins_gives_timeouts_not_hangs():
    def fn(comm):
        if comm.rank == 2:
            return "skipped"
        comm.allreduce(np.ones(16))

    results = run_group(3, fn, timeout=1.0, return_errors=True)
    assert results[2] == "skipped"
    for err in results[:2]:
        assert isinstance(err, (CommTimeout, RemoteError)), err
    assert any(isinstance(e, CommTimeout) and "rank" in str(e) for e in results[:2])


def test_independent_receives_form_runs_and_dependent_ones_do_not():
    # all-to-all and a gather's root: every receive is independent of the others
    a2a = direct.alltoall(0, 4, (4,) * 4, (4,) * 4, 2)
    assert a2a.receive_runs == {7: 13}  # 3 peers x 2 segments, after 6 sends and the copy
    assert direct.gather(2, 4, 2, 5, 100).receive_runs == {1: 4}
    # a lone peer's segments, or schedules with no two receives in a row: nothing to reorder
    assert direct.recv(0, 2, 1, 10, 2).receive_runs == {}
    for schedule in (ring.allreduce(1, 4, 40, 3), ring.allgather(1, 4, (5,) * 4, 2),
                     direct.gather(1, 4, 2, 5, 100)):
        assert schedule.receive_runs == {}, schedule


def test_overlapping_receives_keep_their_order():
    from ringcomm.schedules.schedule import Region, StepList

    steps = StepList()
    steps.recv(1, Region("output", 0, 4))
    steps.recv(2, Region("output", 2, 4))  # overlaps the first: order matters
    assert steps.build("x", "y", 0, 3).receive_runs == {}
    steps = StepList()
    steps.recv(1, Region("output", 0, 4))
    steps.recv(2, Region("output", 4, 4))
    assert steps.build("x", "y", 0, 3).receive_runs == {0: 2}
    assert "steps 0-1: receives taken in the order they arrive" in str(steps.build("x", "y", 0, 3))


def test_alltoall_takes_blocks_in_the_order_they_arrive():
    """Rank 0 reads rank 3's block first in schedule order; with rank 3 late, it takes the
    blocks of ranks 1 and 2 meanwhile instead of waiting, and the result is the same."""
    import time

    trace = []

    def fn(comm):
        if comm.rank == 0:
            time.sleep(0.2)  # ranks 1 and 2 have sent by now
        if comm.rank == 3:
            time.sleep(0.6)
        x = data(comm.rank, 4 * 6)
        out = np.empty(4 * 6)
        comm.alltoall(out, x)
        return out

    results = run_group(4, fn, segment_bytes=16, trace=trace)
    for rank, out in enumerate(results):
        expected = np.concatenate([data(src, 24)[rank * 6:(rank + 1) * 6] for src in range(4)])
        np.testing.assert_array_equal(out, expected)
    order = [e.step.peer for e in trace if e.rank == 0 and e.step.kind is Kind.RECV]
    assert sorted(order) == [1] * 3 + [2] * 3 + [3] * 3  # 6 elements in segments of 2
    assert order[-3:] == [3, 3, 3], order  # the late rank's segments come last


def test_ranks_that_only_sent_find_a_disagreement_at_close():
    """Both ranks think they are the broadcast's root: each only sends, so each returns its
    own (right) data; the other's message is still waiting at close, which says so."""
    def fn(comm):
        x = np.full(4, float(comm.rank))
        comm.broadcast(x, root=comm.rank)
        return x

    results = run_group(2, fn, return_errors=True)
    for rank, err in enumerate(results):
        assert isinstance(err, DesyncError) and err.op == "close", err
        assert str(err).startswith(
            f"[rank {rank}, close] a message of rank {1 - rank}'s broadcast #0 root/tag "
            f"{1 - rank}, message 0, 32 B float64 from rank {1 - rank} was still waiting here")


# --------------------------------------------------------------------------- two levels

LAYOUTS = {
    "2x2": [[0, 1], [2, 3]],
    "3x3": [[0, 1, 2], [3, 4, 5], [6, 7, 8]],
    "3+1": [[0, 1, 2], [3]],
    "4x1": [[0], [1], [2], [3]],
    "interleaved": [[0, 2], [1, 3]],
    "1x5": [[0, 1, 2, 3, 4]],
}


@st.composite
def layouts(draw):
    """A random placement of 2..9 ranks on 1..4 hosts, ranks shuffled over the hosts."""
    world = draw(st.integers(2, 9))
    order = draw(st.permutations(list(range(world))))
    n_hosts = draw(st.integers(1, min(4, world)))
    cuts = sorted(draw(st.lists(st.integers(1, world - 1), min_size=n_hosts - 1,
                                max_size=n_hosts - 1, unique=True)))
    bounds = [0, *cuts, world]
    return [sorted(order[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


def _check_hier(hosts, count, op="sum"):
    world = sum(len(h) for h in hosts)

    def fn(comm):
        x = data(comm.rank, count)
        comm.allreduce(x, op, algorithm="hier")
        return x

    results = run_group(world, fn, segment_bytes=SEG, hosts=hosts)
    fold = {"sum": np.add, "avg": np.add, "max": np.maximum}[op]
    expected = data(0, count)
    for r in range(1, world):
        expected = fold(expected, data(r, count))
    if op == "avg":
        expected = expected / world
    assert len({r.tobytes() for r in results}) == 1  # every rank the same bits
    np.testing.assert_allclose(results[0], expected, rtol=1e-12)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("count", [0, 1, 7, 100])
def test_hier_allreduce_over_host_layouts(layout, op, count):
    _check_hier(LAYOUTS[layout], count, op)


@settings(max_examples=40, deadline=None)
@given(hosts=layouts(), count=counts)
def test_hier_allreduce_over_sampled_layouts(hosts, count):
    _check_hier(hosts, count)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hier_talks_across_hosts_only_between_leaders(layout):
    """Phase 2 is the only one that leaves a host, and only the hosts' lowest ranks take
    part in it; everything else stays between ranks of one host."""
    from ringcomm.schedules import hier

    hosts = tuple(tuple(h) for h in LAYOUTS[layout])
    world = sum(len(h) for h in hosts)
    host_of = {r: i for i, h in enumerate(hosts) for r in h}
    leaders = {h[0] for h in hosts}
    schedules = [hier.allreduce(r, world, 23, 4, hosts) for r in range(world)]
    for r, schedule in enumerate(schedules):
        for step in schedule.steps:
            for peer in {step.peer, step.to} - {-1}:
                if host_of[peer] != host_of[r]:
                    assert r in leaders and peer in leaders, (r, step)
    sends, recvs = message_sizes(schedules)
    assert sends == recvs


def test_split_gives_each_color_its_own_communicator():
    def fn(comm):
        by_parity = comm.split(comm.rank % 2)
        x = np.full(3, float(comm.rank))
        by_parity.allreduce(x)
        host = comm.split(comm.hosts.index(comm.local_ranks))
        y = np.ones(2)
        host.allreduce(y)
        out = (by_parity.rank, by_parity.world_size, x[0], host.world_size, y[0],
               comm.split(None) is None)
        by_parity.close()
        host.close()
        return out

    results = run_group(5, fn, hosts=[[0, 1, 2], [3, 4]])
    assert results == [(0, 3, 6.0, 3, 3.0, True), (0, 2, 4.0, 3, 3.0, True),
                       (1, 3, 6.0, 3, 3.0, True), (1, 2, 4.0, 2, 2.0, True),
                       (2, 3, 6.0, 2, 2.0, True)]
    with pytest.raises(ArgumentError, match="color must be a non-negative int or None"):
        run_group(1, lambda comm: comm.split(-2))
