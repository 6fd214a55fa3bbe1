"""The shared board: small allreduces and barriers among ranks of one host, through memory.

What users rely on: the same bits on every rank (parts folded in rank order, as the
reference does), the board chosen for what fits it and the links for the rest, on every
rank alike, ordering with link ops, point-to-point messages and async ops kept, and every
disagreement or death a typed error, as over links."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ringcomm import ArgumentError, cli
from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.runtime.local import run_group
from ringcomm.schedules.board import one_shot_bytes
from ringcomm.schedules.schedule import Kind
from ringcomm.transport.board import SLOT_BYTES

REDUCE_DTYPES = {
    "sum": [np.float32, np.float64, np.int32, ml_dtypes.bfloat16, np.complex64],
    "avg": [np.float32, np.float16],
    "prod": [np.float64, np.int64, np.complex64],  # numpy's complex product: a*b != b*a
    "min": [np.float32, np.int8],
    "max": [np.float64, np.int16],
    "band": [np.int32], "bor": [np.uint8], "bxor": [np.int64],
}


def _inputs(world: int, count: int, dtype) -> list[np.ndarray]:
    """Values whose sum depends on the order it is taken in (floats of mixed magnitudes),
    and whose product does too where they are complex."""
    rng = np.random.default_rng(world * 1000 + count)
    raw = [rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count) for _ in range(world)]
    if np.issubdtype(np.dtype(dtype), np.integer):
        raw = [(r * 7).astype(np.int64) % 5 + 1 for r in raw]
    if np.issubdtype(np.dtype(dtype), np.complexfloating):  # numpy's product: a*b != b*a
        raw = [r + 1j * r[::-1] for r in raw]
    return [np.asarray(r).astype(dtype) for r in raw]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("traced", [True, False])
def test_every_rank_gets_the_reference_bits_for_every_op_and_dtype(world, traced):
    """Traced, ops take the general way (a step per event); untraced, the short way."""
    count = 37

    def fn(comm):
        out = []
        for op, dtypes in REDUCE_DTYPES.items():
            for dtype in dtypes:
                x = _inputs(comm.world_size, count, dtype)[comm.rank].copy()
                comm.allreduce(x, op)
                out.append(x)
        comm.barrier()
        return out

    trace = [] if traced else None
    results = run_group(world, fn, board=True, trace=trace)
    i = 0
    for op, dtypes in REDUCE_DTYPES.items():
        for dtype in dtypes:
            want = COLLECTIVES["allreduce"].reference(_inputs(world, count, dtype), op)[0]
            for r in range(world):
                assert results[r][i].tobytes() == want.tobytes(), (op, dtype, r)
            i += 1
    if world > 1 and trace is not None:
        assert {e.algorithm for e in trace} == {"board"}


def test_cpu_tensors_take_the_short_way_by_their_memory_and_get_the_reference_bits():
    """The direct API's blocking allreduce on a CPU tensor views its memory once per address,
    size and dtype: the reference's bits for float32, bfloat16 and int64 (twice each: the
    second call finds the view the first made), for another tensor over the same memory in
    another shape, and for a leaf that requires grad; a tensor the host cannot view as it is
    (a transposed one) takes the general way, which says why it refuses it."""
    import torch

    count, dtypes = 37, (np.float32, ml_dtypes.bfloat16, np.int64)

    def tensor_of(x: np.ndarray) -> torch.Tensor:
        if x.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(x.copy())

    def values(t: torch.Tensor) -> bytes:
        flat = t.detach().reshape(-1)
        if flat.dtype == torch.bfloat16:
            flat = flat.view(torch.int16)
        return flat.numpy().tobytes()

    def fn(comm):
        out = []
        for dtype in dtypes:
            x = _inputs(comm.world_size, count, dtype)[comm.rank]
            t = tensor_of(x)
            for _ in range(2):
                t.copy_(tensor_of(x))
                assert comm.allreduce(t) is t
                out.append(values(t))
        x = _inputs(comm.world_size, 36, np.float32)[comm.rank]
        base = torch.empty(36)
        for shape in ((6, 6), (36,)):  # one memory, two tensors over it
            base.copy_(torch.from_numpy(x))
            comm.allreduce(base.view(shape))
            out.append(values(base))
        leaf = tensor_of(x).requires_grad_(True)
        comm.allreduce(leaf)
        out.append(values(leaf))
        try:
            comm.allreduce(tensor_of(x).reshape(6, 6).T)
            out.append("taken")
        except ArgumentError as err:
            out.append(str(err))
        comm.barrier()
        return out

    world = 3
    results = run_group(world, fn, board=True)
    want = [COLLECTIVES["allreduce"].reference(_inputs(world, count, d), "sum")[0].tobytes()
            for d in dtypes for _ in range(2)]
    want += [COLLECTIVES["allreduce"].reference(_inputs(world, 36, np.float32),
                                                "sum")[0].tobytes()] * 3
    for r in range(world):
        assert results[r][:-1] == want, r
        assert "not contiguous" in results[r][-1]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_two_shot_gives_every_rank_the_reference_bits_piece_by_piece(world):
    """Chunks that are empty (fewer elements than ranks) or uneven, and vectors of several
    posts with a short last one: every element is folded by one rank, in rank order."""
    cases = [(op, dtype) for op, dtypes in REDUCE_DTYPES.items() for dtype in dtypes[:1]]
    cases.append(("sum", np.float32))

    def counts(dtype) -> list[int]:
        piece = SLOT_BYTES // np.dtype(dtype).itemsize
        return [1, world + 1, 37, 2 * piece + 5] if dtype in (np.float32, np.float16) \
            else [world - 1, 37]

    def fn(comm):
        out = []
        for op, dtype in cases:
            for count in counts(dtype):
                x = _inputs(comm.world_size, count, dtype)[comm.rank].copy()
                comm.allreduce(x, op, algorithm="twoshot")
                out.append(x)
        return out

    trace = []
    results = run_group(world, fn, board=True, trace=trace)
    i = 0
    for op, dtype in cases:
        for count in counts(dtype):
            want = COLLECTIVES["allreduce"].reference(_inputs(world, count, dtype), op)[0]
            for r in range(world):
                assert results[r][i].tobytes() == want.tobytes(), (op, dtype, count, r)
            i += 1
    assert {e.algorithm for e in trace} == {"twoshot"}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_broadcast_on_the_board_gives_every_rank_the_roots_values(world):
    def fn(comm):
        out = []
        for root in range(comm.world_size):
            for dtype in (np.float64, ml_dtypes.bfloat16, np.int8):
                x = _inputs(comm.world_size, 19, dtype)[comm.rank].copy()
                comm.broadcast(x, root=root)
                out.append(x)
        return out

    trace = []
    results = run_group(world, fn, board=True, trace=trace)
    for r in range(world):
        i = 0
        for root in range(world):
            for dtype in (np.float64, ml_dtypes.bfloat16, np.int8):
                want = _inputs(world, 19, dtype)[root]
                assert results[r][i].tobytes() == want.tobytes(), (r, root, dtype)
                i += 1
    if world > 1:
        assert {e.algorithm for e in trace} == {"board"}


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_an_allgather_on_the_board_puts_every_block_in_its_place(world):
    def fn(comm):
        out = []
        for dtype in (np.float32, np.complex128, np.uint8):
            x = _inputs(comm.world_size, 7, dtype)[comm.rank]
            got = np.zeros(7 * comm.world_size, dtype)
            comm.allgather(got, x)
            out.append(got)
        return out

    trace = []
    results = run_group(world, fn, board=True, trace=trace)
    for i, dtype in enumerate((np.float32, np.complex128, np.uint8)):
        want = np.concatenate(_inputs(world, 7, dtype))
        assert all(results[r][i].tobytes() == want.tobytes() for r in range(world)), dtype
    if world > 1:
        assert {e.algorithm for e in trace} == {"board"}


def test_an_empty_two_shot_allreduce_still_checks_the_others():
    """No element to move, but a post and a header check all the same: a rank whose vector
    is not empty finds out in the op instead of at the timeout."""
    def fn(comm):
        x = np.ones(0 if comm.rank == 0 else 4, np.float32)
        comm.allreduce(x, algorithm="twoshot")

    errors = run_group(2, fn, board=True, return_errors=True, timeout=10)
    assert all(type(e).__name__ in ("DesyncError", "RemoteError") for e in errors), errors
    assert any("elements" in str(e) for e in errors), errors
    assert run_group(3, lambda comm: comm.allreduce(np.ones(0), algorithm="twoshot").size,
                     board=True) == [0, 0, 0]


def test_ranks_that_disagree_about_a_broadcasts_root_find_out_in_the_op():
    """Both ranks think they are the root: over links each only sends and returns; on the
    board each checks the other's header."""
    def fn(comm):
        comm.broadcast(np.ones(4), root=comm.rank)

    errors = run_group(2, fn, board=True, return_errors=True, timeout=10)
    assert all(type(e).__name__ in ("DesyncError", "RemoteError") for e in errors), errors
    assert any("root" in str(e) for e in errors), errors


