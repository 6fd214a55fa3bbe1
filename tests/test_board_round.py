"""The board's one-shot round in C (``_board_round.c``) against the same round in Python.

What users rely on: the compiled round gives every rank the same bits as the Python round
and as the reference (the parts folded in rank order, whatever rank folds them), for every
op and dtype (the ones it folds itself and the ones it
leaves to Python), and wherever it stops (a peer behind, a header that differs, a sleeping
peer) the round goes on in Python exactly as it would have: the same waits, the same
errors, no post made twice and none skipped. Ranks may run either; they agree.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

from ringcomm.core.dtypes import REDUCE_OPS, dtype_name
from ringcomm.engines.board import board_program
from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.schedules.board import allreduce
from ringcomm.transport import board as board_module
from ringcomm.transport.board import FOLD, Board, size
from ringcomm.transport.header import Header, OpKind

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.complex64, np.bool_,
          np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.longlong, np.ulonglong]
CASES = [(op, dtype) for op in REDUCE_OPS for dtype in DTYPES
         if dtype_name(np.dtype(dtype)) in REDUCE_OPS[op].dtypes]


def test_the_compiled_round_is_built_and_matches_the_layout():
    """Installed with a C compiler (as here and in CI), the round is compiled: were it
    missing, every test below would test Python against itself."""
    assert board_module._compiled is not None, (
        "ringcomm/transport/_board_round.c was not built: is there a C compiler? "
        "(pip install -e . builds it)")
    assert Board(bytearray(size(2)), 0, 2)._compiled is not None


def test_the_setting_turns_the_compiled_round_off(monkeypatch):
    monkeypatch.setenv("RINGCOMM_BOARD_COMPILED", "0")
    assert Board(bytearray(size(2)), 0, 2)._compiled is None


def _values(world: int, count: int, dtype, seed: int, nans: bool = True) -> list[np.ndarray]:
    """Each rank's part: mixed signs and magnitudes, and the edges a fold can get wrong
    (integers that wrap, infinities, signed zeros, subnormals, NaNs of either sign unless
    ``nans`` is False: a float fold whose first part holds one is left to numpy)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    out = []
    for rank in range(world):
        if dt.kind in "iu":
            info = np.iinfo(dt)
            x = rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
            x[count // 2:] = rng.integers(max(info.min, -3), 4, count - count // 2)  # ties
            x[:4] = [info.min, info.max, 0, 1]
        elif dt.kind == "b":
            x = rng.integers(0, 2, count).astype(dt)
        else:
            raw = rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)
            x = raw.astype(dt) if dt.kind != "c" else (raw + 1j * raw[::-1]).astype(dt)
            if dt.kind == "f":
                x[:6] = [np.inf, -np.inf, -0.0, 1.0, np.finfo(dt).smallest_subnormal, 2.0]
                if nans:
                    x[3], x[5] = np.nan, np.nan if rank % 2 else -np.nan  # which NaN it keeps
        out.append(x)
    return out


class Hooks:
    """The channel around a round (``RoundHooks``): records what the round asked of it. A
    wait makes the peer's missing post (``late``: peer -> its values) and returns."""

    def __init__(self, boards: list[Board], header: bytes, late: dict[int, np.ndarray] | None
                 = None, wakes_by_flag: bool = True) -> None:
        self.boards, self.header, self.late = boards, header, dict(late or {})
        self.wakes_by_flag = wakes_by_flag
        self.quick_turns = 0
        self.waits: list[tuple[int, int]] = []
        self.disagreed: list[int] = []
        self.rang = 0

    def _wait(self, peer: int, number: int, op: str, deadline: float, header: bytes) -> None:
        self.waits.append((peer, number))
        self.boards[peer].post(self.header, self.late.pop(peer))

    def _disagrees(self, peer: int, header: bytes, op: str) -> None:
        self.disagreed.append(peer)
        raise LookupError(f"rank {peer}'s post differs")

    def _posted(self) -> None:
        self.rang += 1


def _header(number: int = 1) -> bytes:
    return Header(number, 8, 2, 0, 0, 0, -1, int(OpKind.ALLREDUCE), 0).pack()


