"""A small data-parallel training script, as a user would write it: DDP over the ringcomm
backend, every rank training on its shard of each batch. ``test_train_faults.py`` beside it
is a test of how this script behaves when a fault is injected into its communication.

    torchrun --standalone --nproc-per-node 3 examples/fault_injection/train.py

It reads nothing of faults itself: ``RINGCOMM_FAULTS`` (and ``RINGCOMM_CHECKSUM``) in the
environment of every rank is all a test needs. ``TRAIN_STEPS`` and ``TRAIN_TIMEOUT``
(seconds an op may take) let a test keep it short. At the end each rank prints its final
loss and a fingerprint of its weights.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm  # noqa: F401 - registers the backend (the torch.backends entry point does too)


def main() -> None:
    timeout = float(os.environ.get("TRAIN_TIMEOUT", "60"))
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 1, generator=g)
    loss = torch.zeros(())
    for _ in range(int(os.environ.get("TRAIN_STEPS", "20"))):
        x = torch.randn(8 * world, 16, generator=g)
        x, y = x[rank * 8:(rank + 1) * 8], (x @ w)[rank * 8:(rank + 1) * 8]
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients over ringcomm
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(f"rank {rank}: loss {loss.item():.6f} weights {flat.sum().item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
