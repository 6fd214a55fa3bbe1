"""The CUDA IPC channel over the strict fake runtime (``tests/ipc_ranks.py`` drives it).

Ranks as threads of one process (in-memory transports; peers' slots and events used
directly, as CUDA forbids opening one's own handles) and as real processes (links through
a store; every handle opened once and closed before its exporter frees). The fake applies
queued work only when something waits for it, so a missing or misplaced wait, record or
close in the channel shows up here as wrong bytes, a fake device fault or a leak.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from ipc_ranks import (
    Rank,
    ThreadExchange,
    context,
    message,
    ring_reductions,
    run_processes,
    stream_of_messages,
)
from mp_helpers import in_threads

from ringcomm.core.device import runtime
from ringcomm.errors import ArgumentError, CommTimeout, DesyncError, PeerLostError, RankKilled
from ringcomm.transport import InMemoryNetwork

pytest.importorskip("ringcomm.testing")


def thread_ranks(world: int, **options) -> tuple[list[Rank], InMemoryNetwork]:
    """``world`` ranks of one process, their channels set up (concurrently, as they must)."""
    net = InMemoryNetwork(world)
    exchange = ThreadExchange()
    ranks = in_threads(world, lambda r: Rank(net.transport(r), exchange.for_rank(r),
                                             **options), timeout=20)
    return ranks, net


@pytest.fixture
def live():
    """What the process's fake runtime holds before the test: the ranks of a test share
    it, and ``close_all`` gives back what they made."""
    return runtime("fake").live_allocations()


def close_all(ranks: list[Rank]) -> int:
    """Close every rank (concurrently: each waits for its importers); the process's live
    allocations and mappings afterwards."""
    in_threads(len(ranks), lambda r: ranks[r].close(), timeout=20)
    return runtime("fake").live_allocations()


# --------------------------------------------------------------------------- threads
@pytest.mark.timeout(60)
def test_messages_of_many_sizes_travel_in_pieces_through_reused_slots(live):
    """Sizes around the slot size and many slots long, sent back to back through two slots
    (so every slot is reused many times, within an op and across ops); the sender's stream
    runs to its end before the receiver's, so a slot overwritten before it was read shows."""
    ranks, _ = thread_ranks(3, slots=2, slot_bytes=64)
    sizes = [0, 4, 60, 64, 68, 200, 1000, 8, 64 * 9 + 4, 1]
    meet = threading.Barrier(3, timeout=20).wait

    def run(rank: int) -> None:
        me = ranks[rank]
        stream_of_messages(me, sizes, sender=0, receiver=1, seq=0, meet=meet)
        stream_of_messages(me, sizes, sender=1, receiver=2, seq=1, meet=meet)
        stream_of_messages(me, sizes, sender=2, receiver=0, seq=2, meet=meet)
        stream_of_messages(me, sizes[::-1], sender=0, receiver=1, seq=3, meet=meet)

    in_threads(3, run, timeout=40)
    assert close_all(ranks) == live


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("bfloat16", "avg"),
                                      ("int64", "max")])
def test_reductions_read_the_peers_slot_directly(dtype, op, live):
    """Every rank reduces its left neighbour's vector into its own, piece by piece straight
    from the neighbour's slot, for several rounds (slots reused across ops); ``avg`` divides
    once at the end."""
    ranks, _ = thread_ranks(3, slots=4, slot_bytes=256)
    in_threads(3, lambda r: ring_reductions(ranks[r], 200, dtype, op, 4, seq=0), timeout=40)
    assert close_all(ranks) == live


@pytest.mark.timeout(30)
def test_ranks_that_disagree_about_a_message_raise_desync(live):
    ranks, _ = thread_ranks(2, slots=2, slot_bytes=64)

    def run(rank: int) -> str:
        me = ranks[rank]
        if rank == 0:  # 40 B of uint8, then a message of another dtype
            me.send(1, context(0, np.dtype(np.uint8)), 0, me.put(message(0, 0, 40)), 40)
            me.send(1, context(1, np.dtype(np.float32)), 0, me.put(message(0, 1, 8)), 8)
            return ""
        with pytest.raises(DesyncError, match="rank 0 sends a message of 40 B, rank 1 "
                                              "expects 48 B") as first:
            me.recv(0, context(0, np.dtype(np.uint8)), 0, me.empty(48), 48)
        with pytest.raises(DesyncError, match="rank 0 sends float32, rank 1 expects int64"):
            me.recv(0, context(1, np.dtype(np.int64)), 0, me.empty(8), 8)
        return str(first.value)

    _, text = in_threads(2, run, timeout=20)
    assert "[rank 1, allreduce #0]" in text
    assert close_all(ranks) == live


