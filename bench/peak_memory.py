"""Peak memory of a large allreduce: resident set size per rank against the tensor's size.

    python -m ringcomm_bench.peak_memory --world-sizes 2 4 --mib 256

Each rank records VmRSS before allocating the tensor, after allocating and touching it, and
its peak (VmHWM) after three allreduces. Target: peak below 2x the tensor size per rank,
i.e. no per-call allocation proportional to the message beyond the reusable shared-memory
rings (and the process's own baseline).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process, MiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def _rank(rank: int, world: int, port: int, mib: int, results) -> None:
    import ringcomm

    comm = ringcomm.init(rank=rank, world_size=world, store=f"127.0.0.1:{port}", timeout=300)
    baseline, _ = _rss_mib()
    x = np.ones((mib << 20) // 4, np.float32)
    allocated, _ = _rss_mib()
    start = time.perf_counter()
    for _ in range(3):
        comm.allreduce(x)
    seconds = (time.perf_counter() - start) / 3
    _, peak = _rss_mib()
    wrong = int((x != float(world ** 3)).sum())
    results.put({"rank": rank, "baseline_mib": baseline, "allocated_mib": allocated,
                 "peak_mib": peak, "peak_over_tensor": peak / mib, "seconds": seconds,
                 "wrong": wrong, "paths": dict(comm.transport.counters)})
    comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--json", type=Path, default=RESULTS / "peak_memory.json")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for world in args.world_sizes:
        results = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, args.mib, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        ranks = sorted((results.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join(60)
        worst = max(ranks, key=lambda r: r["peak_mib"])
        print(f"world {world}: {args.mib} MiB allreduce, peak RSS {worst['peak_mib']:.0f} MiB "
              f"on rank {worst['rank']} ({worst['peak_over_tensor']:.2f}x the tensor; "
              f"baseline {worst['baseline_mib']:.0f} MiB), #wrong "
              f"{sum(r['wrong'] for r in ranks)}")
        rows.append({"world_size": world, "tensor_mib": args.mib, "ranks": ranks})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"benchmark": "peak RSS during allreduce", "results": rows},
                                    indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
