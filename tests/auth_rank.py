"""One rank of the authentication and hardening tests (``test_auth``, ``test_fuzz_input``).

    python tests/auth_rank.py RANK WORLD HOST:PORT [--token T] [--plain-store] [--rounds N]
                                                   [--pause]

Joins the group (``--plain-store``: through a store that takes no token, so that only the
rank links check it), then prints one JSON line: ``{"error": ..., "seconds": ...}`` if
joining failed, else ``{"listening": [...]}`` (the addresses this rank listens on). With
``--pause`` it then waits for a line on stdin (while the test sends garbage at those
addresses), runs ``--rounds`` allreduces and broadcasts whose results it checks exactly, and
prints ``{"ok": rounds}`` or the error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import ringcomm
from ringcomm.bootstrap.store import StoreClient


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("store")
    parser.add_argument("--token", default=None)
    parser.add_argument("--plain-store", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pause", action="store_true")
    args = parser.parse_args()

    started = time.monotonic()
    store = StoreClient(args.store, timeout=60, auth_token="") if args.plain_store else \
        args.store
    try:
        comm = ringcomm.init(rank=args.rank, world_size=args.world, store=store, timeout=60,
                             auth_token=args.token)
    except ringcomm.CommError as err:
        say(error=type(err).__name__, message=str(err), seconds=time.monotonic() - started)
        return
    with comm:
        say(listening=comm.transport.listening(), describe=comm.describe())
        if args.pause:
            sys.stdin.readline()
        n, r = args.world, args.rank
        try:
            for i in range(args.rounds):
                x = np.arange(1000, dtype=np.float64) * (r + 1) + i
                comm.allreduce(x)
                want = np.arange(1000, dtype=np.float64) * (n * (n + 1) // 2) + n * i
                assert np.array_equal(x, want), f"allreduce round {i} differs"
                y = np.full(300_000, float(r == i % n) * (i + 7))  # over several segments
                comm.broadcast(y, root=i % n)
                assert (y == i + 7).all(), f"broadcast round {i} differs"
        except (ringcomm.CommError, AssertionError) as err:
            say(error=type(err).__name__, message=str(err))
            return
        say(ok=args.rounds)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


if __name__ == "__main__":
    main()
