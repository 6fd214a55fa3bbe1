"""A small torch job for ``test_timeline.py``, run under torchrun with ``RINGCOMM_TRACE``
set: all_reduce of a small and a large tensor, a broadcast over the links (80 KB),
all_gather, a send and its receive, an async all_reduce and a barrier on the ringcomm
backend, each result checked. Every rank writes its timeline when the group is destroyed.

    RINGCOMM_TRACE=DIR torchrun --standalone --nproc-per-node 3 tests/traced_torch_job.py
"""

import torch
import torch.distributed as dist

import ringcomm  # noqa: F401 - registers the backend

SMALL, LARGE = 5, 300_000  # elements: on the board one-shot; 1.2 MB, two-shot


def main() -> None:
    dist.init_process_group("ringcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = sum(range(1, world + 1))
    for n in (SMALL, LARGE):
        x = torch.full((n,), float(rank + 1))
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((n,), float(ranks))), n
    b = torch.arange(20_000.0) if rank == 0 else torch.zeros(20_000)
    dist.broadcast(b, 0)
    assert torch.equal(b, torch.arange(20_000.0))
    parts = [torch.empty(4) for _ in range(world)]
    dist.all_gather(parts, torch.full((4,), float(rank)))
    assert all(torch.equal(p, torch.full((4,), float(r))) for r, p in enumerate(parts))
    if rank == 0:
        dist.send(torch.arange(6.0), 1)
    elif rank == 1:
        got = torch.empty(6)
        dist.recv(got, 0)
        assert torch.equal(got, torch.arange(6.0))
    y = torch.ones(100_000)
    work = dist.all_reduce(y, async_op=True)
    work.wait()
    assert torch.equal(y, torch.full((100_000,), float(world)))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
