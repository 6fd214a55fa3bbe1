"""ringcomm in 20 lines: torchrun --standalone --nproc-per-node 2 examples/quickstart.py"""
import numpy as np
import torch

import ringcomm

with ringcomm.init(timeout=30) as comm:  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    rank, n = comm.rank, comm.world_size
    x = np.full(4, rank + 1.0)
    comm.allreduce(x)  # in place; numpy arrays and CPU tensors alike
    assert (x == n * (n + 1) / 2).all()

    grads = torch.randn(1_000_000)
    work = comm.allreduce(grads, op="avg", async_op=True)  # runs while we compute
    loss = sum(i * i for i in range(10_000))
    work.wait()

    out = np.empty(n * 2)
    comm.allgather(out, np.array([rank, rank * 10.0]))  # every rank's pair, in rank order
    comm.broadcast(grads, root=0)
    print(f"rank {rank}: sum ok, gathered {out.tolist()}, {comm.transport.counters}")
