"""One rank of a program that never calls ``close()`` or ``destroy_process_group()``, for
``tests/test_litter.py``: ``python litter_rank.py SCENARIO RANK WORLD PORT`` (rank 0 serves
the store on 127.0.0.1:PORT). It prints one JSON line, what it saw while running (its own
files among them), and then ends the way SCENARIO says:

- ``exit``: 4 MiB allreduces on the shared board and over the links' shared-memory rings,
  and a barrier, then a normal exit.
- ``desync``: ranks disagree about the size of a 1 MiB ring allreduce; the error ends the
  program (exit status 1, Python's exit hooks run).
- ``kill``: world 3, ring allreduces of 2 MiB; rank 1 also sends rank 0 a 1 MiB message that
  rank 0 never receives (a ring its reader never maps), then SIGKILLs itself in the middle of
  a run of allreduces; the others fail with the error they get.
- ``torch``: ``dist.init_process_group("ringcomm")``, a 4 MiB ``all_reduce`` (on the board)
  and a 4 MiB ``broadcast`` from every rank (over the rings), then a normal exit.
- ``die``: world 3, a 4 MiB ring allreduce (over the shared-memory rings where the links
  have them) and a barrier; then rank 1 SIGKILLs itself and the others call ``os._exit``:
  no rank runs an exit hook, so whatever is left on the file system stays there. The link
  kind comes from the environment the test sets (``RINGCOMM_SHM``, ``RINGCOMM_BOARD``).

Imports only what the scenario needs, so a rank starts in a fraction of a second (torch's
scenario excepted).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time

import numpy as np

IPC_BASE = os.path.join(tempfile.gettempdir(), f"ringcomm-{os.getuid()}")
SHM_DIR = "/dev/shm"
MiB = 1 << 20


def own_files(pid: int) -> list[str]:
    """ringcomm's files named for process ``pid``: ipc folders and shared-memory rings."""
    found = []
    for folder, prefix in ((IPC_BASE, f"{pid}-"), (SHM_DIR, f"ringcomm-{pid}-")):
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            continue
        found += [os.path.join(folder, n) for n in names if n.startswith(prefix)]
    return sorted(found)


def report(**kw: object) -> None:
    print(json.dumps({"pid": os.getpid(), "files": own_files(os.getpid()), **kw}), flush=True)


def init(rank: int, world: int, port: int):
    import ringcomm

    return ringcomm.init(rank=rank, world_size=world, store=f"127.0.0.1:{port}", timeout=20,
                         transport="ipc")


def scenario_exit(rank: int, world: int, port: int) -> None:
    comm = init(rank, world, port)
    x = np.ones(MiB, np.float32)
    comm.allreduce(x)
    assert (x == world).all()
    comm.allreduce(x, algorithm="ring")
    assert (x == world * world).all()
    comm.barrier()  # every rank has read from its rings: their names are gone
    report(shm=comm.transport.counters["shm"])


def scenario_desync(rank: int, world: int, port: int) -> None:
    from ringcomm import CommError

    comm = init(rank, world, port)
    try:
        comm.allreduce(np.ones(MiB // 4 + 8 * rank, np.float32), algorithm="ring")
    except CommError as err:
        report(error=type(err).__name__, shm=comm.transport.counters["shm"])
        raise
    raise AssertionError("ranks that disagree about an allreduce's size got no error")


def scenario_kill(rank: int, world: int, port: int, victim: int = 1) -> None:
    from ringcomm import CommError

    comm = init(rank, world, port)
    x = np.ones(MiB // 2, np.float32)
    comm.allreduce(x, algorithm="ring")  # each rank sends to the next only
    comm.barrier()
    if rank == victim:
        comm.send(np.ones(MiB // 4, np.float32), dst=0)  # a new ring, never read
        report(shm=comm.transport.counters["shm"])
        for _ in range(100):
            comm.allreduce(x, algorithm="ring", async_op=True)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    report(shm=comm.transport.counters["shm"])
    try:
        for _ in range(1000):
            comm.allreduce(x, algorithm="ring")
    except CommError as err:
        print(json.dumps({"error": type(err).__name__}), flush=True)
        raise
    raise AssertionError(f"rank {victim} was killed but rank {rank} got no error")


def scenario_die(rank: int, world: int, port: int) -> None:
    comm = init(rank, world, port)
    x = np.ones(MiB, np.float32)
    comm.allreduce(x, algorithm="ring")
    assert (x == world).all()
    comm.barrier()  # every rank has read from its rings
    kinds = sorted({link.kind for link in comm.transport.links if link is not None})
    report(kinds=kinds, board=comm.transport.board is not None)
    comm.barrier()  # every rank has looked at its files
    # no rank may die before every rank has received all it will: ``os._exit`` drops what
    # ZeroMQ has queued and not yet written. A rank says it has through the store (whose
    # requests are answered), and waits until every rank has; rank 0 serves the store, so a
    # rank that asks after it died gets an error instead, and dies all the same.
    from ringcomm.bootstrap.store import StoreClient
    from ringcomm.errors import StoreError

    try:
        with StoreClient(f"127.0.0.1:{port}", timeout=20) as store:
            store.set(f"litter/done/{rank}", b"1")
            store.wait([f"litter/done/{r}" for r in range(world)])
    except StoreError:
        if rank == 0:
            raise
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)


def scenario_torch(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("ringcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    t = torch.ones(MiB)
    dist.all_reduce(t)
    assert (t == world).all()
    for root in range(world):  # every rank sends through its rings
        dist.broadcast(t, src=root)
    dist.barrier()
    report(shm=dist.group.WORLD.comm.transport.counters["shm"])


if __name__ == "__main__":
    name, rank, world, port = sys.argv[1], *map(int, sys.argv[2:5])
    globals()[f"scenario_{name}"](rank, world, port)
