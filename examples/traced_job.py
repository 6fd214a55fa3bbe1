"""A few collectives through torch.distributed, for a timeline to look at.

    RINGCOMM_TRACE=traces torchrun --standalone --nproc-per-node 3 examples/traced_job.py
    ringcomm trace merge traces -o trace.json      # open in https://ui.perfetto.dev
    ringcomm trace plot trace.json -o timeline.png

Every rank writes ``traces/rank<r>.json`` when its process group is destroyed. The last rank
(rank 2 of 3) starts each round 3 ms late, so the others' waiting shows: grey in the plot,
``wait`` slices in Perfetto.
"""

import time

import torch
import torch.distributed as dist

dist.init_process_group("ringcomm")
rank, world = dist.get_rank(), dist.get_world_size()
small, large = torch.ones(256), torch.ones(1 << 19)  # 1 KiB on the board's one-shot; 2 MiB two-shot
for _ in range(2):
    if rank == world - 1:
        time.sleep(0.003)  # a late rank: its peers wait for its post
    dist.all_reduce(small)
    dist.all_reduce(large)
    dist.broadcast(torch.ones(1 << 17), src=0)  # 512 KiB: a pipelined chain over the links
    gathered = [torch.empty(4) for _ in range(world)]
    dist.all_gather(gathered, torch.full((4,), float(rank)))
if rank == 0:
    dist.send(torch.arange(1000.0), dst=1)
elif rank == 1:
    dist.recv(torch.empty(1000), src=0)
dist.barrier()
dist.destroy_process_group()
