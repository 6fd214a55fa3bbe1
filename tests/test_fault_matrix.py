"""The fault matrix: every fault the injector knows, in every op, at the first, middle and
last message of the rank that acts, over three real rank processes.

{kill, delay below the timeout, delay above it, drop, corrupt with checksums on} x
{allreduce on the board, ring, tree, hd, rd; broadcast; all-gather; reduce-scatter;
all-to-all; barrier; send/recv} x {first, middle, last}: 165 cases (``-m slow``), and one case
per op with every action and position among them in the default suite. Each case's outcome
on every rank is judged by ``fault_harness.judge``: a kill leaves every survivor with
``PeerLostError`` or ``RemoteError``; a delay below the timeout gives the exact result; a
delay above it or a drop gives ``CommTimeout`` (or ``DesyncError``) naming the rank that
acted; a corruption gives ``ChecksumError`` naming the link; never a wrong result returned,
never a hang, every answer within the timeout plus two seconds.

The ranks are a pool of processes that make a fresh communicator for each case
(``fault_harness.RankPool``); only a kill costs a new process. The rank that acts is rank 1
wherever it sends anything in the op (the root of the broadcast), and "middle" and "last"
are counted from the schedules, which ``test_the_messages_a_fault_counts_are_what_leaves_
each_rank`` checks against what really leaves each rank.
"""

from __future__ import annotations

import pytest
from fault_harness import (
    ACTIONS,
    KIB,
    MATRIX_OPS,
    POSITIONS,
    Case,
    Op,
    RankPool,
    judge,
    matrix_case,
)

WORLD = 3


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as made:
        yield made


def _check(pool: RankPool, op_label: str, action: str, position: str) -> None:
    op = next(o for o in MATRIX_OPS if o.label == op_label)
    case = matrix_case(op, action, position, WORLD)
    outcome = pool.run(case)
    problems = judge(outcome)
    assert not problems, (f"{case.describe()}: " + "\n".join(problems) + "\nevery rank: " +
                          "\n".join(f"  rank {r}: {report}"
                                    for r, report in enumerate(outcome.ranks)))


# one case per op, the actions and positions taking turns, so that each action and each
# position turns up in at least three ops
REPRESENTATIVE = [(op.label, ACTIONS[i % len(ACTIONS)], POSITIONS[i % len(POSITIONS)])
                  for i, op in enumerate(MATRIX_OPS)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("op", "action", "position"), REPRESENTATIVE)
def test_a_fault_in_each_op_gives_every_rank_its_expected_outcome(pool, op, action,
                                                                 position):
    _check(pool, op, action, position)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("op", [op.label for op in MATRIX_OPS])
def test_the_fault_matrix(pool, op, action, position):
    _check(pool, op, action, position)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_messages_a_fault_counts_are_what_leaves_each_rank(pool):
    """The ops run without faults, a wrapper counting every link message and board post
    that leaves each rank: the counts the cases take their positions from."""
    counted = pool.count(WORLD, MATRIX_OPS)
    for rank in range(WORLD):
        assert counted[rank] == [op.messages(rank, WORLD) for op in MATRIX_OPS], rank
    assert all(op.messages(1, WORLD) > 0 for op in MATRIX_OPS)  # rank 1 acts everywhere


def test_the_matrix_has_every_case_and_the_positions_differ_where_a_rank_sends_several():
    """165 cases; the messages a rank sends, one by one, are as many as the schedule's
    count; first, middle and last are different messages wherever the acting rank sends at
    least three."""
    cases = [matrix_case(op, a, p, WORLD) for op in MATRIX_OPS for a in ACTIONS
             for p in POSITIONS]
    assert len(cases) == 165
    for op in MATRIX_OPS:
        assert [len(op.outgoing(r, WORLD)) for r in range(WORLD)] == \
            [op.messages(r, WORLD) for r in range(WORLD)], op.label
        indexes = [matrix_case(op, "drop", p, WORLD).msg for p in POSITIONS]
        sent = op.messages(matrix_case(op, "drop", "first", WORLD).actor, WORLD)
        assert indexes == [0, sent // 2, sent - 1]
        assert len(set(indexes)) == min(3, sent), op.label


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "op", "actor"), [
    (3, Op("allreduce/board", "allreduce", 1 * KIB), 2),
    (2, Op("allgather", "allgather", 100), 0),
], ids=["allreduce-3-ranks", "allgather-2-ranks"])
def test_a_rank_that_drops_its_own_board_post_sees_a_typed_error(pool, world, op, actor):
    assert op.engine(world) == ("board", "board")
    outcome = pool.run(Case(world, op, "drop", actor, 0))
    problems = judge(outcome)
    assert not problems, "\n".join(problems)
