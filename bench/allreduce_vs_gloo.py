"""Ring allreduce bus bandwidth, ringcomm against Gloo, measured in the same run.

    python bench/allreduce_vs_gloo.py --world-sizes 2 4 --sizes 1M 16M 64M

For each world size the script spawns that many ranks on this host. Every rank joins both a
ringcomm communicator and a Gloo process group, so both backends run in the same processes,
on the same buffers, taking turns: for every size, repetition ``k`` times ringcomm and then
Gloo, so that machine noise falls on both alike. A repetition is ``--iters`` back-to-back
allreduces; its time is the slowest rank's. Reported figures are medians (and the best)
over repetitions, in the nccl-tests convention:

    algbw = bytes / time          busbw = algbw * 2(n-1)/n

Before timing, each backend's result is checked (every rank fills rank + 1 and the sum must
be n(n+1)/2 everywhere); the number of wrong elements is reported as ``#wrong``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ringcomm

RESULTS = Path(__file__).parent / "results"


def parse_size(text: str) -> int:
    """``64M`` -> bytes; K, M, G are powers of 1024."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def busbw(nbytes: int, seconds: float, world: int) -> float:
    return nbytes / seconds * 2 * (world - 1) / world / 1e9


def _timed(run, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        run()
    return (time.perf_counter() - start) / iters


def rank_main(rank: int, world: int, ports: tuple[int, int], args: argparse.Namespace,
              results: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=world)
    comm = ringcomm.init(rank=rank, world_size=world, store=f"127.0.0.1:{ports[1]}",
                         timeout=120, segment_bytes=args.segment_bytes)
    backends = {
        "ringcomm": lambda t: comm.allreduce(t),
        "gloo": lambda t: dist.all_reduce(t),
    }
    rows = []
    for nbytes in args.sizes:
        x = torch.empty(nbytes // 4, dtype=torch.float32)
        times: dict[str, list[float]] = {name: [] for name in backends}
        wrong: dict[str, int] = {}
        for name, allreduce in backends.items():
            x.fill_(rank + 1)
            allreduce(x)
            bad = torch.tensor([int((x != world * (world + 1) / 2).sum())], dtype=torch.int64)
            dist.all_reduce(bad)
            wrong[name] = int(bad.item())
        x.zero_()  # sums of zeros stay finite however many times they are repeated
        for allreduce in backends.values():
            for _ in range(args.warmup):
                allreduce(x)
        for _ in range(args.reps):
            for name, allreduce in backends.items():
                dist.barrier()
                elapsed = torch.tensor([_timed(lambda a=allreduce, t=x: a(t), args.iters)],
                                       dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name].append(float(elapsed.item()))
        if rank == 0:
            for name in backends:
                median, best = statistics.median(times[name]), min(times[name])
                rows.append({
                    "backend": name, "world_size": world, "bytes": nbytes,
                    "count": nbytes // 4, "dtype": "float32", "op": "sum",
                    "time_us": median * 1e6, "best_time_us": best * 1e6,
                    "algbw_GBps": nbytes / median / 1e9,
                    "busbw_GBps": busbw(nbytes, median, world),
                    "best_busbw_GBps": busbw(nbytes, best, world),
                    "wrong": wrong[name], "reps": args.reps, "iters": args.iters,
                })
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put(rows)


def run_world(world: int, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=rank_main, args=(r, world, ports, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        rows = results.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed at world size {world}: exit codes "
                         f"{[p.exitcode for p in procs]}")
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'world':>5} {'size':>9} {'backend':>9} {'time(us)':>10} {'algbw':>7} "
          f"{'busbw':>7} {'best':>7} {'#wrong':>6} {'vs gloo':>8}")
    gloo = {(r["world_size"], r["bytes"]): r for r in rows if r["backend"] == "gloo"}
    for r in rows:
        ratio = r["busbw_GBps"] / gloo[(r["world_size"], r["bytes"])]["busbw_GBps"]
        print(f"{r['world_size']:>5} {r['bytes'] / 2**20:>6g}MiB {r['backend']:>9} "
              f"{r['time_us']:>10.0f} {r['algbw_GBps']:>7.2f} {r['busbw_GBps']:>7.2f} "
              f"{r['best_busbw_GBps']:>7.2f} {r['wrong']:>6} {ratio:>7.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=parse_size, nargs="+",
                        default=[parse_size(s) for s in ("1M", "16M", "64M")])
    parser.add_argument("--iters", type=int, default=5, help="allreduces per repetition")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--segment-bytes", type=parse_size, default=2 << 20,
                        help="ringcomm segment size")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path, default=RESULTS / "allreduce_vs_gloo.json")
    args = parser.parse_args(argv)

    rows = []
    for world in args.world_sizes:
        rows += run_world(world, args)
    print_table(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "benchmark": "allreduce float32 sum, ringcomm vs gloo, interleaved",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "numpy": np.__version__},
        "command": " ".join(["python", "bench/allreduce_vs_gloo.py", *(argv or sys.argv[1:])]),
        "results": rows,
    }, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
