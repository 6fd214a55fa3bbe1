"""A rank under torchrun for ``test_auth``: torch's TCPStore (not ringcomm's) holds the
rendezvous, and ringcomm's links must still authenticate.

    torchrun --nproc-per-node 2 tests/auth_torch_rank.py same|differ

``same``: every rank holds one token, and an allreduce over tcp gives the exact sum.
``differ``: each rank holds a token of its own, and joining fails with ``AuthError``.
Prints one JSON line per rank.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import ringcomm

rank = int(os.environ["LOCAL_RANK"])
os.environ["RINGCOMM_AUTH_TOKEN"] = "torchrun token" + (f" {rank}" if sys.argv[1] == "differ"
                                                        else "")
started = time.monotonic()
try:
    dist.init_process_group("ringcomm")
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    world = dist.get_world_size()
    comm = dist.group.WORLD.comm
    result = {"sum_ok": bool((x == world * (world + 1) / 2).all()),
              "tcp": "tcp://" in comm.describe()}
    dist.destroy_process_group()
except Exception as err:  # noqa: BLE001 - reported: torch may wrap ringcomm's error
    cause = err
    while cause.__cause__ is not None and not isinstance(cause, ringcomm.CommError):
        cause = cause.__cause__
    result = {"error": type(cause).__name__, "message": str(err)[-600:],
              "seconds": time.monotonic() - started}
sys.stdout.write(json.dumps(result) + "\n")  # one write: the ranks share one stdout
sys.stdout.flush()
