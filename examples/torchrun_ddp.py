"""DDP on the ringcomm backend under torchrun: every rank trains the same model on its
shard of each batch, and rank 0 prints the loss.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, so ``init_process_group``
needs only the backend name (env:// is its default init method). At the end the program
checks that every rank holds the same weights.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm  # noqa: F401 - registers the backend (the torch.backends entry point does too)


def main() -> None:
    dist.init_process_group("ringcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same model everywhere; DDP also broadcasts rank 0's
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 1, generator=g)
    for step in range(20):
        x = torch.randn(8 * world, 16, generator=g)  # every rank draws the same batch ...
        x, y = x[rank * 8:(rank + 1) * 8], (x @ w)[rank * 8:(rank + 1) * 8]  # ... keeps its part
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients over ringcomm
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:2d}  loss {loss.item():.4f}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(flat, other) for other in everyone), "ranks disagree on weights"
    if rank == 0:
        print(f"{world} ranks on {dist.get_backend()}: weights equal on every rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