def _round(rank: int, parts: list[np.ndarray], op: str, compiled: bool, *,
           late: tuple[int, ...] = (), sleeping: tuple[int, ...] = (),
           other_header: dict[int, bytes] | None = None) -> tuple[np.ndarray, Hooks]:
    """Rank ``rank``'s one-shot round over ``parts`` (one per rank) on a fresh board, every
    peer's post made before it starts except ``late`` ones' (made when it waits)."""
    world = len(parts)
    memory = bytearray(size(world))
    boards = [Board(memory, r, world) for r in range(world)]
    header = _header()
    for peer in range(world):
        if peer != rank and peer not in late:
            boards[peer].post((other_header or {}).get(peer, header), parts[peer])
        if peer in sleeping:
            boards[peer].doze(True)
    mine = boards[rank]
    if not compiled:
        mine._compiled = None
    hooks = Hooks(boards, header, {p: parts[p] for p in late})
    data = parts[rank].copy()
    takes = board_program(allreduce(rank, world, data.size)).whole
    assert takes is not None
    mine.round_whole(header, data, takes, REDUCE_OPS[op], time.monotonic() + 10, "op", hooks)
    assert mine.number == 1 and mine.posted(rank) == 1  # posted once, shown once
    return data, hooks


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("count", [37, 6000])  # folded in C, and by numpy above 8 KiB
@pytest.mark.parametrize("nans", [False, True])
@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_compiled_and_python_rounds_give_the_reference_bits(world, count, nans):
    for i, (op, dtype) in enumerate(CASES):
        parts = _values(world, count, dtype, seed=world * 100 + i, nans=nans)
        want = COLLECTIVES["allreduce"].reference(parts, op)[0]
        for rank in range(world):
            python, _ = _round(rank, parts, op, False)
            got, hooks = _round(rank, parts, op, True)
            assert got.tobytes() == python.tobytes(), (op, np.dtype(dtype), rank)
            assert hooks.waits == [] and hooks.rang == 0
            assert got.tobytes() == want.tobytes(), (op, np.dtype(dtype), rank)


def test_the_compiled_round_folds_like_numpy_where_the_same_nans_meet():
    """NaNs of different signs and payloads in the same place: the fold keeps the one numpy
    keeps, so a rank that folds in C and one that folds in Python hold the same bits."""
    quiet = np.array([np.nan, -np.nan, np.nan, 1.0, -np.nan], np.float64)
    payload = np.frombuffer(np.array([0x7FF8_0000_0000_0001], np.uint64).tobytes(), np.float64)
    other = np.array([-np.nan, np.nan, payload[0], -np.nan, 2.0], np.float64)
    for dtype in (np.float64, np.float32):
        parts = [quiet.astype(dtype), other.astype(dtype), other[::-1].astype(dtype)]
        for op in ("sum", "prod"):
            for rank in range(3):
                c, _ = _round(rank, parts, op, True)
                py, _ = _round(rank, parts, op, False)
                assert c.tobytes() == py.tobytes(), (dtype, op, rank)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("late", [(1,), (2,), (1, 3)])
def test_a_late_peer_is_waited_for_by_the_channel_and_the_round_goes_on(compiled, late):
    parts = _values(4, 9, np.float32, seed=7)
    want = COLLECTIVES["allreduce"].reference(parts, "sum")[0]
    for rank in [r for r in (0, 2, 3) if r not in late]:
        got, hooks = _round(rank, parts, "sum", compiled, late=late)
        assert got.tobytes() == want.tobytes()
        assert sorted(peer for peer, _ in hooks.waits) == sorted(late)
        assert {number for _, number in hooks.waits} == {1}


@pytest.mark.parametrize("compiled", [True, False])
def test_a_peer_behind_on_the_last_post_is_waited_for_before_posting(compiled):
    """Rank 0 has made post 1 and peer 1 has not: rank 0 waits before it posts again, as
    peer 1 has not read the post before it (a rank runs at most one post ahead)."""
    memory = bytearray(size(2))
    boards = [Board(memory, r, 2) for r in range(2)]
    boards[0].post(_header(1), np.ones(2, np.float32))  # rank 0's post 1; rank 1 has none
    hooks = Hooks(boards, _header(2), {1: np.full(2, 5.0, np.float32)})
    if not compiled:
        boards[0]._compiled = None
    data = np.full(2, 2.0, np.float32)

    def wait(peer, number, op, deadline, header):
        hooks.waits.append((peer, number))
        assert boards[0].number == 1, "posted before the peer had made the post before"
        boards[1].post(_header(1), np.zeros(2, np.float32))  # peer 1's post 1
        boards[1].post(_header(2), np.full(2, 5.0, np.float32))  # and its post 2

    hooks._wait = wait  # type: ignore[method-assign]
    boards[0].round_whole(_header(2), data, ((1, FOLD, True),), REDUCE_OPS["sum"],
                          time.monotonic() + 10, "op", hooks)
    assert hooks.waits == [(1, 1)]
    assert data.tolist() == [7.0, 7.0]


def _last_byte_flipped(header: bytes) -> bytes:
    changed = bytearray(header)
    changed[-1] ^= 1
    return bytes(changed)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("differs", [_header(9), _last_byte_flipped(_header())],
                         ids=["first field", "last byte"])
