"""The torch backend on CUDA tensors, on a machine with a GPU (``bench/gpu_check.sh`` runs the
tests marked ``gpu``; elsewhere they are skipped, saying why).

One to four ranks, spawned (CUDA does not survive ``fork``), share GPU 0 and meet through a
file store. They check every collective on CUDA tensors against values computed on the CPU, that
``Work.wait()`` orders the caller's stream after the op without blocking the host (a kernel
queued on the caller's stream after ``wait`` sees the result, even when the caller's stream
is not the default one), that ``get_future()``'s value is safe on the caller's stream, and
print how long an 8 B all-reduce of a CUDA tensor takes (not asserted: the target is in the
issue, the figure goes to ``bench/results/gpu.json``).
"""

from __future__ import annotations

import json
import time
import traceback
from typing import Any

import pytest
import torch
from mp_helpers import spawned_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU and a CUDA build of torch (none here)"),
    pytest.mark.timeout(240),
]

WORLDS = [1, 2, 3, 4]


def _collectives(rank: int, world: int) -> dict[str, bool]:
    """Every collective on CUDA tensors, each result compared with the CPU's, and every one
    taken by a device engine (never the host board)."""
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    ok: dict[str, bool] = {}
    comm = dist.group.WORLD.comm
    for size in (8, 1 << 20):
        engine = comm.choose("allreduce", torch.ones(size // 4, device=dev)).engine
        ok[f"a {size} B CUDA tensor goes to a device engine ({engine})"] = \
            engine in ("cuda-ipc", "staged", "nccl")

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        ok[name] = bool(got.is_cuda and torch.equal(got.cpu(), want))

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        x = torch.arange(6, device=dev).to(dtype) + rank
        dist.all_reduce(x)
        check(f"all_reduce {dtype}", x,
              sum(torch.arange(6).to(dtype) + r for r in range(world)))
    x = torch.arange(4.0, device=dev) * (rank + 1)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    check("all_reduce avg", x, torch.arange(4.0) * sum(range(1, world + 1)) / world)
    x = torch.full((5,), float(rank), device=dev)
    dist.broadcast(x, src=world - 1)
    check("broadcast", x, torch.full((5,), float(world - 1)))
    x = torch.full((3,), float(rank + 1), device=dev)
    dist.reduce(x, dst=0)
    check("reduce", x, torch.full((3,), float(sum(range(1, world + 1)) if rank == 0
                                             else rank + 1)))
    outs = [torch.empty(2, device=dev) for _ in range(world)]
    dist.all_gather(outs, torch.full((2,), float(rank), device=dev))
    check("all_gather", torch.cat(outs), torch.cat([torch.full((2,), float(r))
                                                    for r in range(world)]))
    out = torch.empty(2 * world, device=dev)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=dev))
    check("all_gather_into_tensor", out, torch.cat([torch.full((2,), float(r))
                                                    for r in range(world)]))
    out = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * world, device=dev) + rank)
    check("reduce_scatter_tensor", out,
          sum(torch.arange(2.0 * world) + r for r in range(world))[2 * rank: 2 * rank + 2])
    out = torch.empty(2, device=dev)
    dist.reduce_scatter(out, [torch.full((2,), float(rank + j), device=dev)
                              for j in range(world)])
    check("reduce_scatter", out, torch.full((2,), float(sum(r + rank for r in range(world)))))
    out = torch.empty(world, device=dev)
    dist.all_to_all_single(out, torch.arange(world, device=dev, dtype=torch.float32)
                           + 10 * rank)
    check("all_to_all_single", out, torch.tensor([10.0 * r + rank for r in range(world)]))
    outs = [torch.empty(1, device=dev) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((1,), 10.0 * rank + j, device=dev)
                           for j in range(world)])
    check("all_to_all", torch.cat(outs), torch.tensor([10.0 * r + rank for r in range(world)]))
    gathered = [torch.empty(2, device=dev) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank), device=dev), gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        check("gather", torch.cat(gathered), torch.cat([torch.full((2,), float(r))
                                                        for r in range(world)]))
    out = torch.empty(2, device=dev)
    dist.scatter(out, [torch.full((2,), float(j), device=dev) for j in range(world)]
                 if rank == 0 else None, src=0)
    check("scatter", out, torch.full((2,), float(rank)))
    x = torch.full((3,), float(rank), device=dev)
    if rank == 0 and world > 1:
        dist.send(x + 7, dst=1)
    elif rank == 1:
        dist.recv(x, src=0)
        check("send/recv", x, torch.full((3,), 7.0))
    dist.barrier()
    return ok


