"""One rank of a group in which one rank (the last) holds the others up, for
``tests/test_hang_report.py``: ``python hang_rank.py SCENARIO RANK WORLD PORT TIMEOUT SYNC
[ALGORITHM]``. The store is at 127.0.0.1:PORT (rank 0 serves it, unless the test already
does); SYNC is a folder where ranks and the test leave empty files as signals.

- ``skip``: every rank but the last runs one allreduce of 8 float32 (``ALGORITHM``, or the
  selector's choice where it is ``auto``); the last never calls it and waits for the
  others to finish before it closes.
- ``late``: as ``skip``, but the last rank calls the allreduce after the others failed.
- ``other-op``: as ``skip``, but the last rank waits in another op meanwhile: a receive from
  rank 0, which rank 0 never sends.
- ``store-gone``: as ``skip``, but the ranks first say they are ready (``ready-<rank>``)
  and wait until the test has stopped the store it serves (``store-gone``).
- ``torch``: as ``skip``, through ``torch.distributed`` (backend ``ringcomm``).

Prints one JSON line: the error the op raised (type, text, seconds from the call), where it
stood (``err.progress``) and the hang report attached to it (``err.report``). Logs go to
stderr with their level, for the test to read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np


def flag(sync: str, name: str) -> None:
    open(os.path.join(sync, name), "w").close()


def wait_for(sync: str, *names: str, limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while not all(os.path.exists(os.path.join(sync, n)) for n in names):
        if time.monotonic() > end:
            raise TimeoutError(f"no {names} in {sync} within {limit} s")
        time.sleep(0.02)


def outcome(call: Any) -> dict:
    """Run ``call()``; what it raised, how long it took, and the report on the error."""
    start = time.monotonic()
    try:
        call()
    except Exception as err:  # noqa: BLE001 - reported to the test
        elapsed = time.monotonic() - start
        report = getattr(err, "report", None)
        progress = getattr(err, "progress", None)
        return {"error": type(err).__name__, "message": str(err)[:600], "elapsed": elapsed,
                "progress": progress.to_dict() if progress is not None else None,
                "report": None if report is None else {
                    "text": report.text, "gathered": report.gathered,
                    "behind": list(report.behind), "findings": list(report.findings),
                    "states": sorted(report.states), "missing": list(report.missing)}}
    return {"error": None, "elapsed": time.monotonic() - start}


def main() -> None:
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    timeout, sync = float(sys.argv[5]), sys.argv[6]
    algorithm = sys.argv[7] if len(sys.argv) > 7 and sys.argv[7] != "auto" else None
    logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    last = world - 1
    out: dict[str, Any] = {"rank": rank}
    if scenario == "torch":
        import torch
        import torch.distributed as dist

        import ringcomm  # noqa: F401 - registers the backend

        flag(sync, f"imported-{rank}")  # the timeout bounds the rendezvous too: start it
        wait_for(sync, *(f"imported-{r}" for r in range(world)))  # once all have torch
        dist.init_process_group("ringcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        if rank != last:
            out.update(outcome(lambda: dist.all_reduce(torch.ones(8))))
            flag(sync, f"done-{rank}")
        else:
            wait_for(sync, *(f"done-{r}" for r in range(last)))
        print(json.dumps(out), flush=True)
        with contextlib.suppress(Exception):  # the skipped op's messages: DesyncError
            dist.destroy_process_group()
        os._exit(0)  # skip torch's slow interpreter shutdown

    import ringcomm

    comm = ringcomm.init(rank=rank, world_size=world, store=f"127.0.0.1:{port}",
                         timeout=timeout)
    if scenario == "store-gone":
        comm.barrier()
        flag(sync, f"ready-{rank}")
        wait_for(sync, "store-gone")
    def allreduce() -> None:
        comm.allreduce(np.ones(8, np.float32), algorithm=algorithm)

    if rank != last:
        out.update(outcome(allreduce))
        flag(sync, f"done-{rank}")
    elif scenario == "other-op":
        out.update(outcome(lambda: comm.recv(np.empty(8, np.float32), src=0)))
    else:
        wait_for(sync, *(f"done-{r}" for r in range(last)))
        if scenario == "late":
            out.update(outcome(allreduce))
    print(json.dumps(out), flush=True)
    with contextlib.suppress(ringcomm.CommError):  # the skipped op's messages: DesyncError
        comm.close()


if __name__ == "__main__":
    main()
