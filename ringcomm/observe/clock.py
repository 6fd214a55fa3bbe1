"""Every rank's clock against rank 0's, so that timelines of several ranks line up.

A rank sends rank 0 its time ``t0``; rank 0 answers with its own, ``t``; the rank reads its
clock again, ``t1``. If the two legs took the same time, rank 0's clock read ``t`` when
this rank's read ``(t0 + t1) / 2``: the offset is ``t - (t0 + t1) / 2``, right to within
half the round trip, which is the error a merged timeline reports. The exchange runs a few
times and keeps the one with the shortest round trip (NTP's filter, in small).

At init the exchange goes through the store (``through_store``), before any link exists,
for the ranks that keep a timeline (the facts every rank published say which); a
``comm.tracing`` context started later exchanges over the communicator's own messages
(``over_links``), which all ranks enter together.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .timeline import Clock

ROUNDS = 5
TAG = 2**31 - 17  # over_links' messages, apart from the user's tags
_TIME = struct.Struct("<d")


def _now_us() -> float:
    return time.perf_counter() * 1e6


def _best(samples: Sequence[tuple[float, float, float]]) -> Clock:
    """The offset of the exchange with the shortest round trip (``samples``: ``t0``, rank
    0's ``t``, ``t1``), with half that round trip as its error."""
    t0, t, t1 = min(samples, key=lambda s: s[2] - s[0])
    return Clock(t - (t0 + t1) / 2, (t1 - t0) / 2)


def _exchange(ask: Callable[[float], float], rounds: int) -> Clock:
    samples = []
    for _ in range(rounds):
        t0 = _now_us()
        t = ask(t0)
        samples.append((t0, t, _now_us()))
    return _best(samples)


def through_store(store: Any, rank: int, ranks: Sequence[int], timeout: float,
                  rounds: int = ROUNDS) -> Clock:
    """The clock of ``rank`` against rank 0's, measured through ``store`` (its ``set``,
    ``get``, ``wait``): rank 0 answers every rank in ``ranks`` (those that asked), in order;
    each of those asks; every other rank does nothing and gets an unmeasured clock."""
    if rank == 0:
        for other in ranks:
            if other == 0:
                continue
            for k in range(rounds):
                key = f"clock/{other}/{k}"
                store.wait([f"{key}/ask"], timeout)
                store.set(f"{key}/answer", _TIME.pack(_now_us()))
        return Clock(0.0, 0.0)
    if rank not in ranks:
        return Clock()
    counter = iter(range(rounds))

    def ask(t0: float) -> float:
        key = f"clock/{rank}/{next(counter)}"
        store.set(f"{key}/ask", b"1")
        store.wait([f"{key}/answer"], timeout)
        answer: float = _TIME.unpack(store.get(f"{key}/answer"))[0]
        return answer

    return _exchange(ask, rounds)


def over_links(comm: Any, rounds: int = ROUNDS) -> Clock:
    """The clock of ``comm``'s rank against rank 0's, measured with point-to-point messages
    on ``comm``: a collective call (rank 0 answers every other rank in turn)."""
    if comm.world_size == 1:
        return Clock(0.0, 0.0)
    stamp = np.zeros(1, np.float64)
    if comm.rank == 0:
        for other in range(1, comm.world_size):
            for _ in range(rounds):
                comm.recv(stamp, other, TAG)
                stamp[0] = _now_us()
                comm.send(stamp, other, TAG)
        return Clock(0.0, 0.0)

    def ask(t0: float) -> float:
        stamp[0] = t0
        comm.send(stamp, 0, TAG)
        comm.recv(stamp, 0, TAG)
        return float(stamp[0])

    return _exchange(ask, rounds)
