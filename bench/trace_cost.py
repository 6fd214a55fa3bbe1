"""What a timeline costs: the same calls with and without ``comm.tracing``, taking turns.

    python -m ringcomm_bench.trace_cost -n 2 --json bench/results/trace_cost.json

Each rank runs an allreduce (on the board where the ranks share it) and a broadcast (over
the links above 64 KiB) of each size, directly on the ``Communicator`` and through
``torch.distributed``; in every repetition, in a shuffled order, once untraced and once
inside ``comm.tracing`` (entered before the timed calls and left after them, so the clock
exchange and the file are not counted). A repetition's time is the slowest rank's, per call;
the table gives the medians and what tracing adds. Tracing off is the untraced column: a
group without a timeline has no wrapper in its path at all.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import free_port, launch, machine_info, turn_order

SIZES = (8, 4096, 256 << 10, 4 << 20)
COLLECTIVES = ("allreduce", "broadcast")
PATHS = ("ringcomm", "ringcomm/torch")


def _direct(comm: Any, collective: str, array: Any) -> Any:
    if collective == "allreduce":
        return lambda: comm.allreduce(array)
    return lambda: comm.broadcast(array, root=0)


def _through_torch(collective: str, tensor: Any) -> Any:
    import torch.distributed as dist

    if collective == "allreduce":
        return lambda: dist.all_reduce(tensor)
    return lambda: dist.broadcast(tensor, src=0)


def _rank(rank: int, world: int, report: Any, ports: tuple[int, int], reps: int,
          seconds: float) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import ringcomm

    comm = ringcomm.init(rank=rank, world_size=world, store=f"127.0.0.1:{ports[0]}",
                         timeout=120)
    dist.init_process_group("ringcomm", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank,
                            world_size=world)
    torch_comm = dist.group.WORLD.comm  # type: ignore[union-attr]  # the group's own
    folder = tempfile.mkdtemp(prefix="ringcomm-trace-cost-")
    for collective in COLLECTIVES:
        for size in SIZES:
            array = np.zeros(size // 4, np.float32)  # sums that stay finite
            tensor = torch.zeros(size // 4)
            calls = {"ringcomm": (comm, _direct(comm, collective, array)),
                     "ringcomm/torch": (torch_comm, _through_torch(collective, tensor))}
            for path, (owner, call) in calls.items():
                for _ in range(20):
                    call()
                owner.barrier()
                start = time.perf_counter()
                for _ in range(20):
                    call()
                gathered = np.empty(world, np.float64)
                owner.allgather(gathered, np.array([(time.perf_counter() - start) / 20]))
                iters = max(5, min(2000, int(seconds / max(float(gathered.max()), 1e-7))))
                times: dict[str, list[float]] = {"off": [], "on": []}
                for rep in range(reps):
                    for mode in [("off", "on")[i] for i in turn_order(2, rep, size)]:
                        if mode == "on":
                            with owner.tracing(folder):
                                owner.barrier()
                                start = time.perf_counter()
                                for _ in range(iters):
                                    call()
                                took = (time.perf_counter() - start) / iters
                        else:
                            owner.barrier()
                            start = time.perf_counter()
                            for _ in range(iters):
                                call()
                            took = (time.perf_counter() - start) / iters
                        mine = np.array([took], np.float64)
                        owner.allgather(gathered, mine)
                        times[mode].append(float(gathered.max()))
                if rank == 0:
                    report("row", {"collective": collective, "bytes": size, "path": path,
                                   "world_size": world, "iters": iters,
                                   "off_us": [t * 1e6 for t in times["off"]],
                                   "on_us": [t * 1e6 for t in times["on"]]})
    dist.destroy_process_group()
    comm.close()
    shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.05,
                        help="about how long each timed run of calls lasts")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for world in args.world_sizes:
        ports = (free_port(), free_port())
        for kind, _, payload in launch(world, _rank, (ports, args.reps, args.seconds), 900):
            if kind == "row":
                off, on = statistics.median(payload["off_us"]), statistics.median(payload["on_us"])
                payload.update(off_median_us=off, on_median_us=on, added_us=on - off,
                               ratio=on / off if off else None)
                rows.append(payload)
    print("| world | collective | size | path | untraced (us) | traced (us) | added (us) "
          "| traced / untraced |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['world_size']} | {row['collective']} | {row['bytes']} B | {row['path']} "
              f"| {row['off_median_us']:.1f} | {row['on_median_us']:.1f} | "
              f"{row['added_us']:+.1f} | {row['ratio']:.2f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "what a timeline costs",
                                         "machine": machine_info(), "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
