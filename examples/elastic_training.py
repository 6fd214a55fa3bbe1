"""Elastic training on the ringcomm backend: a rank dies, torchrun restarts the group, and
training goes on from the last checkpoint to the same weights an unfaulted run ends with.

    torchrun --standalone --nproc-per-node 3 --max-restarts 1 examples/elastic_training.py \\
        --dir /tmp/elastic --kill-rank 1 --kill-step 10

What it does:

- ``dist.init_process_group("ringcomm")`` (torchrun's env://), a small model in DDP, SGD
  with momentum; each step every rank draws the same batch from a generator seeded by the
  epoch and step, and trains on its part of it.
- At the end of each epoch rank 0 writes a checkpoint (weights, optimizer state, the next
  epoch) to ``DIR/checkpoint.pt`` atomically: to a temporary file, then ``os.replace``, so
  a rank killed at any moment leaves the old checkpoint or the new one, never half of one.
- When torchrun restarts the workers (``TORCHELASTIC_RESTART_COUNT`` > 0), every rank loads
  the last checkpoint and goes on with the epoch after it.
- ``--kill-rank R --kill-step S``: on the first attempt only, rank R SIGKILLs itself just
  before global step S (a fault injected on purpose). The other ranks' next collective
  fails with a ringcomm error naming the lost rank; torchrun sees the dead worker, stops the
  others and starts all of them again (``--max-restarts 1`` allows one restart).
- At the end rank 0 writes the final weights to ``DIR/final.pt`` and every rank checks that
  all ranks hold the same weights.

Why the weights are exactly those of a run without the fault: a restart loads exactly the
state the unfaulted run had at that epoch's end (weights and momentum, saved bit for bit),
each batch depends only on its epoch and step, and ringcomm sums gradients in the same order
every time for the same sizes (the algorithm and its order follow from the size and the
group, not from timing), so every step after the restart repeats the unfaulted run's.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm  # noqa: F401 - registers the backend (the torch.backends entry point does too)

BATCH = 8  # rows per rank per step


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="where the checkpoint and final weights go")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="steps per epoch")
    p.add_argument("--kill-rank", type=int, default=-1, help="the rank that dies (first "
                   "attempt only); -1: none")
    p.add_argument("--kill-step", type=int, default=-1, help="the global step it dies before")
    return p.parse_args()


def save_atomically(state: dict, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic on one file system: the old checkpoint or the new one


def batch(epoch: int, step: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the step's batch: the same on every attempt."""
    g = torch.Generator().manual_seed(1000 * epoch + step)
    x = torch.randn(BATCH * world, 16, generator=g)
    y = x[:, :1] * 2.0 - x[:, 1:2] + 0.1 * torch.randn(BATCH * world, 1, generator=g)
    part = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[part], y[part]


def main() -> None:
    args = parse()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("ringcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.dir, exist_ok=True)
    with open(os.path.join(args.dir, f"pid-{attempt}-{rank}"), "w") as f:
        f.write(str(os.getpid()))  # for a test that looks for files left by any worker

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checkpoint = os.path.join(args.dir, "checkpoint.pt")
    first_epoch = 0
    if attempt > 0 and os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first_epoch = state["epoch"]
        if rank == 0:
            print(f"attempt {attempt}: resumed from the checkpoint at epoch {first_epoch}",
                  flush=True)

    for epoch in range(first_epoch, args.epochs):
        for step in range(args.steps):
            if (attempt == 0 and rank == args.kill_rank
                    and epoch * args.steps + step == args.kill_step):
                os.kill(os.getpid(), signal.SIGKILL)  # dies as a crash would: no clean-up
            x, y = batch(epoch, step, world, rank)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the gradients over ringcomm
            opt.step()
        if rank == 0:
            save_atomically({"model": model.module.state_dict(),
                             "optimizer": opt.state_dict(), "epoch": epoch + 1}, checkpoint)
            print(f"epoch {epoch}: loss {loss.item():.4f}, checkpoint written", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(flat, other) for other in everyone), "ranks disagree on weights"
    if rank == 0:
        save_atomically(model.module.state_dict(), os.path.join(args.dir, "final.pt"))
        print(f"done after attempt {attempt}: weights equal on all {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
