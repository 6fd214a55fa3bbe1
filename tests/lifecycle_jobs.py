"""Jobs for ``test_lifecycle``: a process that makes, uses and closes communicators again and
again, and holds several at once, on every device engine (run by ``mp_helpers.Cluster`` as
"lifecycle_jobs.<job>").

Each job runs on the device runtime the test names ("fake" on a CPU, "cuda" where CuPy sees
a GPU) and returns what the test asserts on: the engine each call ran on, and how much the
process holds on the device before and after (``live_allocations``: allocations, mappings,
events opened, host ranges registered; with CuPy also the device's used bytes, reported).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from device_cases import share_gpu, to_device, to_host

import ringcomm
from ringcomm.runtime.devices import named_runtime

RUNTIME_OF = {"fake": "fake", "cuda": "cupy"}


@contextlib.contextmanager
def engine_forced(engine: str) -> Iterator[None]:
    """``RINGCOMM_DEVICE_ENGINE=engine`` for the job (every rank sets it: it must match)."""
    saved = os.environ.get("RINGCOMM_DEVICE_ENGINE")
    os.environ["RINGCOMM_DEVICE_ENGINE"] = engine
    try:
        yield
    finally:
        if saved is None:
            del os.environ["RINGCOMM_DEVICE_ENGINE"]
        else:
            os.environ["RINGCOMM_DEVICE_ENGINE"] = saved


def device_used(device: str) -> int | None:
    """Bytes in use on the current GPU (CuPy), once CuPy's pool has given back what it
    caches; None on the fake."""
    if device != "cuda":
        return None
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    free, total = cupy.cuda.runtime.memGetInfo()
    return int(total - free)


def ran_on(comm: Any, call: Any) -> str:
    """The device engine whose lane ran ``call`` (a communicator op) to its end; what the
    selector says must be the same."""
    before = {name: lane.ops for name, lane in comm.wiring.lanes.items()}
    chosen = call()
    ran = [name for name, lane in comm.wiring.lanes.items() if lane.ops > before[name]]
    assert ran == [chosen], (ran, chosen)
    return chosen


def allreduce_checked(comm: Any, rank: int, world: int, salt: int, count: int = 1000) -> str:
    """A device allreduce (sum) whose result is checked; the engine that ran it."""
    x = to_device(comm.device, np.full(count, float(rank + salt), np.float32))

    def call() -> str:
        comm.allreduce(x)
        return comm.choose("allreduce", x).engine
    engine = ran_on(comm, call)
    got = to_host(x)
    want = world * salt + world * (world - 1) / 2
    assert np.all(got == want), (salt, got[:4], want)
    return engine


def job_cycles(rank: int, world: int, store: str, transport: str, engine: str, cycles: int,
               device: str = "fake", **_: Any) -> dict:
    """``cycles`` times on one store address: init on device ``device`` with ``engine``
    forced, a checked device allreduce and a host one, close. What the device holds comes
    back to where it was."""
    rt = named_runtime(RUNTIME_OF[device])
    share_gpu(engine, device, rank, world)
    live, used = rt.live_allocations(), device_used(device)
    engines = []
    with engine_forced(engine):
        for cycle in range(cycles):
            with ringcomm.init(rank=rank, world_size=world, store=store, timeout=30,
                               transport=transport, device=device) as comm:
                engines.append(allreduce_checked(comm, rank, world, cycle))
                host = np.full(3, float(rank))
                comm.allreduce(host)
                assert host.tolist() == [world * (world - 1) / 2] * 3
    return {"engines": sorted(set(engines)), "live": (live, rt.live_allocations()),
            "used": (used, device_used(device))}


def job_several_at_once(rank: int, world: int, store: str, stores: list, transport: str,
                        engine: str, device: str = "fake", **_: Any) -> dict:
    """Two communicators of one process open at once on two stores, a third on the first
    store while both live, and a split of the first: each runs checked device allreduces,
    interleaved, then they close in another order than they opened."""
    rt = named_runtime(RUNTIME_OF[device])
    share_gpu(engine, device, rank, world)
    live = rt.live_allocations()
    engines = []
    with engine_forced(engine):
        first = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30,
                              transport=transport, device=device)
        second = ringcomm.init(rank=rank, world_size=world, store=stores[0], timeout=30,
                               transport=transport, device=device)
        third = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30,
                              transport=transport, device=device)
        half = first.split(rank % 2)
        try:
            for salt in range(3):
                for comm in (first, second, third):
                    engines.append(allreduce_checked(comm, rank, world, salt))
                engines.append(allreduce_checked(half, half.rank, half.world_size, salt))
            second.close()
            engines.append(allreduce_checked(first, rank, world, 7))
            third.close()
            engines.append(allreduce_checked(half, half.rank, half.world_size, 8))
        finally:
            for comm in (half, third, second, first):
                comm.close()
    return {"engines": sorted(set(engines)), "live": (live, rt.live_allocations())}


def job_torch_groups(rank: int, world: int, store: str, transport: str, engine: str,
                     device: str = "fake", **_: Any) -> dict:
    """torch's default ringcomm group and two ``new_group``s, all live at once: each runs a
    checked allreduce of device memory (CUDA tensors on a GPU; on the fake runtime, its
    arrays through each group's communicator) and of a CPU tensor through torch."""
    import torch
    import torch.distributed as dist

    rt = named_runtime(RUNTIME_OF[device])
    share_gpu(engine, device, rank, world)
    live = rt.live_allocations()
    host, port = store.rsplit(":", 1)
    engines: list[str] = []
    saved = os.environ.get("RINGCOMM_DEVICE")
    os.environ["RINGCOMM_DEVICE"] = device
    try:
        with engine_forced(engine):
            tcp = dist.TCPStore(host, int(port), world, is_master=rank == 0)
            dist.init_process_group("ringcomm", store=tcp, rank=rank, world_size=world)
            try:
                everyone = dist.new_group(list(range(world)))
                evens = [r for r in range(world) if r % 2 == 0]
                some = dist.new_group(evens)
                groups = [dist.group.WORLD, everyone] + ([some] if rank in evens else [])
                for salt in range(2):
                    for group in groups:
                        size = dist.get_world_size(group)
                        me = dist.get_rank(group)
                        t = torch.full((5,), float(me + salt))
                        dist.all_reduce(t, group=group)
                        assert t.tolist() == [size * salt + size * (size - 1) / 2] * 5
                        engines.append(_device_allreduce(group, me, size, salt, device))
            finally:
                dist.destroy_process_group()
    finally:
        if saved is None:
            os.environ.pop("RINGCOMM_DEVICE", None)
        else:
            os.environ["RINGCOMM_DEVICE"] = saved
    return {"engines": sorted(set(engines)), "live": (live, rt.live_allocations())}


def _device_allreduce(group: Any, me: int, size: int, salt: int, device: str) -> str:
    """A checked allreduce of device memory on ``group``: a CUDA tensor through torch on a
    GPU; the group's communicator on a fake runtime's array elsewhere (torch has no fake
    CUDA tensors). The engine it ran on, as the communicator chooses it."""
    import torch
    import torch.distributed as dist

    comm = group.comm  # the group torch made through the registered "ringcomm" backend
    if device == "cuda":
        t = torch.full((1000,), float(me + salt), device="cuda")

        def call() -> str:
            dist.all_reduce(t, group=group)
            return comm.choose("allreduce", t).engine
        engine = ran_on(comm, call)
        assert bool((t == size * salt + size * (size - 1) / 2).all())
        return engine
    return allreduce_checked(comm, me, size, salt)


def job_describe(rank: int, world: int, store: str, transport: str, device: str = "fake",
                 **_: Any) -> str:
    """What ``describe()`` says of a group on ``device`` whose ranks are this host's
    processes (every one on device 0)."""
    with ringcomm.init(rank=rank, world_size=world, store=store, timeout=30,
                       transport=transport, device=device) as comm:
        return comm.describe()


def job_late_closer(rank: int, world: int, store: str, transport: str, late: int,
                    delay: float, device: str = "fake", **_: Any) -> dict:
    """A device allreduce over cuda-ipc, then rank ``late`` closes ``delay`` s after the
    others: they wait for it to close its mappings of their slots before they free them.
    What each rank holds on the device afterwards, and how long its close took."""
    rt = named_runtime(RUNTIME_OF[device])
    live = rt.live_allocations()
    with engine_forced("cuda-ipc"):
        comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30,
                             transport=transport, device=device)
        try:
            allreduce_checked(comm, rank, world, 1)
            if rank == late:
                time.sleep(delay)
        finally:
            started = time.monotonic()
            comm.close()
    return {"live": (live, rt.live_allocations()), "took": time.monotonic() - started}


