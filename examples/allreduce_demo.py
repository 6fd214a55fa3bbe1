"""Checked allreduce on every rank, then its bandwidth: run it under torchrun.

    torchrun --standalone --nproc-per-node 4 examples/allreduce_demo.py

Each rank fills a tensor with its own rank number; after a sum allreduce every element must
equal 0 + 1 + ... + (n - 1). Rank 0 prints the result check and the bus bandwidth
(nccl-tests convention: busbw = bytes / time * 2(n-1)/n).
"""

import argparse
import time

import torch

import ringcomm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[1, 16, 64],
                        help="message sizes in MiB (float32)")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()

    with ringcomm.init(timeout=60) as comm:
        rank, n = comm.rank, comm.world_size
        expected = n * (n - 1) / 2
        if rank == 0:
            print(f"ringcomm allreduce on {n} ranks, float32, {args.iters} timed iterations")
            print(comm.transport.describe())
            print(f"{'size':>10} {'time (ms)':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}  check")
        for mib in args.mib:
            x = torch.empty(int(mib * 2**20) // 4, dtype=torch.float32)
            x.fill_(rank)
            comm.allreduce(x)
            wrong = int((x != expected).sum())
            wrong_total = torch.tensor([wrong], dtype=torch.int64)
            comm.allreduce(wrong_total)
            comm.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                comm.allreduce(x)
            seconds = (time.perf_counter() - start) / args.iters
            algbw = x.numel() * 4 / seconds / 1e9
            if rank == 0:
                check = "ok" if wrong_total.item() == 0 else f"{wrong_total.item()} WRONG"
                print(f"{mib:>7g} MiB {seconds * 1e3:>10.2f} {algbw:>11.2f} "
                      f"{algbw * 2 * (n - 1) / n:>11.2f}  {check}")
            if wrong_total.item():
                raise SystemExit(f"rank {rank}: allreduce gave wrong values")


if __name__ == "__main__":
    main()