def test_a_header_that_differs_goes_to_the_channel_after_the_takes_before_it(compiled,
                                                                              differs):
    parts = _values(4, 5, np.int64, seed=3)
    memory = bytearray(size(4))
    boards = [Board(memory, r, 4) for r in range(4)]
    for peer in (1, 2, 3):
        boards[peer].post(differs if peer == 2 else _header(), parts[peer])
    if not compiled:
        boards[0]._compiled = None
    hooks = Hooks(boards, _header())
    data = parts[0].copy()
    with pytest.raises(LookupError, match="rank 2's post differs"):
        boards[0].round_whole(_header(), data, board_program(allreduce(0, 4, 5)).whole,
                              REDUCE_OPS["sum"], time.monotonic() + 10, "op", hooks)
    assert hooks.disagreed == [2]
    assert data.tolist() == (parts[0] + parts[1]).tolist()  # the take before it, not after


@pytest.mark.parametrize("compiled", [True, False])
def test_a_stale_post_in_the_slot_is_not_taken_before_its_count_shows_the_new_one(compiled):
    """The slot a take reads still holds the peer's post from two posts ago, with the same
    header bytes: only the peer's count tells the new post from it."""
    memory = bytearray(size(2))
    boards = [Board(memory, r, 2) for r in range(2)]
    for number in (1, 2):  # both ranks make posts 1 and 2; post 3 reuses post 1's slot
        for r in range(2):
            boards[r].post(_header(1), np.full(2, -100.0 * number, np.float32))
    hooks = Hooks(boards, _header(1), {1: np.full(2, 5.0, np.float32)})
    if not compiled:
        boards[0]._compiled = None
    data = np.full(2, 2.0, np.float32)
    boards[0].round_whole(_header(1), data, ((1, FOLD, True),), REDUCE_OPS["sum"],
                          time.monotonic() + 10, "op", hooks)
    assert hooks.waits == [(1, 3)]
    assert data.tolist() == [7.0, 7.0]


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("wakes_by_flag", [True, False])
def test_sleeping_peers_are_woken_once_before_any_take(compiled, wakes_by_flag):
    parts = _values(3, 6, np.float64, seed=5)
    want = COLLECTIVES["allreduce"].reference(parts, "sum")[0]
    for sleeping in ((), (2,)):
        memory = bytearray(size(3))
        boards = [Board(memory, r, 3) for r in range(3)]
        for peer in (1, 2):
            boards[peer].post(_header(), parts[peer])
        for peer in sleeping:
            boards[peer].doze(True)
        if not compiled:
            boards[0]._compiled = None
        hooks = Hooks(boards, _header(), wakes_by_flag=wakes_by_flag)
        data = parts[0].copy()
        boards[0].round_whole(_header(), data, board_program(allreduce(0, 3, 6)).whole,
                              REDUCE_OPS["sum"], time.monotonic() + 10, "op", hooks)
        assert data.tobytes() == want.tobytes()
        assert hooks.rang == (1 if sleeping or not wakes_by_flag else 0)


