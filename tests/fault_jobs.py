"""Jobs for tests/test_faults.py: ranks in real processes (``mp_helpers.Cluster``, which runs
``fault_jobs.job_...`` by name) that init with a fault spec injected and report, call by
call, whether each op came out right or which error it raised, and how fast."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mp_helpers import _rank_environment, error_info, init, values

import ringcomm.faults
from ringcomm import CommError


def _run(comm: Any, op: str, count: int, call: int) -> bool:
    """One call of ``op`` on ``count`` float32 elements a rank; whether this rank's result
    is exactly right."""
    rank, world = comm.rank, comm.world_size
    if op == "allreduce":
        x = values(rank, count, call).astype(np.float32)
        comm.allreduce(x)
        want = sum(values(r, count, call) for r in range(world)).astype(np.float32)
        return x.tobytes() == want.tobytes()
    if op == "broadcast":
        x = values(0, count, call).astype(np.float32) if rank == 0 else \
            np.zeros(count, np.float32)
        comm.broadcast(x, root=0)
        return x.tobytes() == values(0, count, call).astype(np.float32).tobytes()
    if op == "allgather":
        out = np.zeros(count * world, np.float32)
        comm.allgather(out, values(rank, count, call).astype(np.float32))
        want = np.concatenate([values(r, count, call) for r in range(world)]).astype(np.float32)
        return out.tobytes() == want.tobytes()
    if op == "send":  # each rank sends to the next and receives from the one before
        got = np.zeros(count, np.float32)
        work = comm.send(values(rank, count, call).astype(np.float32), (rank + 1) % world,
                         async_op=True)
        comm.recv(got, (rank - 1) % world)
        work.wait()
        return got.tobytes() == values((rank - 1) % world, count, call).astype(
            np.float32).tobytes()
    raise ValueError(f"no such op here: {op}")


def job_ready(**_: Any) -> bool:
    """Nothing: run first, so that a rank replaced after a kill has started (imported torch)
    before a job whose init has a short timeout."""
    return True


def job_fault(rank: int, world: int, store: str, transport: str, spec: str | None,
              op: str, count: int, checksum: bool = False, calls: int = 2,
              op_timeout: float = 2.0, env: dict[str, str | None] | None = None,
              **_: Any) -> dict:
    """Init with ``spec`` injected (and checksums where asked), run ``calls`` calls of
    ``op``; report each call's outcome (right, or the error) until the first error."""
    with _rank_environment(env or {}, None), ringcomm.faults.inject(spec, checksum=checksum):
        comm = init(rank, world, store, transport, timeout=op_timeout)
        board = comm.transport.board is not None
        outcomes: list[dict] = []
        try:
            for call in range(calls):
                start = time.monotonic()
                try:
                    outcomes.append({"right": _run(comm, op, count, call)})
                except CommError as err:
                    info = error_info(err, time.monotonic() - start)
                    del info["error"]
                    outcomes.append(info)
                    break
        finally:
            try:
                comm.close()
            except CommError as err:  # what only close could see belongs to the record
                outcomes.append({"close": type(err).__name__})
    return {"outcomes": outcomes, "board": board}
