"""One rank of the simulated-host tests (``tests/test_multihost.py``), run inside a host's
namespace. Writes what the test asserts on as JSON to ``--out`` (or, for ``torch``, to
``--out``/rank{RANK}.json), errors included; never imports torch except in ``torch`` mode.

    multihost_rank.py collectives --rank R --world N --store HOST:PORT --out FILE
    multihost_rank.py loop --rank R --world N --store HOST:PORT --out FILE --timeout T
    torchrun ... multihost_rank.py torch --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
import traceback
from typing import Any

import numpy as np

import ringcomm
from ringcomm import CommError
from ringcomm.schedules import ALLREDUCE

COUNTS = (1, 4099, 1 << 20)  # one element, an odd count, 4 MiB of float32
SIZES = (4, 4096, 65536, 1 << 20, 4 << 20)  # bytes: the automatic choice must agree at each


def values(rank: int, count: int, salt: int = 0) -> np.ndarray:
    """Small integers: exact in float32, also when summed over a few ranks."""
    return (((np.arange(count, dtype=np.int64) * 7 + rank * 13 + salt * 5) % 23) - 11).astype(
        np.float32)


def check(what: str, got: np.ndarray, want: np.ndarray, done: list[str],
          exact: bool = True) -> None:
    want = np.asarray(want, dtype=np.float32)
    ok = np.array_equal(got, want) if exact else np.allclose(got, want, rtol=1e-6, atol=1e-6)
    if not ok:
        bad = np.flatnonzero(got != want)
        raise AssertionError(f"{what}: {bad.size} wrong of {want.size}, first at {bad[0]}: "
                             f"got {got[bad[0]]}, expected {want[bad[0]]}")
    done.append(what)


def report(comm: ringcomm.Communicator) -> dict[str, Any]:
    """What the test compares across ranks: agreed settings, choices, links, facts."""
    return {
        "rank": comm.rank,
        "hostname": socket.gethostname(),
        "settings": comm.settings.describe(),
        "settings_all": json.loads(json.dumps(dataclasses.asdict(comm.settings), default=str)),
        "params": vars(comm.settings.cost_params(comm.world_size)),
        "segment": comm.segment_bytes,
        "chosen": {str(n): comm.allreduce_algorithm(n) for n in SIZES},
        "cores_per_rank": comm.topology.cores_per_rank,
        "facts": [[f.hostname, list(f.cpus)] for f in comm.topology.ranks],
        "describe": comm.transport.describe(),
        "counters": dict(comm.transport.counters),
        "env_ifname": os.environ.get("RINGCOMM_SOCKET_IFNAME"),
    }


def collectives(comm: ringcomm.Communicator) -> list[str]:
    """Every collective and every allreduce algorithm, values checked, at each count."""
    rank, n = comm.rank, comm.world_size
    done: list[str] = []
    for count in COUNTS:
        total = sum(values(r, count) for r in range(n))
        for name in ALLREDUCE:  # every algorithm, including ones added later
            x = values(rank, count)
            comm.allreduce(x, algorithm=name)
            check(f"allreduce {name} x{count}", x, total, done)
        x = values(rank, count)
        comm.allreduce(x)
        check(f"allreduce auto x{count}", x, total, done)
        x = values(rank, count)
        comm.allreduce(x, op="avg")
        check(f"allreduce avg x{count}", x, total / n, done, exact=False)
        for root in (0, n - 1):  # a root on each host
            x = values(rank, count, 1)
            comm.broadcast(x, root=root)
            check(f"broadcast root {root} x{count}", x, values(root, count, 1), done)
            x = values(rank, count, 2)
            comm.reduce(x, root=root)
            want = sum(values(r, count, 2) for r in range(n)) if rank == root else \
                values(rank, count, 2)
            check(f"reduce root {root} x{count}", x, want, done)
            out = np.full(count * n, -99, np.float32) if rank == root else None
            comm.gather(out, values(rank, count, 3), root=root)
            if rank == root:
                check(f"gather root {root} x{count}", out,
                      np.concatenate([values(r, count, 3) for r in range(n)]), done)
            x = np.full(count, -99, np.float32)
            comm.scatter(x, values(root, count * n, 4) if rank == root else None, root=root)
            check(f"scatter root {root} x{count}", x,
                  values(root, count * n, 4)[rank * count:(rank + 1) * count], done)
        out = np.full(count * n, -99, np.float32)
        comm.allgather(out, values(rank, count, 5))
        check(f"allgather x{count}", out, np.concatenate([values(r, count, 5)
                                                          for r in range(n)]), done)
        out = np.full(count, -99, np.float32)
        comm.reduce_scatter(out, values(rank, count * n, 6))
        want = sum(values(r, count * n, 6) for r in range(n))[rank * count:(rank + 1) * count]
        check(f"reduce_scatter x{count}", out, want, done)
        out = np.full(count * n, -99, np.float32)
        comm.alltoall(out, np.concatenate([values(rank * n + j, count, 7) for j in range(n)]))
        check(f"alltoall x{count}", out,
              np.concatenate([values(r * n + rank, count, 7) for r in range(n)]), done)
        comm.barrier()
        done.append(f"barrier x{count}")
    return done


def loop(comm: ringcomm.Communicator, marker: str) -> dict[str, Any]:
    """Allreduce 4 MiB until something fails; create ``marker`` once well under way."""
    x = np.ones(1 << 20, np.float32)
    i = 0
    try:
        while True:
            comm.allreduce(x, op="avg")  # stays 1.0: nothing overflows however long it runs
            i += 1
            if i == 3:
                open(marker, "w").close()
            if i % 16 == 0 and not np.all(x == 1.0):
                raise AssertionError(f"wrong values after {i} allreduces")
    except CommError as err:
        return {"error": type(err).__name__, "msg": str(err), "t_error": time.time(),
                "iterations": i, "is_comm_error": True}


def torch_mode(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("ringcomm")
    rank, n = dist.get_rank(), dist.get_world_size()
    done: list[str] = []
    for count in COUNTS:
        total = torch.from_numpy(sum(values(r, count) for r in range(n)))
        t = torch.from_numpy(values(rank, count))
        dist.all_reduce(t)
        check(f"all_reduce x{count}", t.numpy(), total.numpy(), done)
        t = torch.from_numpy(values(rank, count, 1))
        dist.broadcast(t, src=n - 1)
        check(f"broadcast x{count}", t.numpy(), values(n - 1, count, 1), done)
        out = torch.full((count * n,), -99.0)
        dist.all_gather_into_tensor(out, torch.from_numpy(values(rank, count, 2)))
        check(f"all_gather x{count}", out.numpy(),
              np.concatenate([values(r, count, 2) for r in range(n)]), done)
        out = torch.full((count,), -99.0)
        dist.reduce_scatter_tensor(out, torch.from_numpy(values(rank, count * n, 3)))
        want = sum(values(r, count * n, 3) for r in range(n))[rank * count:(rank + 1) * count]
        check(f"reduce_scatter x{count}", out.numpy(), want, done)
        out = torch.full((count * n,), -99.0)
        dist.all_to_all_single(out, torch.from_numpy(
            np.concatenate([values(rank * n + j, count, 4) for j in range(n)])))
        check(f"all_to_all x{count}", out.numpy(),
              np.concatenate([values(r * n + rank, count, 4) for r in range(n)]), done)
    dist.barrier()
    result = report(dist.group.WORLD.comm)
    result.update(checks=done, local_rank=int(os.environ["LOCAL_RANK"]),
                  group_rank=int(os.environ["GROUP_RANK"]), torch=torch.__version__)
    dist.destroy_process_group()
    _write(os.path.join(out_dir, f"rank{rank}.json"), result)


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["collectives", "loop", "torch"])
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--store")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args()
    if a.mode == "torch":
        torch_mode(a.out)
        return 0
    result: dict[str, Any] = {}
    try:
        with ringcomm.init(rank=a.rank, world_size=a.world, store=a.store,
                           timeout=a.timeout) as comm:
            result.update(report(comm))
            if a.mode == "collectives":
                result["checks"] = collectives(comm)
                result.update(report(comm))  # the counters after the traffic
            else:
                result.update(loop(comm, f"{a.out}.looping"))
                comm.close()  # the group is aborted: closing must not hang either
    except BaseException as err:  # noqa: BLE001 - the test reads it
        failure = {"error": type(err).__name__, "msg": str(err), "t_error": time.time(),
                   "is_comm_error": isinstance(err, CommError),
                   "traceback": traceback.format_exc()}
        if "error" in result:  # the op's error came first; this one came at close
            result["close_error"] = failure
        else:
            result.update(failure)
    result["t_exit"] = time.time()
    _write(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