def test_a_post_too_large_for_the_board_is_refused_as_before():
    """The compiled round takes no call it cannot do whole; Python's refusal stands."""
    memory = bytearray(size(2))
    boards = [Board(memory, r, 2) for r in range(2)]
    data = np.zeros(board_module.SLOT_BYTES // 4 + 1, np.float32)
    with pytest.raises(ValueError, match="a board post holds at most"):
        boards[0].round_whole(_header(), data, ((1, FOLD, True),), REDUCE_OPS["sum"],
                              time.monotonic() + 10, "op", Hooks(boards, _header()))
    assert boards[0].number == 0 and boards[0].posted(0) == 0


@pytest.mark.timeout(60)
def test_ranks_with_and_without_the_compiled_round_agree(cluster):
    """Real processes, the round compiled on two ranks and in Python on the third: every
    check of board, link, point-to-point and async ops holds on every rank."""
    env = {1: {"RINGCOMM_BOARD_COMPILED": "0"}}
    res = cluster.run(3, "job_board", transport="ipc", env=env)
    assert all(x["board"] for x in res)
    assert all(x["wrong"] == [] for x in res), [x["wrong"] for x in res]


def _direct(world: int, data: np.ndarray, *, op: str = "sum", rank: int = 0,
            posted: tuple[int, ...] | None = None, headers: dict[int, bytes] | None = None,
            sleeping: tuple[int, ...] = (), turns: int = 0, theirs: float = 1.0,
            late: tuple[float, int] | None = None) -> tuple[int, np.ndarray, list[Board]]:
    """The compiled round called as ``Board.round_whole`` calls it, on a fresh board whose
    ``posted`` peers (default: all) have made post 1 of ``theirs`` (``headers``: a peer's
    own header); ``late`` = (seconds, peer): that peer posts from another thread meanwhile.
    Its return value, the data, the boards."""
    import threading

    memory = bytearray(size(world))
    boards = [Board(memory, r, world) for r in range(world)]
    ones = np.full_like(data, theirs)
    for peer in range(world):
        if peer != rank and (posted is None or peer in posted):
            boards[peer].post((headers or {}).get(peer, _header()), ones)
    for peer in sleeping:
        boards[peer].doze(True)
    poster = None
    if late is not None:
        seconds, peer = late
        poster = threading.Timer(seconds, boards[peer].post, (_header(), ones))
        poster.start()
    takes = board_program(allreduce(rank, world, data.size)).whole
    compiled = boards[rank]._compiled
    assert compiled is not None
    done = compiled(boards[rank]._bytes, rank, world, 0, _header(), data, takes,
                    REDUCE_OPS[op].code, turns, True)
    if poster is not None:
        poster.join()
    return done, data, boards


def test_the_compiled_round_does_what_it_can_and_says_where_it_stopped():
    """Its answer is ``(first take left << 1) | must wake``, or -1 for nothing done: each
    reason to stop, at the take it stopped at, the data folded up to there and no further."""
    whole = 3 << 1  # world 4, rank 0: three takes, all done
    done, data, boards = _direct(4, np.full(5, 2.0, np.float32))
    assert (done, data.tolist()) == (whole, [5.0] * 5) and boards[0].posted(0) == 1
    done, data, _ = _direct(4, np.full(5, 2.0, np.float32), headers={2: _header(9)})
    assert (done, data.tolist()) == (1 << 1, [3.0] * 5)  # stopped at take 1 (rank 2's)
    done, data, _ = _direct(4, np.full(5, 2.0, np.float32), posted=(1, 3))
    assert (done, data.tolist()) == (1 << 1, [3.0] * 5)  # rank 2 has not posted: its turn
    done, data, _ = _direct(4, np.full(5, 2.0, np.float32), sleeping=(3,))
    assert (done, data.tolist()) == (1, [2.0] * 5)  # posted; wake rank 3 before any take
    big = float(np.finfo(np.float32).max)
    for data, theirs in ((np.full(5, 2.0, np.float16), 1.0),
                         (np.full(5, 2.0, np.float32)[::2], 1.0),
                         (np.frombuffer(bytearray(41), np.float64, 5, 1), 1.0),  # unaligned
                         (np.full(2049, 2.0, np.float32), 1.0),  # 8 KiB and one element
                         (np.array([2.0, np.nan], np.float64), 1.0),
                         (np.array([2.0, big], np.float32), big)):  # overflows
        before = data.copy()
        done, after, boards = _direct(4, data, theirs=theirs)
        if not data.flags.c_contiguous:  # not a buffer it reads: nothing done at all
            assert done == -1 and boards[0].posted(0) == 0
            continue
        assert done == 0, data.dtype  # posted, the first fold left to numpy
        assert after.tobytes() == before.tobytes()  # untouched by a fold given back
    done, data, _ = _direct(4, np.full(2048, 2.0, np.float32))  # 8 KiB: folded here
    assert done == whole and data.min() == data.max() == 5.0
    done, data, _ = _direct(4, np.full(5, 2.0, np.float32), rank=1, posted=(0, 2))
    assert (done, data.tolist()) == (2 << 1, [4.0] * 5)  # rank 0's folded before its own,
    # rank 2's after; rank 3's not there
    memory = bytearray(size(2))
    boards = [Board(memory, r, 2) for r in range(2)]
    boards[0].post(_header(), np.ones(2, np.float32))  # rank 0 at post 1, rank 1 at none
    assert boards[0]._compiled(boards[0]._bytes, 0, 2, 1, _header(), np.ones(2, np.float32),
                               ((1, FOLD, True),), 0, 0, True) == -1  # rank 1 is behind
    assert boards[0].posted(0) == 1  # nothing posted


def test_the_compiled_round_waits_with_the_gil_let_go():
    """Its quick wait yields the core, and the interpreter: a peer that posts from another
    thread of this process meanwhile is taken within the wait."""
    done, data, _ = _direct(2, np.full(3, 2.0, np.float64), posted=(), turns=1 << 24,
                            late=(0.02, 1))
    assert (done, data.tolist()) == (1 << 1, [3.0] * 3)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_fold_that_overflows_warns_or_raises_as_numpy_says(compiled):
    parts = [np.array([3e38, 1.0], np.float32), np.array([3e38, 2.0], np.float32)]
    with pytest.warns(RuntimeWarning, match="overflow"):
        got, _ = _round(0, parts, "sum", compiled)
    assert got.tolist() == [np.inf, 3.0]
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        _round(0, parts, "sum", compiled)