def send_all(me: Rank, peer: int, ctx, nbytes: int) -> None:
    """A message of 10 pieces through 2 slots: the op's end waits for the peer's credits."""
    me.send(peer, ctx, 0, me.put(message(me.rank, 0, nbytes)), nbytes)
    me.finish(ctx)


@pytest.mark.timeout(30)
def test_a_lost_peer_or_a_silent_one_ends_the_wait_with_a_typed_error(live):
    """Waiting for a notice or for a credit: a peer that is gone gives PeerLostError at
    once, a peer that stays silent CommTimeout at the op's deadline, each naming the peer
    and the op."""
    ranks, net = thread_ranks(3, slots=2, slot_bytes=64, close_wait_s=0.5)

    def run(rank: int) -> dict:
        me = ranks[rank]
        ctx = context(0, np.dtype(np.uint8), timeout=0.5)
        if rank == 2:
            time.sleep(0.2)
            me.transport.die()
        if rank == 1:  # silent: never receives rank 0's pieces
            time.sleep(1.0)
            return {}
        outcome = {}
        for what, call in (
            ("notice", lambda: me.recv(2, ctx, 0, me.empty(64), 64)),
            ("credit", lambda: send_all(me, 1, ctx, 640)),
        ):
            started = time.monotonic()
            with pytest.raises((PeerLostError, CommTimeout)) as info:
                call()
            outcome[what] = (type(info.value), info.value.peer, info.value.op,
                             time.monotonic() - started)
        return outcome

    def guarded(rank: int) -> dict:
        try:
            return run(rank)
        except RankKilled:
            return {}

    outcome = in_threads(3, guarded, timeout=20)[0]
    kind, peer, op, took = outcome["notice"]
    assert (kind, peer, op) == (PeerLostError, 2, "allreduce #0") and took < 0.6
    kind, peer, op, took = outcome["credit"]
    assert (kind, peer, op) == (CommTimeout, 1, "allreduce #0") and took < 2
    assert 2 in net.gone
    started = time.monotonic()
    in_threads(2, lambda r: ranks[r].close(), timeout=20)  # rank 2 never says "closed"
    assert time.monotonic() - started < 2
    ranks[2].close()  # what a process's exit would give back
    assert runtime("fake").live_allocations() == live


@pytest.mark.timeout(20)
def test_settings_that_cannot_work_are_refused_clearly(live):
    net = InMemoryNetwork(1)
    with pytest.raises(ArgumentError, match="multiple of 16"):
        Rank(net.transport(0), ThreadExchange().for_rank(0), slots=2, slot_bytes=100)
    with pytest.raises(ArgumentError, match="at least 1"):
        Rank(net.transport(0), ThreadExchange().for_rank(0), slots=0, slot_bytes=64)
    alone = Rank(net.transport(0), ThreadExchange().for_rank(0), slots=4, slot_bytes=4 << 20)
    assert alone.channel.describe() == "cuda-ipc: 4 slots x 4 MiB per peer"
    assert alone.close() == 0 and runtime("fake").live_allocations() == live


# --------------------------------------------------------------------------- processes
@pytest.mark.timeout(90)
def test_real_processes_map_each_others_slots_and_give_everything_back():
    """Three processes: messages of many sizes and reductions in three dtypes through
    opened handles; one rank closes late, so the others must wait for its "closed" before
    they free (the fake refuses to free memory a living peer maps)."""
    outcomes = run_processes(3, "messages_and_reductions", 80, late_closer=2)
    assert sorted(outcomes) == [0, 1, 2], outcomes
    for rank, outcome in outcomes.items():
        assert isinstance(outcome, dict), f"rank {rank}: {outcome}"
        assert outcome["leaked"] == 0, f"rank {rank} leaked {outcome['leaked']}"
    assert len({o["pid"] for o in outcomes.values()}) == 3


@pytest.mark.timeout(90)
def test_a_killed_process_gives_its_peers_typed_errors_in_time_and_a_quick_close():
    timeout = 5.0
    outcomes = run_processes(3, "killed", 60, victim=1, timeout=timeout)
    assert sorted(outcomes) == [0, 2], outcomes
    for rank, outcome in outcomes.items():
        assert isinstance(outcome, dict), f"rank {rank}: {outcome}"
        assert outcome["error"] in ("PeerLostError", "RemoteError", "CommTimeout"), outcome
        assert outcome["took"] < timeout + 2, outcome
        assert outcome["close_took"] < 6, outcome
    # rank 2 waits for rank 1's notice: it learns that rank 1 is lost, not a timeout
    assert outcomes[2]["error"] == "PeerLostError" and outcomes[2]["peer"] == 1
