"""Measure the link between hosts at init, so the cost model prices it as it is.

Why at init: a 1 Gbit/s link and a 100 Gbit/s one call for different algorithms (the
two-level ``hier`` pays off where the link between hosts is what costs), and nothing but a
measurement tells them apart. Rank 0 and the first rank on another host time a few round
trips of a small and of a 1 MiB message; ``alpha`` is half the small round trip, ``beta``
what the big one adds per byte. Rank 0 then broadcasts the two numbers, so every rank
prices the link the same way: agreed like any setting. A profile that ``ringcomm tune``
wrote with a ``remote`` section (measured across hosts) takes precedence.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..plan import cost
from ..runtime.communicator import Communicator

SMALL, BIG = 8, 1 << 20
ROUNDS = 5


def _round_trips(comm: Communicator, peer: int, nbytes: int, first: bool) -> float:
    """Median seconds of a round trip of ``nbytes`` with ``peer`` (one warm-up first)."""
    out, back = np.zeros(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(ROUNDS + 1):
        start = time.perf_counter()
        if first:
            comm.send(out, peer)
            comm.recv(back, peer)
        else:
            comm.recv(back, peer)
            comm.send(out, peer)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[ROUNDS // 2]


def measure_remote(comm: Communicator) -> cost.CostParams | None:
    """The agreed remote link constants of ``comm`` (every rank calls this; None with one
    host). Sets them on the communicator unless its settings already carry some."""
    hosts = comm.hosts
    if len(hosts) < 2 or comm.settings.remote is not None:
        return comm.settings.remote
    far = next(r for r in range(comm.world_size) if not comm.topology.same_host(0, r))
    measured = np.zeros(2)
    if comm.rank in (0, far):
        peer, first = (far, True) if comm.rank == 0 else (0, False)
        small = _round_trips(comm, peer, SMALL, first)
        big = _round_trips(comm, peer, BIG, first)
        alpha = small / 2
        measured[:] = alpha, max((big / 2 - alpha) / BIG, 1e-12)
    comm.broadcast(measured, root=0)
    local = comm.settings.cost_params(comm.world_size)
    remote = cost.CostParams(alpha=float(measured[0]), beta=float(measured[1]),
                             gamma=local.gamma)
    comm.adopt(dataclasses.replace(comm.settings, remote=remote))
    return remote
