"""The example from torch's DDP design note (docs/source/notes/ddp.rst), with the backend
name changed from "gloo" to "ringcomm". Run it as it is:

    python examples/ddp_design_note.py

The note moves the model to GPU ``rank`` (``.to(rank)``, ``device_ids=[rank]``); this copy
stays on the CPU so that it runs anywhere. ``MASTER_PORT`` may be set from outside, and the
last line of ``example`` prints the result: both only so that a test can run it.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm  # noqa: F401 - registers the backend (the torch.backends entry point does too)


def example(rank, world_size):
    # create default process group
    dist.init_process_group("ringcomm", rank=rank, world_size=world_size)
    # create local model
    model = nn.Linear(10, 10)
    # construct DDP model
    ddp_model = DDP(model)
    # define loss function and optimizer
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    # forward pass
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 10)
    # backward pass
    loss_fn(outputs, labels).backward()
    # update parameters
    optimizer.step()
    print(f"rank {rank}: step done, weight sum {model.weight.sum().item():.6f}", flush=True)
    dist.destroy_process_group()


def main():
    world_size = 2
    mp.spawn(example,
             args=(world_size,),
             nprocs=world_size,
             join=True)


if __name__ == "__main__":
    # Environment variables which need to be
    # set when using c10d's default "env"
    # initialization mode.
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ.setdefault("MASTER_PORT", "29500")
    main()