def _ordering(rank: int, world: int) -> dict[str, bool]:
    """``wait()`` orders the caller's *current* stream after the op: a kernel queued on a
    side stream after ``wait`` reads the result, though the host never synchronized; the
    producer is ordered too (a long kernel writes the input just before the op)."""
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    ok: dict[str, bool] = {}
    n = 1 << 22
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        x = torch.zeros(n, device=dev)
        for _ in range(20):  # long queued work that produces the input
            x.add_(1.0)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        y = x * 2  # queued on ``side`` after wait: must see the sum
    side.synchronize()
    ok["wait orders the caller's stream"] = bool(torch.all(y == 40.0 * world))
    # wait() under another stream than the op's orders *that* stream: the op's device work
    # sits behind long work on the op's stream, so a stream nothing ordered after it would
    # read the input as it was
    other = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        x = torch.full((n,), float(rank + 1), device=dev)
        for _ in range(50):
            x.mul_(1.0)
        work = dist.all_reduce(x, async_op=True)
    with torch.cuda.stream(other):
        work.wait()
        y = x.clone()
    other.synchronize()
    ok["wait under another stream orders that stream"] = bool(
        torch.all(y == float(sum(range(1, world + 1)))))
    side.synchronize()
    with torch.cuda.stream(side):
        x = torch.full((n,), float(rank + 1), device=dev)
        fut = dist.all_reduce(x, async_op=True).get_future()
        value = fut.wait()[0]
        z = value + 0  # on the caller's stream: safe without a host synchronize
    side.synchronize()
    ok["the future's value is safe on the caller's stream"] = bool(
        torch.all(z == float(sum(range(1, world + 1)))))
    x = torch.ones(16, device=dev)
    work = dist.all_reduce(x, async_op=True)
    work.synchronize()
    ok["synchronize blocks until the result is on the device"] = bool(
        torch.all(x.cpu() == float(world)))
    # a stream nothing ordered after the op reads the result only because synchronize()
    # blocked the host until the device had done it (a large op, so a race would show)
    other = torch.cuda.Stream(dev)
    x = torch.full((n * 4,), float(rank + 1), device=dev)
    work = dist.all_reduce(x, async_op=True)
    work.synchronize()
    with torch.cuda.stream(other):
        copy = x.clone()
    other.synchronize()
    ok["after synchronize another stream reads the result"] = bool(
        torch.all(copy == float(sum(range(1, world + 1)))))
    return ok


def _small_allreduce_us(rank: int) -> float:
    """Median time of an 8 B all-reduce of a CUDA tensor, result waited for on the host."""
    import torch.distributed as dist

    x = torch.ones(2, device="cuda:0")
    times = []
    for i in range(300):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        if i >= 50:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def _rank(rank: int, world: int, store: str, out: Any) -> None:
    try:
        import torch.distributed as dist

        import ringcomm  # noqa: F401 - registers the backend

        torch.cuda.set_device(0)
        dist.init_process_group("ringcomm", init_method=f"file://{store}", rank=rank,
                                world_size=world)
        try:
            result = {"collectives": _collectives(rank, world),
                      "ordering": _ordering(rank, world),
                      "allreduce_8B_us": _small_allreduce_us(rank)}
        finally:
            dist.destroy_process_group()
        out.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - sent back to the test
        out.put((rank, "err", traceback.format_exc()))


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def results(request) -> list[dict[str, Any]]:
    return spawned_ranks(_rank, request.param)


def test_every_collective_on_cuda_tensors_matches_the_cpu(results):
    for rank, result in enumerate(results):
        failed = [name for name, ok in result["collectives"].items() if not ok]
        assert not failed, (rank, failed)


def test_wait_orders_the_callers_stream_after_the_op(results):
    for rank, result in enumerate(results):
        failed = [name for name, ok in result["ordering"].items() if not ok]
        assert not failed, (rank, failed)


def test_an_8_byte_allreduce_is_timed(results):
    figures = [round(result["allreduce_8B_us"], 1) for result in results]
    print(json.dumps({"torch_cuda_allreduce_8B_us": figures, "world": len(results)}))
    assert all(f > 0 for f in figures)