def job_on_a_second_device(rank: int, world: int, store: str, transport: str, **_: Any
                           ) -> list[str]:
    """The rank's device is its second one (torchrun's LOCAL_RANK 1): async ops run on the
    communicator's worker thread, whose current device is the first until the op makes the
    rank's current (the fake, like CUDA, refuses a kernel or an event record on a stream of
    another device than the current one). Checked results, sync and async, on every device
    engine; the engines that ran."""
    rt = named_runtime("fake")
    devices, rt._devices = rt._devices, max(rt._devices, 2)  # what RINGCOMM_FAKE_DEVICES=2 sets
    rt.set_device(1)
    ran = []
    try:
        for engine in ("cuda-ipc", "staged", "nccl"):
            with engine_forced(engine), ringcomm.init(
                    rank=rank, world_size=world, store=store, timeout=30,
                    transport=transport, device="fake") as comm:
                comm.inline_bytes = 0  # every async op goes to the worker thread
                x = to_device(comm.device, np.full(1000, float(rank + 1), np.float32))
                ran.append(ran_on(comm, lambda comm=comm, x=x: (
                    comm.allreduce(x, async_op=True).wait(),
                    comm.choose("allreduce", x).engine)[1]))
                comm.allreduce(x)
                got = to_host(x)
            assert np.all(got == world * world * (world + 1) / 2), (engine, got[:4])
            assert rt.current_device() == 1
        return ran
    finally:
        rt.set_device(0)
        rt._devices = devices
