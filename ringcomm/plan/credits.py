"""Whether a collective's schedules run over a channel whose sends wait for credits.

Why: the link engine's sends never block (a link queues the bytes), so a schedule may have
a rank send many messages to a peer before it receives from anyone. The cuda-ipc channel
(``ringcomm.engines.cuda_ipc``) has ``slots`` staging slots per pair instead: a message
goes in slot-sized pieces, and the piece after the ``slots``-th waits on the host until the
peer has taken an earlier one and said so (a credit). Two ranks that each send more than
``slots`` pieces to the other before receiving (recursive doubling's exchange of a large
vector, halving-doubling's halves) would then wait for each other for ever.

Each rank runs its steps in order and every wait is for a definite message, so whether the
ranks get stuck does not depend on timing: replaying every rank's schedule with the
channel's rule, piece by piece, says it exactly. The selector does that once per call
shape and takes the staged channel, whose sends never wait for the peer, where the replay
gets stuck.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..schedules.schedule import Kind, Schedule

__all__ = ["runs_within_credits"]


def _actions(schedule: Schedule, itemsize: int) -> list[tuple[bool, int, int]]:
    """(is a send, peer, bytes) per message, in order; a fused receive-reduce-send is a
    receive and then a send."""
    actions: list[tuple[bool, int, int]] = []
    for step in schedule.steps:
        if step.kind is Kind.SEND and step.src is not None:
            actions.append((True, step.peer, step.src.count * itemsize))
        elif step.kind in (Kind.RECV, Kind.RECV_REDUCE) and step.dst is not None:
            actions.append((False, step.peer, step.dst.count * itemsize))
        elif step.kind is Kind.RECV_REDUCE_SEND and step.dst is not None:
            nbytes = step.dst.count * itemsize
            actions.append((False, step.peer, nbytes))
            actions.append((True, step.to, nbytes))
    return actions


def _pieces(nbytes: int, slot_bytes: int) -> list[int]:
    """The bytes of each piece of a message (one, empty, for an empty message)."""
    return [min(slot_bytes, nbytes - at) for at in range(0, nbytes, slot_bytes)] or [0]


def runs_within_credits(schedules: Sequence[Schedule], itemsize: int, slots: int,
                        slot_bytes: int) -> bool:
    """Whether every rank of ``schedules`` (rank ``r``'s at index ``r``) gets through its
    steps when a piece with bytes may be sent to a peer only once that peer has taken the
    piece ``slots`` before it (empty pieces need no slot)."""
    world = len(schedules)
    plans = [[(send, peer, _pieces(nbytes, slot_bytes))
              for send, peer, nbytes in _actions(s, itemsize)] for s in schedules]
    cursor = [0] * world  # the action each rank is at
    done_in = [0] * world  # pieces of that action done
    notices = [[0] * world for _ in range(world)]  # [p][q]: pieces p sent q
    taken = [[0] * world for _ in range(world)]  # [p][q]: pieces of p's that q took
    slotted = [[0] * world for _ in range(world)]  # [p][q]: pieces with bytes p sent q
    freed = [[0] * world for _ in range(world)]  # [p][q]: of which q took (credits)
    moved = True
    while moved:
        moved = False
        for r in range(world):
            plan = plans[r]
            while cursor[r] < len(plan):
                send, peer, pieces = plan[cursor[r]]
                size = pieces[done_in[r]]
                if send:
                    if size and slotted[r][peer] >= slots and \
                            freed[r][peer] < slotted[r][peer] - slots + 1:
                        break  # waits for the peer's credit
                    notices[r][peer] += 1
                    slotted[r][peer] += bool(size)
                else:
                    if taken[peer][r] >= notices[peer][r]:
                        break  # waits for the peer's piece
                    taken[peer][r] += 1
                    freed[peer][r] += bool(size)
                moved = True
                done_in[r] += 1
                if done_in[r] == len(pieces):
                    cursor[r] += 1
                    done_in[r] = 0
    return all(cursor[r] == len(plans[r]) for r in range(world))