def test_small_messages_go_one_shot_larger_two_shot_and_none_without_a_board():
    sizes = [one_shot_bytes(3) // 4, one_shot_bytes(3) // 4 + 1]  # float32 elements

    def fn(comm):
        for n in sizes:
            x = np.ones(n, np.float32)
            comm.allreduce(x)
            assert np.all(x == comm.world_size)

    trace = []
    run_group(3, fn, board=True, trace=trace)
    ran = {e.op: e.algorithm for e in trace}
    assert ran["allreduce #0"] == "board" and ran["allreduce #1"] == "twoshot", ran
    trace.clear()
    run_group(3, fn, trace=trace)  # no board: links only
    assert not {"board", "twoshot"} & {e.algorithm for e in trace}


def test_board_only_when_there_is_one_and_the_message_fits():
    def fn(comm):
        errors = []
        for n in (4, SLOT_BYTES + 4):
            try:
                comm.allreduce(np.ones(n // 4, np.float32), algorithm="board")
            except Exception as err:  # noqa: BLE001 - the test looks at it
                errors.append(str(err))
        return errors

    with_board = run_group(2, fn, board=True)[0]
    assert len(with_board) == 1 and f"at most {SLOT_BYTES} B" in with_board[0], with_board
    without = run_group(2, fn)[0]
    assert len(without) == 2 and all("does not have" in e for e in without), without


def test_ringcomm_schedule_explains_the_board(capsys):
    cli.main(["schedule", "allreduce_board", "-n", "4", "-c", "6", "--rank", "2"])
    assert capsys.readouterr().out.splitlines() == [
        "allreduce (board), rank 2 of 4, 5 steps",
        "     0  post data[0:6] on the board   (post round 0)",
        "     1  take rank 0's post -> data[0:6]   (fold round 0)",
        "     2  take rank 1's post, data[0:6] = data[0:6] (op) post   (fold round 1)",
        "     3  take rank 2's post, data[0:6] = data[0:6] (op) post   (fold round 2)",
        "     4  take rank 3's post, data[0:6] = data[0:6] (op) post   (fold round 3, final)",
    ]


def test_ringcomm_schedule_explains_the_two_shot_allreduce(capsys):
    cli.main(["schedule", "allreduce_twoshot", "-n", "3", "-c", "10", "--rank", "1"])
    assert capsys.readouterr().out.splitlines() == [
        "allreduce (twoshot), rank 1 of 3, 6 steps",
        "     0  post data[0:7] on the board   (post round 0)",
        "     1  take rank 0's post[7:10], data[7:10] = data[7:10] (op) post   (fold round 1)",
        "     2  take rank 2's post[7:10], data[7:10] = data[7:10] (op) post   "
        "(fold round 2, final)",
        "     3  post data[7:10] on the board   (share round 0)",
        "     4  take rank 0's post -> data[0:4]   (gather round 0)",
        "     5  take rank 2's post -> data[4:7]   (gather round 0)",
    ]


# --------------------------------------------------------------------------- real ranks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_real_ranks_mix_board_ops_with_link_ops_p2p_and_async_ops(cluster, world):
    res = cluster.run(world, "job_board", transport="ipc")
    for r, x in enumerate(res):
        assert x["board"], r
        assert x["wrong"] == [], (r, x["wrong"])
    chosen = res[0]["chosen"]
    assert all(x["chosen"] == chosen for x in res)
    one_shot = one_shot_bytes(world)
    assert chosen[4] == chosen[4096] == chosen[one_shot] == "board", chosen
    assert chosen[one_shot + 4] == chosen[2 * SLOT_BYTES + 12] == "twoshot", chosen


@pytest.mark.timeout(60)
def test_a_rank_that_declines_the_board_leaves_every_rank_on_the_links(cluster):
    env = {1: {"RINGCOMM_BOARD": "0"}}
    res = cluster.run(3, "job_board", transport="ipc", env=env)
    assert [x["board"] for x in res] == [False] * 3
    assert all(x["wrong"] == [] and not {"board", "twoshot"} & set(x["chosen"].values())
               for x in res), res


@pytest.mark.timeout(60)
@pytest.mark.parametrize("board", [True, False])
def test_allreduce_now_is_the_short_way_or_nothing(cluster, board):
    """On the board it reduces at once, but never ahead of an op queued before it (the torch
    backend lends it views of tensors that keep nothing alive); without a board it does
    nothing."""
    res = cluster.run(2, "job_allreduce_now", transport="ipc", board=board)
    total = float(sum(range(2)))
    for x in res:
        assert x["board"] is board
        assert x["first"] == (board, [total] * 3)
        assert x["after"] == [total] * 3
    assert res[0]["jumped"] is False


@pytest.mark.timeout(60)
def test_ranks_on_tcp_have_no_board(cluster):
    res = cluster.run(2, "job_board", transport="tcp")
    assert [x["board"] for x in res] == [False, False]
    assert all(x["wrong"] == [] for x in res), res


@pytest.mark.timeout(60)
def test_a_message_that_arrives_during_a_board_wait_reaches_its_receive(cluster):
    res = cluster.run(3, "job_board_p2p_while_waiting", transport="ipc")
    assert all(x["board"] and x["sum"] == [3.0] * 4 and x["recv"] for x in res), res


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case,words", [
    ("board-vs-links", ["board", "ring"]),  # rank 1 forces a link algorithm
    ("one-shot-vs-two-shot", ["board", "twoshot", "elements"]),  # rank 1's op is larger
])
def test_ranks_on_different_board_and_link_algorithms_raise_typed_errors_fast(
        cluster, world, case, words):
    """Ranks that disagree about the op (and so about its algorithm) say so instead of
    waiting out the timeout, naming what differs."""
    from test_multiprocess import FAST, _check_disagreement

    res = cluster.run(world, "job_mismatch", transport="ipc", case=case)
    errs = _check_disagreement(res, world, ["allreduce #1"] * world)
    assert all(e["elapsed"] < FAST for e in errs), errs
    found = " ".join(e["msg"] for e in errs if e["type"] == "DesyncError")
    assert all(word in found for word in words), errs


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("count,piece", [(0, 4), (1, 4), (5, 8), (23, 4), (23, 0), (64, 16)])
def test_every_take_reads_the_same_elements_from_a_post_its_peer_made(world, count, piece):
    """Static check of the allreduce schedules on the board: posts line up (every rank makes
    the same number), and each take reads, from its peer's post of that number, a range the
    peer put there, holding the elements its destination holds."""
    schedules = [COLLECTIVES["allreduce"].schedule(r, world, count, 4, algorithm=algorithm,
                                                   piece=piece)
                 for algorithm in ("board", "twoshot") for r in range(world)]
    for first in range(0, len(schedules), world):
        group = schedules[first: first + world]
        posts = [[s for s in schedule.steps if s.kind is Kind.POST] for schedule in group]
        assert len({len(p) for p in posts}) == 1, group[0].algorithm
        for rank, schedule in enumerate(group):
            number = -1
            for step in schedule.steps:
                if step.kind is Kind.POST:
                    number += 1
                    continue
                assert number >= 0 and step.dst is not None
                if not step.dst.count:
                    continue
                post = posts[step.peer][number]
                assert post.at <= step.at and \
                    step.at + step.dst.count <= post.at + post.src.count, (rank, step)
                assert post.src.offset + step.at - post.at == step.dst.offset, (rank, step)


@pytest.mark.parametrize("how", ["post", "round"])
@pytest.mark.parametrize("world,late", [(2, (1,)), (3, (2,)), (3, (1,)), (3, (1, 2))],
                         ids=["2-late-1", "3-late-2", "3-late-1", "3-late-1-2"])
def test_a_rank_cannot_overwrite_a_post_its_peer_has_not_read(world, late, how):
    """Two slots a rank: post 3 reuses post 1's slot, so it waits until every peer has made
    post 2, which each does only once it has read post 1. Rank 0 runs ahead; the ``late``
    ranks have not read post 1 yet, the others have and made post 2. A rank that went on
    before the last late peer had read would hand it the next op's values in place of this
    one's. Post 3 is made by ``post``, or by the one-shot round of the short way
    (``round_whole``, here with no takes)."""
    import threading
    import time

    from ringcomm.transport.header import Header, OpKind
    from ringcomm.transport.inmemory import InMemoryNetwork

    net = InMemoryNetwork(world, board=True)
    ranks = [net.transport(r).board for r in range(world)]  # each rank's board channel
    fast = ranks[0]
    assert all(t is not None for t in ranks)
    header = [Header(n, 8, 2, 0, 0, 0, -1, int(OpKind.ALLREDUCE), 0).pack() for n in range(4)]
    deadline = time.monotonic() + 10
    f64 = np.dtype(np.float64)
    for r, t in enumerate(ranks):
        t.post(header[1], np.full(2, 1.0 if r == 0 else -1.0), deadline, "op 1")
    fast.post(header[2], np.full(2, 2.0), deadline, "op 2")  # slot 0: post 1's slot is 1
    for r, t in enumerate(ranks[1:], 1):
        if r not in late:  # reads post 1, then makes post 2
            assert t.take(0, header[1], f64, 2, deadline, "op 1").tolist() == [1.0, 1.0]
            t.post(header[2], np.full(2, -2.0), deadline, "op 2")
    third = threading.Thread(
        target=fast.post, args=(header[3], np.full(2, 3.0), deadline, "op 3")
    ) if how == "post" else threading.Thread(
        target=fast.round_whole, args=(header[3], np.full(2, 3.0), (), None, deadline, "op 3"))
    third.start()  # post 3 goes into post 1's slot: must wait for every late rank's post 2
    try:
        for r in late:
            time.sleep(0.2)
            assert third.is_alive(), f"post 3 overwrote post 1 before rank {r} had read it"
            got = ranks[r].take(0, header[1], f64, 2, deadline, "op 1").tolist()
            assert got == [1.0, 1.0], (r, got)
            ranks[r].post(header[2], np.full(2, -2.0), deadline, "op 2")
    finally:
        third.join(5)
    assert not third.is_alive(), "post 3 still waits although every peer made post 2"
