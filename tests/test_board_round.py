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
