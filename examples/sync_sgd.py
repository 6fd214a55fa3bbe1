"""Synchronous SGD the classic way ("Writing Distributed Applications with PyTorch"), with
the backend name set to "ringcomm":

    python examples/sync_sgd.py [--world-size 3]

Rank 0's initial weights reach every rank with ``dist.send``/``dist.recv``; each step,
every rank computes gradients on its own shard of the batch and ``average_gradients``
all-reduces them (``SUM``, then divides) parameter by parameter. At the end every rank holds
the same weights, which the program checks, and the loss has gone down.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing import Process

import ringcomm  # noqa: F401 - registers the backend (the torch.backends entry point does too)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def dataset(rank, size, steps=30, batch=32):
    """A regression problem every rank can generate; rank ``rank`` takes its shard."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(20, 1, generator=g)
    for _ in range(steps):
        x = torch.randn(batch, 20, generator=g)
        y = x @ w + 0.01 * torch.randn(batch, 1, generator=g)
        shard = batch // size
        yield x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]


def sync_initial_weights(model):
    """Rank 0's weights to every rank, one send per parameter and peer."""
    for param in model.parameters():
        if dist.get_rank() == 0:
            for dst in range(1, dist.get_world_size()):
                dist.send(param.data, dst=dst)
        else:
            dist.recv(param.data, src=0)


def average_gradients(model):
    """Gradient averaging."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def run(rank, size):
    """Distributed synchronous SGD."""
    torch.manual_seed(1234 + rank)  # different on purpose: the send/recv makes them equal
    model = Net()
    sync_initial_weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    losses = []
    for data, target in dataset(rank, size):
        optimizer.zero_grad()
        loss = F.mse_loss(model(data), target)
        loss.backward()
        average_gradients(model)
        optimizer.step()
        losses.append(loss.item())
    flat = torch.cat([p.data.reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(flat, other) for other in everyone), "ranks disagree on weights"
    assert losses[-1] < losses[0], losses
    print(f"rank {rank}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, weights equal on all "
          f"{size} ranks", flush=True)


def init_process(rank, size, fn, backend="ringcomm"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    size = parser.parse_args().world_size
    processes = []
    torch.multiprocessing.set_start_method("spawn")
    for rank in range(size):
        p = Process(target=init_process, args=(rank, size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    raise SystemExit(max(p.exitcode for p in processes))
